"""The state the producer thread and the trainer's thread share, under one lock: the prompts drawn and not yet sent
(``pending``), the groups being sampled (``in_flight``), the finished groups waiting to be trained (``ready``, in
arrival order), those the trainer took for the rollout it is making (``taken``), the keys done (``trained``,
``dropped``) and the counts of the groups dropped or sent again since the trainer last took some.

Bounds: at most ``max_inflight`` groups are sampled at once, and a group is started only while the groups being
sampled and waiting are fewer than ``capacity`` (``streaming.buffer_groups``): a group takes its place in the buffer
when it starts, so the finished groups waiting never exceed ``capacity`` and a finished group never waits for room.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from lightning_grpo.rollout.streaming.scored_groups import PromptItem, ScoredGroup


@dataclass
class StreamCounts:
    """What happened to groups between two takes of the trainer (each a count of groups).

    Attributes:
        uninformative: dropped on arrival by dynamic sampling (their primary reward did not vary).
        stale: over the age bound when the trainer looked at them (``streaming.max_off_policy_steps``).
        regenerated: of ``stale``, sent again (``streaming.on_stale="regenerate"``).
        resampled: sent again because the engine that had them was lost (``EngineUnavailable``).
    """

    uninformative: int = 0
    stale: int = 0
    regenerated: int = 0
    resampled: int = 0


class GroupBuffer:
    """The shared state (see the module docstring).

    Args:
        max_inflight: most groups sampled at once (>= 1).
        capacity: most groups sampled or waiting at once (>= ``max_inflight``).
        on_change: called (without the lock) when a group may be started: prompts fed, a group taken or dropped, a
            group to send again (the producer's wake-up).
    """

    def __init__(self, max_inflight: int, capacity: int, on_change: Callable[[], None] = lambda: None) -> None:
        if max_inflight < 1 or capacity < max_inflight:
            raise ValueError(f"GroupBuffer needs max_inflight >= 1 and capacity >= max_inflight, got {max_inflight}, "
                             f"{capacity}")
        self.max_inflight, self.capacity = max_inflight, capacity
        self.on_change = on_change
        self.cond = threading.Condition()
        self.pending: deque[PromptItem] = deque()
        self.in_flight: dict[int, PromptItem] = {}
        self.ready: deque[ScoredGroup] = deque()
        self.taken: list[ScoredGroup] = []
        self.trained: list[int] = []
        self.dropped: list[int] = []
        self.counts = StreamCounts()
        self.error: Optional[BaseException] = None

    # ---------------------------------------------------------------- the trainer's thread
    def feed(self, items: Iterable[PromptItem], front: bool = False) -> None:
        """Queue prompts to sample (``front``: before the others, in their order: groups sent again)."""
        items = list(items)
        with self.cond:
            if front:
                self.pending.extendleft(reversed(items))
            else:
                self.pending.extend(items)
            self.cond.notify_all()
        self.on_change()

    def raise_error(self) -> None:
        """Raise what failed on the producer's side (a reward function, the engine), on the trainer's thread."""
        if self.error is not None:
            raise RuntimeError(f"streaming rollouts failed: {type(self.error).__name__}: {self.error}") \
                from self.error

    # ---------------------------------------------------------------- the producer's thread
    def start_next(self) -> Optional[PromptItem]:
        """The next prompt to send to the engine, marked in flight, when the bounds allow one; else None."""
        with self.cond:
            busy = len(self.in_flight)
            if not self.pending or busy >= self.max_inflight or busy + len(self.ready) >= self.capacity:
                return None
            item = self.pending.popleft()
            item.attempts += 1
            self.in_flight[item.key] = item
            return item

    def finish(self, item: PromptItem, group: Optional[ScoredGroup]) -> None:
        """A group came back and was scored: ``group`` waits to be trained, or (None) dynamic sampling dropped it."""
        with self.cond:
            if self.in_flight.pop(item.key, None) is None:
                return  # the stream was reset (a new epoch, a load) while it was sampled
            if group is None:
                self.dropped.append(item.key)
                self.counts.uninformative += 1
            else:
                self.ready.append(group)
            self.cond.notify_all()
        self.on_change()  # a place in flight is free

    def resample(self, item: PromptItem) -> None:
        """The engine that had ``item``'s group was lost: it goes first in line again (never lost, never twice)."""
        with self.cond:
            if self.in_flight.pop(item.key, None) is None:
                return
            self.pending.appendleft(item)
            self.counts.resampled += 1
            self.cond.notify_all()
        self.on_change()

    def fail(self, error: BaseException) -> None:
        """Something on the producer's side failed: the trainer raises it at its next look."""
        with self.cond:
            if self.error is None:
                self.error = error
            self.cond.notify_all()

    # ---------------------------------------------------------------- views (under the lock)
    @property
    def idle(self) -> bool:
        """Nothing pending or being sampled."""
        return not self.pending and not self.in_flight
