"""Asynchronous rollouts: the next rollouts are generated in a background thread while the trainer trains.

:class:`RolloutPrefetcher` owns one producer thread that does nothing but call ``engine.generate`` (vLLM and torch
release the GIL while they compute) and then, when given, ``on_generated`` (the experience maker's: it starts the
slow rewards' calls in the reward pool, :mod:`lightning_grpo.rewards.pool`, so that they run while the trainer
trains). Everything else happens on the trainer's thread, at points the training schedule fixes: encoding the
prompts, the weight sync, the per-request seed, scoring (collecting those calls), logprob passes and advantages
(:class:`lightning_grpo.experience.maker.ExperienceMaker`). So:

* a weight sync never overlaps a generation: :meth:`RolloutPrefetcher.start` first waits until the engine is idle
  (every generation it started has finished), then syncs the policy's current weights, then starts the next one;
* each rollout is stamped with the weights it is generated from (:attr:`PrefetchedRollout.weights_version`, the
  trainer's optimizer steps at the sync), which the staleness metrics and the bound are computed from;
* collectives (the NaN check's agreement, FSDP gathers, a server engine's weight broadcast) stay on the trainer's
  thread, in the same order on every process.

Any :class:`~lightning_grpo.protocols.engine.RolloutEngine` whose weights are its own (a colocated vLLM engine, a
remote server) works; the HF engine generates with the training model itself and is refused by
``GRPOConfig.max_staleness``. Which rollouts are started when (the staleness schedule) is the loop's business
(:class:`lightning_grpo.loop.fetcher.ExperienceFetcher`).

Reproducibility: the engine samples with per-request seeds (vLLM builds them from ``SamplingConfig.seed``), whose
base is drawn from torch's global generator in :meth:`RolloutPrefetcher.start`, while no generation runs; the
vLLM engine runs a seeded generation under ``torch.random.fork_rng``, which restores that generator when the
generation ends, so its state is reproducible whenever the engine is idle, which is when
:meth:`RolloutPrefetcher.wait_idle` returns (the loop calls it before a checkpoint). Code that draws from torch's
global generator on the trainer's thread while a rollout is generated (e.g. dropout in the policy) gets numbers that
depend on the threads' timing (the restore may rewind its draws).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional

from torch import nn

from lightning_grpo.protocols.collectives import Collectives
from lightning_grpo.protocols.engine import RolloutEngine
from lightning_grpo.protocols.rollout import RolloutOutput
from lightning_grpo.protocols.sampler import EncodedPrompts
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.rollout.image_prompts import pictures_from_state, pictures_state
from lightning_grpo.rollout.worker import RolloutWorker, prompt_rows
from lightning_grpo.training.metrics import StepTimer

log = logging.getLogger(__name__)


@dataclass
class PrefetchedRollout:
    """One prompt batch's rollout, generated (or being generated) in the background.

    Attributes:
        batch: the prompt batch (a dict of equal-length lists with a "prompt" key; the rest goes to the reward
            functions when the rollout is scored).
        num_truncated: prompts left-truncated to ``max_prompt_length``.
        num_generations: G, completions per prompt.
        sampling: the sampling settings, with the per-request seed base.
        weights_version: optimizer steps taken by the weights that generate it (the engine's version at the sync
            before it started).
        generate_s: seconds ``engine.generate`` took (0 until it finished).
        started_rewards: what ``on_generated`` returned (the reward calls started for it), or None.
    """

    batch: Any
    num_truncated: int
    num_generations: int
    sampling: SamplingConfig
    weights_version: int
    generate_s: float = 0.0
    started_rewards: Any = field(default=None, repr=False)
    future: Optional[Future] = field(default=None, repr=False)
    output: Optional[RolloutOutput] = field(default=None, repr=False)

    def done(self) -> bool:
        """The generation has finished (successfully or not)."""
        return self.output is not None or self.future is None or self.future.done()

    def succeeded(self) -> bool:
        """The generation has finished with a rollout (no error, not interrupted)."""
        if self.output is not None:
            return True
        return self.future is not None and self.future.done() and self.future.exception() is None

    def result(self) -> RolloutOutput:
        """The rollout, waiting for it if needed.

        Raises:
            RolloutInterrupted: the stop flag stopped the generation; or whatever ``engine.generate`` raised.
        """
        if self.output is None:
            assert self.future is not None, "a PrefetchedRollout without a generation"
            self.output = self.future.result()
        return self.output

    def state(self) -> dict[str, Any]:
        """A finished rollout as plain data (CPU tensors, lists, numbers), for a checkpoint."""
        return {
            "batch": pictures_state(self.batch), "num_truncated": self.num_truncated,
            "num_generations": self.num_generations,
            "sampling": {f.name: getattr(self.sampling, f.name) for f in fields(self.sampling)},
            "weights_version": self.weights_version, "generate_s": self.generate_s,
            "output": self.result().state(),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "PrefetchedRollout":
        """The finished rollout :meth:`state` saved."""
        return cls(
            batch=pictures_from_state(state["batch"]), num_truncated=int(state["num_truncated"]),
            num_generations=int(state["num_generations"]), sampling=_sampling(state["sampling"]),
            weights_version=int(state["weights_version"]), generate_s=float(state["generate_s"]),
            output=RolloutOutput.from_state(state["output"]),
        )


def _sampling(state: dict[str, Any]) -> SamplingConfig:
    """The sampling settings a checkpoint saved (older checkpoints have no banned tokens)."""
    return SamplingConfig(**{**state, "banned_token_ids": tuple(state.get("banned_token_ids", ()))})


class RolloutPrefetcher:
    """Starts rollouts on a background thread, one generation at a time, in the order they were started.

    Args:
        worker: the rollout worker (engine, prompt encoding, weight sync and versions, stop flag).
        on_generated: called on the producer thread as ``on_generated(rollout, output)`` once a generation
            succeeded; it must return at once (start work elsewhere, e.g. in the reward pool); its return value is
            kept as ``rollout.started_rewards``. An exception it raises is logged and leaves ``started_rewards`` None.
    """

    def __init__(self, worker: RolloutWorker,
                 on_generated: Optional[Callable[["PrefetchedRollout", RolloutOutput], Any]] = None) -> None:
        self.worker = worker
        self.on_generated = on_generated
        self._executor: Optional[ThreadPoolExecutor] = None
        self._started: list[PrefetchedRollout] = []  # started, not known to be finished

    def start(self, batch: Any, policy: nn.Module, num_generations: int,
              sampling: Callable[[], SamplingConfig], timer: Optional[StepTimer] = None,
              collectives: Optional[Collectives] = None) -> PrefetchedRollout:
        """On the trainer's thread: wait until the engine is idle, push ``policy``'s current weights into it (when
        the engine's are older), then start generating ``num_generations`` completions per prompt of ``batch`` in
        the background. Returns at once.

        Args:
            batch: the prompt batch ("prompt": message lists or strings).
            policy: the policy whose current weights the rollout is generated from.
            num_generations: G.
            sampling: called once, while no generation runs, for the sampling settings (it may draw the seed base
                from torch's global generator).
            timer: the wait counts as ``rollout_s``, the wake-up and sync as ``sync_s``.
            collectives: the data-parallel agreement of the NaN check (every process starts its rollouts together).

        Raises:
            NonFiniteError: ``policy`` has a NaN or infinite weight (nothing is sampled from it).
        """
        encoded = self.worker.encode(batch["prompt"], prompt_rows(batch))
        self.wait_idle(timer)
        engine = self.worker.prepare(policy, force_sync=True, timer=timer, collectives=collectives)
        rollout = PrefetchedRollout(batch, encoded.num_truncated, num_generations, sampling(),
                                    self.worker.engine_version)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_grpo_rollout")
        rollout.future = self._executor.submit(_generate, self.worker, engine, encoded, rollout, self.on_generated)
        self._started.append(rollout)
        return rollout

    def wait_idle(self, timer: Optional[StepTimer] = None) -> None:
        """Wait until every started generation has finished (their results and errors stay with their
        :class:`PrefetchedRollout`); the wait counts as ``rollout_s`` on ``timer``."""
        futures = [r.future for r in self._started if r.future is not None]
        if futures:
            with (timer or StepTimer()).span("rollout_s"):
                wait_for(futures)
        self._started = []

    @property
    def busy(self) -> bool:
        """A generation is running or queued."""
        return any(not r.done() for r in self._started)

    def close(self) -> None:
        """Stop the generations still running (the worker's stop flag, cleared again afterwards), wait for the
        thread and end it. A later :meth:`start` starts a new thread."""
        stop = self.worker.stop
        was_set = stop.is_set()
        if self.busy and not was_set:
            stop.set()
        try:
            self.wait_idle()
        finally:
            if not was_set:
                stop.clear()
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None


def _generate(worker: RolloutWorker, engine: RolloutEngine, encoded: EncodedPrompts, rollout: PrefetchedRollout,
              on_generated: Optional[Callable[[PrefetchedRollout, RolloutOutput], Any]]) -> RolloutOutput:
    """The producer thread's work: the worker's sampler (one ``engine.generate`` call; multi-turn: every turn of the
    rollout's episodes; :meth:`lightning_grpo.rollout.worker.RolloutWorker.sample`), timed, then ``on_generated``."""
    start = time.perf_counter()
    out = worker.sample(engine, encoded, rollout.num_generations, rollout.sampling)
    rollout.generate_s = time.perf_counter() - start
    if on_generated is not None:
        try:
            rollout.started_rewards = on_generated(rollout, out)
        except Exception:  # scored again, and the error raised, on the trainer's thread
            log.exception("starting the rewards of a prefetched rollout failed; it is scored on the trainer's thread")
    return out
