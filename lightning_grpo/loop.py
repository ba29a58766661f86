"""The generate-then-train loop.

Lightning's fit loop pulls batches from a data fetcher and runs ``training_step`` on each, stepping the
optimizer every ``accumulate_grad_batches`` batches. :class:`GRPOFitLoop` swaps in an
:class:`ExperienceFetcher`, which turns each batch of *prompts* from the user's DataLoader into a rollout
(generate, score, advantages, old/ref logprobs) and then hands out its experience micro-batch by micro-batch,
``num_iterations`` shuffled passes in all. A rollout is made only when the previous one is used up, i.e. after
the optimizer step that consumed it: rollout k+1 samples from the weights after step k.

Asynchronous rollouts (``GRPOConfig.max_staleness`` = k > 0, ``a = k // steps_per_rollout`` rollouts ahead): when a
rollout is needed, the fetcher takes the oldest prefetched one and starts the generation of the next prompt
batches in the background from the current weights until ``a`` are ahead, then makes the experience (scoring,
logprobs, advantages) of the taken one while those generate. So rollout ``j`` of an epoch is generated from the
weights at the start of rollout ``j - a`` (the epoch's first ``a + 1`` from those at the epoch's start; prompt
batches are never drawn across epochs): with one optimizer step per rollout the staleness per step is
``[0, 1, ..., a - 1, a, a, ...]``. A checkpoint first waits for the generations in flight and stores the prefetched
rollouts with their weight versions, so a resumed run trains on the same rollouts.

Everything else (optimizer steps, gradient clipping, accumulation, precision, ``max_steps``, validation,
logging, callbacks, checkpointing) is Lightning's own. ``GRPOModule.setup`` installs the loop, so a plain
``Trainer(...).fit(module, datamodule)`` runs it. Lightning's loop classes are private: the package pins
``lightning>=2.6,<2.7``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Protocol

import lightning as L
import torch
from lightning.pytorch.loops.fetchers import _DataFetcher
from lightning.pytorch.loops.fit_loop import _FitLoop

from lightning_grpo.experience import Experience
from lightning_grpo.resume import (
    experience_from_state,
    experience_state,
    gather_per_process,
    rng_states,
    set_rng_states,
    this_process,
)
from lightning_grpo.rollout.prefetch import PrefetchedRollout

#: Keys in the fit loop's own checkpoint state: prompt batches drawn in the current epoch, every process's RNG
#: states, every process's partly used rollout (or None), every process's prefetched rollouts (asynchronous).
PROMPT_BATCHES_KEY = "prompt_batches_drawn"
RNG_KEY = "rng_states"
PARTIAL_KEY = "partial_rollouts"
PREFETCHED_KEY = "prefetched_rollouts"


class ExperienceSource(Protocol):
    """What the loop needs from the LightningModule (:class:`lightning_grpo.GRPOModule` implements it)."""

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far."""
        ...

    @property
    def device(self) -> torch.device:
        """Where experience tensors live."""
        ...

    def make_experience(
        self, batch: Any, next_prompt_batch: Optional[Callable[[], Optional[Any]]] = None,
        prefetched: Optional[PrefetchedRollout] = None,
    ) -> Experience:
        """One rollout made from a prompt batch (and more batches with dynamic sampling), or from the rollout
        ``prefetch_rollout`` started for it."""
        ...

    def rollouts_ahead(self) -> int:
        """Rollouts generated in the background ahead of the one being trained; 0 = synchronous."""
        ...

    def prefetch_rollout(self, batch: Any) -> PrefetchedRollout:
        """Start generating a prompt batch's rollout in the background from the current weights."""
        ...

    def wait_for_rollouts(self) -> None:
        """Wait until no rollout is generated in the background."""
        ...

    def micro_batches(self, experience: Experience, step: Optional[int] = None) -> Iterator[Experience]:
        """The rollout's micro-batches in training order; ``step`` (the optimizer step the rollout was made at)
        seeds their shuffle."""
        ...

    def micro_batches_per_rollout(self) -> Optional[int]:
        """``training_step`` calls per rollout, or None when it varies (token budgets)."""
        ...


