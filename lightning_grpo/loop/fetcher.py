"""The experience fetcher: Lightning's data fetcher that turns prompt batches into experience micro-batches, and the
:class:`ExperienceSource` protocol it calls (the loop is described in :mod:`lightning_grpo.loop.fit_loop`)."""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterator, Optional, Protocol

import torch
from lightning.pytorch.loops.fetchers import _DataFetcher
from typing_extensions import override

from lightning_grpo.loop.resume import (
    PROMPT_BATCHES_KEY,
    ResumeState,
    experience_from_state,
    experience_state,
    rng_states,
    set_rng_states,
)
from lightning_grpo.rollout.prefetch import PrefetchedRollout
from lightning_grpo.training.experience import Experience


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

    def rollouts_ahead(self, prompt_batches: Optional[int] = None) -> int:
        """Rollouts generated in the background ahead of the one being trained; 0 = synchronous. Raises ValueError
        when they would not fit in an epoch of ``prompt_batches`` rollout batches (None: unknown)."""
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

    def prepare_step(self, micro_batches: list[Experience]) -> None:
        """Called with an optimizer step's micro-batches (in training order) just before the ``training_step`` of
        the first: whatever the step needs from all of them (step-level token statistics)."""
        ...


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
        self._prompt_batches: Optional[int] = None  # prompt batches per epoch, when the loader knows

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

    @override
    def reset(self) -> None:
        super().reset()
        self._prompt_batches = self.length
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

    @override
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
        if micro.step_start:  # the step's plan goes forward: its token statistics before its first training_step
            self.source.prepare_step(self.current_step())
        return micro, self.fetched - 1, 0

    def _new_rollout(self) -> None:
        if self._ahead is None:
            self._ahead = self.source.rollouts_ahead(self._prompt_batches)
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
        used rollout.

        Raises:
            ValueError: the checkpoint stopped inside an epoch but holds no position (``prompt_batches_drawn``).
        """
        if resume.rng is not None:
            set_rng_states(resume.rng)
        if self.fetched == 0:
            return  # the checkpoint ended an epoch: this one starts from its beginning
        drawn = resume.prompt_batches
        if drawn is None:
            raise ValueError("the checkpoint stopped inside an epoch but its fit loop state holds no "
                             f"{PROMPT_BATCHES_KEY!r}: it was not written by GRPOFitLoop, so the position in the epoch "
                             "is unknown")
        while self._index < drawn:
            self._draw()
        if resume.partial is not None:
            self._experience = experience_from_state(resume.partial["experience"], self.source.device)
            self._step = int(resume.partial["step"])
            self._rollout = list(self.source.micro_batches(self._experience, self._step))
            self._position = int(resume.partial["consumed"])
        for entry in resume.prefetched or []:
            self._prefetched.append((int(entry["drawn_before"]), PrefetchedRollout.from_state(entry["rollout"])))
