"""Rewards that take time (a reward model, an LLM judge, code run in a sandbox) and the bounded pool they run in.

A :class:`PooledReward` is a reward function (``fn(prompts, completions, **columns) -> list[float | None]``) that
also declares how its calls may be split: ``chunk_size`` completions per call (or one group of G, or the whole
rollout), each call a task of the :class:`RewardPool`, so a rollout's slow rewards are scored ``width`` at a time
and, with asynchronous rollouts, while the trainer trains (:mod:`lightning_grpo.experience.maker`). It may also
declare ``outcomes``: labels it counts per completion (e.g. a sandbox's ``timeout``), logged as
``rewards/<name>/<outcome>`` (the fraction of completions).

Exactness: the slices depend on ``chunk_size`` only, never on the pool's width, and each slice's rewards go back to
its own rows, so every width (and no pool at all) gives the same rewards for rewards that are a function of their
inputs.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Union

#: Completions per call of a :class:`PooledReward`: k, ``"group"`` (the G completions of one prompt, e.g. a judge
#: that ranks them together), or None (the whole rollout in one call, e.g. a reward model that batches itself).
ChunkSize = Union[int, Literal["group"], None]


@dataclass
class RewardChunk:
    """The rewards of one call of a :class:`PooledReward` and its outcome counts.

    Attributes:
        values: one reward per completion of the call, None where it cannot score it (a masked reward).
        outcomes: ``outcome -> number of completions`` for the reward's declared ``outcomes`` (missing keys are 0).
    """

    values: list
    outcomes: dict[str, int] = field(default_factory=dict)


class PooledReward:
    """Base of reward functions whose calls on slices of a rollout may run concurrently in the :class:`RewardPool`.

    Subclasses implement :meth:`score_chunk` and set ``chunk_size`` and ``outcomes``; they must be safe to call
    from several threads at once. Called as a plain reward function they score the whole batch in one call.

    Args:
        name: the metric name (``rewards/<name>/mean``, ``timing/reward_<name>_s``).

    Attributes:
        chunk_size: completions per call (:data:`ChunkSize`).
        outcomes: the outcome labels :meth:`score_chunk` counts (``rewards/<name>/<outcome>``).
        compute_dtype: the dtype the trainer computes its policy in (bfloat16 under ``Trainer(precision=
            "bf16-mixed")`` or ``"bf16-true"``), set by :class:`lightning_grpo.GRPOModule` before :meth:`setup`;
            None used alone. A reward model with ``dtype="auto"`` loads its weights in it.
    """

    chunk_size: ChunkSize = 1
    outcomes: tuple[str, ...] = ()
    compute_dtype: Optional[Any] = None

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a reward's name must be a non-empty string, got {name!r}")
        self.__name__ = name

    def setup(self, device: object) -> None:
        """Called by :class:`lightning_grpo.GRPOModule` in each process before any scoring, with that process's
        device (a ``torch.device``; e.g. a reward model puts itself there). Does nothing by default."""

    def score_chunk(self, prompts: list, completions: list[str], columns: dict[str, list]) -> RewardChunk:
        """Score the completions of one call (each list has the call's length)."""
        raise NotImplementedError

    def __call__(self, prompts: list, completions: list[str], **columns: list) -> list:
        return self.score_chunk(prompts, completions, columns).values


class PooledFunction(PooledReward):
    """A plain reward function declared poolable (see :func:`pooled`)."""

    def __init__(self, fn: Callable[..., list], chunk_size: ChunkSize = 1, name: Optional[str] = None) -> None:
        if chunk_size is not None and chunk_size != "group" and (not isinstance(chunk_size, int) or chunk_size < 1):
            raise ValueError(f"chunk_size={chunk_size!r} must be an integer >= 1, 'group' or None")
        super().__init__(name or getattr(fn, "__name__", None) or type(fn).__name__)
        self.fn = fn
        self.chunk_size = chunk_size

    def score_chunk(self, prompts: list, completions: list[str], columns: dict[str, list]) -> RewardChunk:
        return RewardChunk(list(self.fn(prompts, completions, **columns)))


def pooled(fn: Callable[..., list], chunk_size: ChunkSize = 1, name: Optional[str] = None) -> PooledFunction:
    """Declare the reward function ``fn`` safe to call on slices of ``chunk_size`` completions from several threads
    at once: its calls then run in the reward pool (e.g. a function that calls a web service per completion)."""
    return PooledFunction(fn, chunk_size, name)


class RewardPool:
    """A bounded pool of threads (``width``) that runs the calls of :class:`PooledReward` functions.

    Threads suit these rewards: a sandbox run waits on a subprocess, a judge on HTTP, a reward model in torch, all of
    which release the GIL. The threads start with the first task; :meth:`close` ends them.

    Raises:
        ValueError: ``width < 1``.
    """

    def __init__(self, width: int) -> None:
        if not isinstance(width, int) or width < 1:
            raise ValueError(f"the reward pool's width must be an integer >= 1, got {width!r}")
        self.width = width
        self._executor: Optional[ThreadPoolExecutor] = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable, *args) -> Future:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(self.width, thread_name_prefix="lightning_grpo_reward")
            return self._executor.submit(fn, *args)

    def __getstate__(self) -> dict:  # picklable (DDP spawn): the threads are not copied
        return {"width": self.width}

    def __setstate__(self, state: dict) -> None:
        self.width, self._executor, self._lock = state["width"], None, threading.Lock()

    def close(self) -> None:
        """Drop the queued tasks, wait for the running ones and end the threads (a later :meth:`submit` starts new
        ones)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