@dataclass
class ResumeState:
    """What a checkpoint says about the loop's position, for this process.

    Attributes:
        prompt_batches: prompt batches drawn in the checkpoint's epoch (None in checkpoints older than it).
        rng: the RNG states (:func:`lightning_grpo.resume.rng_states`) the next rollout starts from, or None.
        partial: a rollout whose micro-batches were not all trained on: ``experience``
            (:func:`lightning_grpo.resume.experience_state`), ``step`` (seeds its shuffle) and ``consumed``.
        prefetched: rollouts generated ahead (asynchronous), oldest first: ``drawn_before`` (prompt batches drawn
            before its own) and ``rollout`` (:meth:`lightning_grpo.rollout.prefetch.PrefetchedRollout.state`).
    """

    prompt_batches: Optional[int] = None
    rng: Optional[dict] = None
    partial: Optional[dict] = None
    prefetched: Optional[list] = None


class ExperienceFetcher(_DataFetcher):
    """Yields ``(micro_batch, index, 0)`` like Lightning's fetchers, making a rollout whenever the last one is
    used up.

    Args:
        source: the module that makes experience (``make_experience`` and ``micro_batches`` are called on it).
        micro_batches_per_rollout: training_step calls that one rollout yields; None when it varies (token-budget
            micro-batches): the epoch's length is then unknown and ends when the prompts run out.
        resume: the position of a loaded checkpoint, applied before the first micro-batch of the resumed run.

    Attributes:
        current: the micro-batch handed out last (its ``step_start``/``step_end`` place the optimizer steps when
            the count varies, see :func:`install_step_boundaries`).
        prompt_batches_drawn: prompt batches taken from the DataLoader in this epoch (saved in checkpoints).
        rollout_rng: while a rollout is being made, the RNG states it started from (a checkpoint written then,
            e.g. on SIGTERM, regenerates the same rollout on resume), else None.
    """

    def __init__(self, source: ExperienceSource, micro_batches_per_rollout: Optional[int],
                 resume: Optional[ResumeState] = None) -> None:
        super().__init__()
        self.source = source
        self.micro_batches_per_rollout = micro_batches_per_rollout
        self.resume = resume
        self.rollout_rng: Optional[dict] = None
        self._rollout: list[Experience] = []  # the current rollout's micro-batches
        self._position = 0  # how many of them were handed out
        self._experience: Optional[Experience] = None
        self._step = 0
        self._index = 0
        self._drawn_before_rollout: Optional[int] = None
        self.current: Optional[Experience] = None
        self._ahead: Optional[int] = None  # rollouts generated ahead (source.rollouts_ahead, asked once)
        self._prefetched: deque[tuple[int, PrefetchedRollout]] = deque()  # (prompt batches drawn before, rollout)
        self._exhausted = False  # the epoch's prompt batches are all drawn

    @property
    def prompt_batches_drawn(self) -> int:
        """Prompt batches of this epoch's finished rollouts (a rollout in progress, e.g. when a signal handler saves a
        checkpoint in its middle, does not count: the resumed run regenerates it)."""
        return self._index if self._drawn_before_rollout is None else self._drawn_before_rollout

    def current_step(self) -> list[Experience]:
        """The micro-batches of the optimizer step whose first micro-batch was handed out last, in order."""
        start = end = self._position - 1
        while end + 1 < len(self._rollout) and not self._rollout[end].step_end:
            end += 1
        return self._rollout[start : end + 1]

    def partial_rollout(self) -> Optional[dict]:
        """The current rollout as plain data when some of its micro-batches are still to be trained on, else None."""
        if self._experience is None or self._position >= len(self._rollout):
            return None
        return {"experience": experience_state(self._experience), "step": self._step, "consumed": self._position}

    def reset(self) -> None:
        super().reset()
        if self.length is not None:
            if self.micro_batches_per_rollout is None:
                self.length = None
            else:
                self.length *= self.micro_batches_per_rollout
                self.done = self.length == 0
        self._rollout, self._position, self._experience = [], 0, None
        self._index = 0
        self.current = None
        self._prefetched.clear()  # never carried into another epoch
        self._exhausted = False

    def __next__(self) -> Any:
        assert self.iterator is not None
        if self.length is not None and self.fetched >= self.length:
            self.done = True
            raise StopIteration
        self._start_profiler()
        try:
            if self.resume is not None:
                resume, self.resume = self.resume, None
                self._apply(resume)
            if self._position >= len(self._rollout):
                self._new_rollout()
            micro = self._rollout[self._position]
            self._position += 1
        finally:
            self._stop_profiler()
        self.fetched += 1
        if self.length is not None:
            self.done = self.fetched >= self.length
        self.current = micro
        return micro, self.fetched - 1, 0

    def _new_rollout(self) -> None:
        if self._ahead is None:
            self._ahead = self.source.rollouts_ahead()
        if self._ahead > 0:
            self._new_prefetched_rollout(self._ahead)
            return
        drawn_before = self._index
        prompt_batch = self._draw_or_finish()
        self.rollout_rng, self._drawn_before_rollout = rng_states(), drawn_before
        self._step = self.source.global_step
        self._experience, self._rollout, self._position = None, [], 0
        try:
            experience = self.source.make_experience(prompt_batch, next_prompt_batch=self._next_prompt_batch)
        except BaseException:  # e.g. a rollout stopped by SIGTERM: a checkpoint saved now regenerates it
            self._index = drawn_before
            raise
        finally:
            self.rollout_rng, self._drawn_before_rollout = None, None
        self._experience = experience
        self._rollout = list(self.source.micro_batches(experience, self._step))

    def _new_prefetched_rollout(self, ahead: int) -> None:
        """Asynchronous: take the oldest prefetched rollout (start it first if none is), start the next ones from
        the current weights until ``ahead`` are generated ahead, then make the taken one's experience."""
        if not self._prefetched:
            drawn_before = self._index
            prompt_batch = self._draw_or_finish()
            self._prefetched.append((drawn_before, self.source.prefetch_rollout(prompt_batch)))
        drawn_before, prefetched = self._prefetched.popleft()
        self._drawn_before_rollout = drawn_before
        self._step = self.source.global_step
        self._experience, self._rollout, self._position = None, [], 0
        try:
            while len(self._prefetched) < ahead and not self._exhausted:
                index = self._index
                try:
                    prompt_batch = self._draw()
                except StopIteration:
                    self._exhausted = True
                    break
                self._prefetched.append((index, self.source.prefetch_rollout(prompt_batch)))
            experience = self.source.make_experience(prefetched.batch, prefetched=prefetched)
        except BaseException:  # e.g. SIGTERM: a checkpoint saved now regenerates this rollout and the ones after
            self._index = drawn_before
            self._prefetched.clear()
            raise
        finally:
            self._drawn_before_rollout = None
        self._experience = experience
        self._rollout = list(self.source.micro_batches(experience, self._step))

    def wait_for_rollouts(self) -> None:
        """Wait for the rollouts generated in the background (asynchronous; a no-op otherwise)."""
        if self._ahead:
            self.source.wait_for_rollouts()

    def position(self) -> tuple[int, list[dict]]:
        """For a checkpoint (call :meth:`wait_for_rollouts` first): the prompt batches drawn and the prefetched
        rollouts that finished, oldest first, as plain data. A prefetched rollout that failed or was interrupted,
        and the ones after it, are not kept: their prompt batches count as not drawn (regenerated on resume); so
        are all of them while a rollout is being made."""
        if self._drawn_before_rollout is not None:
            return self._drawn_before_rollout, []
        states: list[dict] = []
        for drawn_before, prefetched in self._prefetched:
            if not prefetched.succeeded():
                return drawn_before, states
            states.append({"drawn_before": drawn_before, "rollout": prefetched.state()})
        return self._index, states

    def _draw_or_finish(self) -> Any:
        """:meth:`_draw`, marking the epoch done when the prompts are exhausted (``StopIteration`` re-raised)."""
        try:
            return self._draw()
        except StopIteration:
            self.done = True
            raise

    def _draw(self) -> Any:
        assert self.iterator is not None
        prompt_batch, _, _ = next(self.iterator)
        self._index += 1
        return prompt_batch

    def _next_prompt_batch(self) -> Optional[Any]:
        """Another prompt batch for the rollout being made (dynamic sampling), or None when the epoch's data is used
        up. The rollout still yields ``micro_batches_per_rollout`` micro-batches, so the epoch simply ends after
        fewer rollouts."""
        try:
            return self._draw()
        except StopIteration:
            return None

    def _apply(self, resume: ResumeState) -> None:
        """Continue where the checkpoint stopped: restore the RNG states, skip the prompt batches drawn before it
        (Lightning restored ``fetched``, the micro-batches already trained on) and hand out the rest of a partly
        used rollout. Checkpoints older than the saved position fall back to whole rollouts (a partly used one is
        dropped)."""
        if resume.rng is not None:
            set_rng_states(resume.rng)
        if self.fetched == 0:
            return  # the checkpoint ended an epoch: this one starts from its beginning
        drawn = resume.prompt_batches
        if drawn is None:  # an old checkpoint: one prompt batch per started rollout
            per_rollout = self.micro_batches_per_rollout or 1
            drawn = -(-self.fetched // per_rollout)  # ceil
            self.fetched = drawn * per_rollout
        while self._index < drawn:
            self._draw()
        if resume.partial is not None:
            self._experience = experience_from_state(resume.partial["experience"], self.source.device)
            self._step = int(resume.partial["step"])
            self._rollout = list(self.source.micro_batches(self._experience, self._step))
            self._position = int(resume.partial["consumed"])
        for entry in resume.prefetched or []:
            self._prefetched.append((int(entry["drawn_before"]), PrefetchedRollout.from_state(entry["rollout"])))


class GRPOFitLoop(_FitLoop):
    """Lightning's fit loop with an :class:`ExperienceFetcher`. State (progress counters) is the base class's,
    so checkpoints of either loop load into the other.

    A training "batch" here is one experience micro-batch; ``val_check_interval`` given as an int counts them,
    as a float it is a fraction of the epoch's micro-batches (the prompt batches times micro-batches per rollout).
    """

    def __init__(self, trainer: "L.Trainer", source: _FitLoop) -> None:
        super().__init__(trainer, min_epochs=source.min_epochs, max_epochs=source.max_epochs)
        self.epoch_loop = source.epoch_loop
        self._data_source = source._data_source  # the Trainer attached the user's datamodule/dataloaders to it
        self.resume_state: Optional[ResumeState] = None  # the position of a loaded checkpoint

    @property
    def resume_prompt_batches(self) -> Optional[int]:
        """Prompt batches drawn in the epoch of a loaded checkpoint, else None."""
        return None if self.resume_state is None else self.resume_state.prompt_batches

    @resume_prompt_batches.setter
    def resume_prompt_batches(self, value: int) -> None:
        self.resume_state = self.resume_state or ResumeState()
        self.resume_state.prompt_batches = value

    def current_step(self) -> list[Experience]:
        """The micro-batches of the optimizer step being trained (call it at the step's first micro-batch)."""
        fetcher = self._data_fetcher
        return fetcher.current_step() if isinstance(fetcher, ExperienceFetcher) else []

    def on_save_checkpoint(self) -> dict:
        """The base state plus the position inside the epoch: prompt batches drawn, every process's RNG states
        (those the current rollout started from while one is being made) and a partly used rollout. A collective
        under multi-process strategies (Lightning builds a checkpoint on every process)."""
        state_dict = super().on_save_checkpoint()
        fetcher = self._data_fetcher
        if isinstance(fetcher, ExperienceFetcher):
            fetcher.wait_for_rollouts()  # asynchronous: the prefetched rollouts and the RNG states are final now
            drawn, prefetched = fetcher.position()
            state_dict[PROMPT_BATCHES_KEY] = drawn
            state_dict[RNG_KEY] = gather_per_process(fetcher.rollout_rng or rng_states())
            state_dict[PARTIAL_KEY] = gather_per_process(fetcher.partial_rollout())
            state_dict[PREFETCHED_KEY] = gather_per_process(prefetched)
        return state_dict

    def on_load_checkpoint(self, state_dict: dict) -> None:
        self.resume_state = ResumeState(
            prompt_batches=state_dict.get(PROMPT_BATCHES_KEY, self.resume_prompt_batches),  # old: module's hook
            rng=this_process(state_dict.get(RNG_KEY), "RNG states"),
            partial=this_process(state_dict.get(PARTIAL_KEY), "partly used rollouts"),
            prefetched=this_process(state_dict.get(PREFETCHED_KEY), "prefetched rollouts"),
        )
        super().on_load_checkpoint(state_dict)

    def setup_data(self) -> None:
        first = self._combined_loader is None or self._should_reload_train_dl
        trainer = self.trainer
        val_check_interval = trainer.val_check_interval
        trainer.val_check_interval = 1.0  # the base class would check an int against prompt batches
        try:
            super().setup_data()
        finally:
            trainer.val_check_interval = val_check_interval
        if not first or self._combined_loader is None:
            return
        source: ExperienceSource = trainer.lightning_module  # type: ignore[assignment]
        per_rollout = source.micro_batches_per_rollout()
        fetcher = ExperienceFetcher(source, per_rollout, self.resume_state)
        fetcher.setup(self._combined_loader)
        iter(fetcher)
        self._data_fetcher = fetcher
        if per_rollout is None:
            install_step_boundaries(self, fetcher)
            if self.max_batches != 0:
                self.max_batches = float("inf")  # the micro-batches per rollout vary: the epoch ends with the data
            if isinstance(val_check_interval, float) and val_check_interval != 1.0:
                raise ValueError(
                    f"Trainer(val_check_interval={val_check_interval}) is a fraction of an epoch, whose length in "
                    "micro-batches is unknown with GRPOConfig.max_tokens_per_microbatch: give an int (micro-batches) "
                    "or 1.0 (once per epoch)"
                )
        elif self.max_batches != float("inf"):
            self.max_batches = int(self.max_batches) * per_rollout
        if getattr(trainer, "_val_check_time_interval", None) is not None or self.max_batches == 0:
            return
        if isinstance(val_check_interval, int):
            trainer.val_check_batch = val_check_interval
        elif self.max_batches != float("inf"):
            trainer.val_check_batch = max(1, int(self.max_batches * val_check_interval))


def install_step_boundaries(loop: GRPOFitLoop, fetcher: ExperienceFetcher) -> None:
    """Let the micro-batches' ``step_start``/``step_end`` flags, not a count, decide where Lightning zeroes the
    gradients and steps the optimizer (token-budget micro-batches: ``Trainer(accumulate_grad_batches=1)`` and a
    varying number of micro-batches per step). Patches two private methods of Lightning 2.6's training epoch loop
    on this instance only."""
    epoch_loop = loop.epoch_loop
    accumulation = epoch_loop.automatic_optimization
    count_reached = type(epoch_loop)._accumulated_batches_reached.__get__(epoch_loop)
    count_zero_grad = type(accumulation)._make_zero_grad_fn.__get__(accumulation)

    def accumulated_batches_reached() -> bool:
        current = fetcher.current
        return count_reached() if current is None else current.step_end

    def make_zero_grad_fn(batch_idx: int, optimizer: Any) -> Any:
        zero_grad = count_zero_grad(batch_idx, optimizer)
        current = fetcher.current
        return zero_grad if current is None or current.step_start else None

    epoch_loop._accumulated_batches_reached = accumulated_batches_reached  # type: ignore[method-assign]
    accumulation._make_zero_grad_fn = make_zero_grad_fn  # type: ignore[method-assign]


def install_loop(trainer: "L.Trainer") -> Optional[GRPOFitLoop]:
    """Replace ``trainer.fit_loop`` with a :class:`GRPOFitLoop` (idempotent). Returns the installed loop."""
    if isinstance(trainer.fit_loop, GRPOFitLoop):
        return trainer.fit_loop
    loop = GRPOFitLoop(trainer, trainer.fit_loop)
    trainer.fit_loop = loop
    return loop
