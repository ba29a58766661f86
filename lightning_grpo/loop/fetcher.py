"""The experience fetcher: Lightning's data fetcher that turns prompt batches into experience micro-batches, and the
:class:`ExperienceSource` protocol it calls (the loop is described in :mod:`lightning_grpo.loop.fit_loop`).

The fetcher runs the :class:`~lightning_grpo.loop.schedule.LoopPlan` the module handed the loop once: it cuts each
rollout into micro-batches, plans each optimizer step before its first (the plan travels with the micro-batches,
:class:`~lightning_grpo.training.experience.StepPlan`) and keeps its place in the epoch in a
:class:`~lightning_grpo.loop.cursor.RolloutCursor`. It asks the module only for experience.

Streaming rollouts (a :class:`~lightning_grpo.rollout.streaming.RolloutStream` the module hands the loop when
training starts, :meth:`ExperienceFetcher.use_stream`): each rollout is the stream's next finished groups
(``make_experience(None, next_prompt_batch=...)``), the stream drawing the epoch's prompt batches as it needs them, in
the data sampler's order; the epoch ends when the stream cannot finish another rollout. A checkpoint holds the
stream's state (:data:`~lightning_grpo.loop.cursor.STREAM`) beside the prompt batches drawn, and a resume draws them
again so the stream finds the prompts it must sample again.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

from lightning.pytorch.loops.fetchers import _DataFetcher
from typing_extensions import override

from lightning_grpo.loop.cursor import CURSOR_KEY, PROMPT_BATCHES, RNG, STREAM, RolloutCursor
from lightning_grpo.loop.resume import rng_states, set_rng_states
from lightning_grpo.loop.schedule import LoopPlan
from lightning_grpo.rollout.prefetch import PrefetchedRollout
from lightning_grpo.rollout.streaming import RolloutStream
from lightning_grpo.training.experience import Experience


class ExperienceSource(Protocol):
    """What the loop needs from the LightningModule (:class:`lightning_grpo.GRPOModule` implements it)."""

    @property
    def global_step(self) -> int:
        """Optimizer steps taken so far (a rollout is cut with the step it is made at)."""
        ...

    def make_experience(
        self, batch: Any, next_prompt_batch: Optional[Callable[[], Optional[Any]]] = None,
        prefetched: Optional[PrefetchedRollout] = None,
    ) -> Optional[Experience]:
        """One rollout made from a prompt batch (and more batches with dynamic sampling), or from the rollout
        ``prefetch_rollout`` started for it; ``batch`` None (streaming): from the stream's next finished groups,
        ``next_prompt_batch`` drawing its prompts; None when the epoch's data is used up."""
        ...

    def prefetch_rollout(self, batch: Any) -> PrefetchedRollout:
        """Start generating a prompt batch's rollout in the background from the current weights."""
        ...

    def wait_for_rollouts(self) -> None:
        """Wait until no rollout is generated in the background."""
        ...


class ExperienceFetcher(_DataFetcher):
    """Yields ``(micro_batch, index, 0)`` like Lightning's fetchers, making a rollout whenever the last one is
    used up.

    Args:
        source: the module that makes experience.
        plan: the fit's schedule (:class:`~lightning_grpo.loop.schedule.LoopPlan`): micro-batches per rollout (None
            when they vary, token-budget micro-batches: the epoch's length is then unknown and ends when the prompts
            run out), rollouts generated ahead, how a rollout is cut, how a step is planned.
        resume: this process's :meth:`RolloutCursor.state_dict` of a loaded checkpoint, applied before the first
            micro-batch of the resumed run.

    Attributes:
        current: the micro-batch handed out last (its ``step_start``/``step_end`` place the optimizer steps when
            the count varies, see :func:`lightning_grpo.loop.fit_loop.install_step_boundaries`).
        cursor: the position in the epoch (saved in checkpoints).
    """

    def __init__(self, source: ExperienceSource, plan: LoopPlan, resume: Optional[dict] = None) -> None:
        super().__init__()
        self.source = source
        self.plan = plan
        self.resume = resume
        self.cursor = RolloutCursor()
        self.current: Optional[Experience] = None
        self.stream: Optional[RolloutStream] = None  # streaming rollouts' (use_stream)
        self._depth: Optional[int] = None  # rollouts generated ahead (the plan's, once the loader's length is known)
        self._prompt_batches: Optional[int] = None  # prompt batches per epoch, when the loader knows

    @override
    def reset(self) -> None:
        super().reset()
        self._prompt_batches = self.length
        if self.length is not None:
            per_rollout = self.plan.micro_batches_per_rollout()
            if per_rollout is None:
                self.length = None
            else:
                self.length *= per_rollout
                self.done = self.length == 0
        self.cursor = RolloutCursor()  # rollouts generated ahead are never carried into another epoch
        self.current = None
        if self.stream is not None:  # an epoch that ended on its count (not on an empty stream) ends the stream's too
            self.stream.end_epoch()

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
            cursor = self.cursor
            if cursor.consumed >= len(cursor.micro_batches):
                self._start_rollout()
            micro = cursor.micro_batches[cursor.consumed]
            cursor.consumed += 1
        finally:
            self._stop_profiler()
        self.fetched += 1
        if self.length is not None:
            self.done = self.fetched >= self.length
        self.current = micro
        if micro.step_start:  # the step's plan goes with its micro-batches: its token statistics, before its first
            self._plan_step(cursor.consumed - 1)
        return micro, self.fetched - 1, 0

    def _plan_step(self, first: int) -> None:
        """Plan the optimizer step whose first micro-batch is ``micro_batches[first]`` (the plan's ``plan_step``, a
        collective) and attach each micro-batch's plan; the first's names the others (``StepPlan.later``)."""
        rollout = self.cursor.micro_batches
        last = first
        while last + 1 < len(rollout) and not rollout[last].step_end:
            last += 1
        members = rollout[first : last + 1]
        for member, plan in zip(members, self.plan.plan_step(members), strict=True):
            member.step_plan = plan
        head = members[0].step_plan
        assert head is not None
        members[0].step_plan = head.with_later(tuple(members[1:]))

    def _start_rollout(self) -> None:
        """Make the next rollout's experience: the oldest rollout generated ahead, or, when none is (synchronous
        rollouts are depth 0), the next prompt batch's, drawn now; first start generating the next prompt batches in
        the background from the current weights until the plan's depth is ahead. Raises ``StopIteration`` (the
        epoch is done) when no prompt batch is left."""
        cursor = self.cursor
        if self.stream is not None:
            self._start_streamed_rollout(self.stream)
            return
        if self._depth is None:
            self._depth = self.plan.rollouts_ahead(self._prompt_batches)
        if not cursor.ahead:
            drawn_before, batch = cursor.drawn, self._draw_or_finish()
            prefetched = self.source.prefetch_rollout(batch) if self._depth else None
        else:
            drawn_before, prefetched = cursor.ahead.popleft()
            batch = prefetched.batch
        # a synchronous rollout keeps the RNG states it starts from: a checkpoint written while it is made redoes it
        cursor.begin_rollout(drawn_before, self.source.global_step, rng_states() if prefetched is None else None)
        try:
            while len(cursor.ahead) < self._depth and not cursor.exhausted:
                drawn = cursor.drawn
                try:
                    following = self._draw()
                except StopIteration:
                    cursor.exhausted = True
                    break
                cursor.ahead.append((drawn, self.source.prefetch_rollout(following)))
            more = self._next_prompt_batch if prefetched is None else None
            experience = self.source.make_experience(batch, next_prompt_batch=more, prefetched=prefetched)
        except BaseException:  # e.g. SIGTERM: a checkpoint saved now regenerates this rollout and the ones after
            cursor.drawn = drawn_before
            cursor.ahead.clear()
            raise
        finally:
            cursor.making, cursor.rng = None, None
        cursor.experience = experience
        cursor.micro_batches = list(self.plan.micro_batches(experience, cursor.step))

    def _start_streamed_rollout(self, stream: RolloutStream) -> None:
        """Make the next rollout from the stream's next finished groups (the stream draws the prompt batches it
        needs, :meth:`_next_prompt_batch`); when it cannot finish another, end the epoch (``StopIteration``). The
        prompt batches drawn always count (the stream has keyed their prompts): a checkpoint written meanwhile keeps
        the groups taken as finished ones."""
        cursor = self.cursor
        cursor.step = self.source.global_step
        cursor.experience, cursor.micro_batches, cursor.consumed = None, [], 0
        experience = self.source.make_experience(None, next_prompt_batch=self._next_prompt_batch)
        if experience is None:
            stream.end_epoch()
            self.done = True
            raise StopIteration
        cursor.experience = experience
        cursor.micro_batches = list(self.plan.micro_batches(experience, cursor.step))

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps of this process's place: the cursor's state
        (:meth:`~lightning_grpo.loop.cursor.RolloutCursor.state_dict`) and, streaming, the stream's
        (:data:`~lightning_grpo.loop.cursor.STREAM`)."""
        state = self.cursor.state_dict()
        if self.stream is not None:
            state[STREAM] = self.stream.state_dict()
        return state

    def use_stream(self, stream: Optional[RolloutStream]) -> None:
        """Make every rollout from ``stream``'s finished groups (streaming rollouts; None: the fixed schedule)."""
        self.stream = stream

    def use_plan(self, plan: LoopPlan) -> None:
        """Run ``plan`` from the next rollout on (the token budget resolved once training starts)."""
        self.plan = plan

    def wait_for_rollouts(self) -> None:
        """Wait for the rollouts generated in the background (asynchronous; a no-op otherwise)."""
        if self._depth:
            self.source.wait_for_rollouts()

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
        self.cursor.drawn += 1
        return prompt_batch

    def _next_prompt_batch(self) -> Optional[Any]:
        """Another prompt batch for the rollout being made (dynamic sampling), or None when the epoch's data is used
        up. The rollout still yields the plan's micro-batches, so the epoch simply ends after fewer rollouts."""
        try:
            return self._draw()
        except StopIteration:
            return None

    def _skip_drawn(self, drawn: int, stream: Optional[RolloutStream], saved: Optional[dict]) -> None:
        """Draw the checkpoint's ``drawn`` prompt batches again; streaming, restore the stream's state ``saved`` first
        and hand it each batch (:meth:`RolloutStream.replay`).

        Raises:
            ValueError: the checkpoint was written by the other schedule (streaming or fixed).
        """
        if (stream is None) != (saved is None):
            written, now = ("streaming", "fixed-schedule") if stream is None else ("fixed-schedule", "streaming")
            raise ValueError(f"the checkpoint was written inside an epoch by {written} rollouts and this run uses "
                             f"{now} rollouts (GRPOConfig.streaming.enabled): the prompts drawn do not mean the same; "
                             "resume with the same setting, or from a checkpoint at an epoch's end")
        if stream is not None:
            assert saved is not None
            stream.load_state_dict(saved)
        while self.cursor.drawn < drawn:
            batch = self._draw()
            if stream is not None:
                stream.replay(batch)
        if stream is not None:
            stream.check_replayed()

    def _apply(self, resume: dict) -> None:
        """Continue where the checkpoint stopped: restore the RNG states, skip the prompt batches drawn before it
        (Lightning restored ``fetched``, the micro-batches already trained on) and hand out the rest of a partly
        used rollout, then the rollouts it had generated ahead.

        Streaming: the stream's state is restored first, the prompt batches drawn again are handed to it (it queues
        the prompts that were being sampled), and an epoch the checkpoint ended moves the stream's keys on.

        Raises:
            ValueError: the checkpoint stopped inside an epoch but holds no position (no ``rollout_cursors``), or was
                written by the other schedule (streaming or fixed) inside an epoch.
        """
        if resume.get(RNG) is not None:
            set_rng_states(resume[RNG])
        stream, saved = self.stream, resume.get(STREAM)
        if self.fetched == 0:  # the checkpoint ended an epoch: this one starts from its beginning
            if stream is not None and saved is not None:
                stream.load_state_dict(saved)
                stream.end_epoch()
            return
        drawn = resume.get(PROMPT_BATCHES)
        if drawn is None:
            raise ValueError("the checkpoint stopped inside an epoch but its fit loop state holds no "
                             f"{CURSOR_KEY!r}: it was not written by GRPOFitLoop, so the position in the epoch is "
                             "unknown")
        self._skip_drawn(drawn, stream, saved)
        cursor = self.cursor
        cursor.load_state_dict(resume, self.plan.device)
        if cursor.experience is not None:
            cursor.micro_batches = list(self.plan.micro_batches(cursor.experience, cursor.step))
