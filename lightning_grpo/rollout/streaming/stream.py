"""The trainer's side of streaming rollouts: :class:`RolloutStream` feeds prompts to the producer in the data
sampler's order, takes the next finished groups for each rollout (waiting for them), applies the age bound, and keeps
what a checkpoint needs to train every prompt exactly once.

Every call here is on the trainer's thread; the producer (:mod:`lightning_grpo.rollout.streaming.producer`) runs on
the engine's event loop. Both share the :class:`~lightning_grpo.rollout.streaming.buffer.GroupBuffer`.

Keys: each prompt drawn gets the next key of this process's data order (the first prompt of an epoch follows the
previous epoch's last), so a key names one prompt of one epoch for the whole run.

The age bound (``streaming.max_off_policy_steps`` = k, prime-rl's rule with the wait in the buffer counted): a group
whose oldest token was sampled by weights more than k optimizer steps older than the weights of the last optimizer
step its rollout is trained in (``version + steps_per_rollout - 1``) is never trained: ``on_stale="drop"`` drops its
prompt for this epoch, ``"regenerate"`` sends it again first in line. It is checked whenever the trainer looks at the
buffer (each take) and after each weight update, and counted (``streaming/stale_groups``).

Checkpoints (:meth:`RolloutStream.state_dict`): the keys trained and dropped this epoch, the finished groups (scored,
with their versions; those taken for a rollout still being made count as finished: it is made again) and the keys of
the groups being sampled or waiting to be sent. A resume samples those again from its own weights: a sample that was
half generated is not continued (its tokens came from weights the resumed run may not hold, and no engine keeps a
partial sample across a restart), so it is sampled anew, never lost and never trained twice.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from lightning_grpo.config.streaming import StreamingConfig
from lightning_grpo.protocols.rollout import StopFlag
from lightning_grpo.protocols.sampler import EncodedPrompts
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.protocols.streaming import GroupRequest, StreamingEngine
from lightning_grpo.rollout.streaming.buffer import GroupBuffer, StreamCounts
from lightning_grpo.rollout.streaming.event_loop import EngineLoop
from lightning_grpo.rollout.streaming.group_scoring import GroupScorer
from lightning_grpo.rollout.streaming.producer import StreamingProducer
from lightning_grpo.rollout.streaming.scored_groups import PromptItem, ScoredGroup

log = logging.getLogger(__name__)

#: How often (seconds) the trainer's wait for groups looks at the stop flag (SIGTERM).
POLL_S = 0.05


@dataclass
class TakenGroups:
    """The groups the trainer took for one rollout.

    Attributes:
        groups: ``prompts_per_step`` finished groups, in the order they finished.
        version: the trainer's optimizer steps when it took them (the weights they are trained from).
        counts: the groups dropped or sent again since the previous take.
        wait_s: seconds the trainer waited for them.
        interval_s: seconds since the previous take (the stream's time per rollout).
        in_flight: groups being sampled when they were taken.
        ready: finished groups left waiting.
    """

    groups: list[ScoredGroup]
    version: int
    counts: StreamCounts
    wait_s: float
    interval_s: float
    in_flight: int
    ready: int

    @property
    def prompt_keys(self) -> list[int]:
        """The groups' prompt keys, in order."""
        return [g.key for g in self.groups]


class RolloutStream:
    """See the module docstring.

    Args:
        engine: the streaming engine.
        loop: the event loop it is driven from.
        config: ``GRPOConfig.streaming``.
        scorer: scores each group as it arrives.
        encode: a prompt list -> its ids (the rollout worker's :meth:`~lightning_grpo.rollout.worker.RolloutWorker.
            encode`; one prompt at a time here).
        sampling: the sampling settings of every group (its ``seed`` unused).
        num_generations: G.
        prompts_per_step: groups per rollout (the datamodule's ``prompts_per_step``).
        steps_per_rollout: optimizer steps per rollout (the age bound counts to the last).
        stop: the stop flag (SIGTERM) the trainer's wait polls.
        seed: group ``key`` is sampled with seeds ``seed + key * G + j``; None: unseeded.

    Raises:
        ValueError: ``config.buffer_groups`` below ``prompts_per_step``.
    """

    def __init__(self, engine: StreamingEngine, loop: EngineLoop, config: StreamingConfig, scorer: GroupScorer,
                 encode: Callable[[Sequence[Any]], EncodedPrompts], sampling: SamplingConfig, num_generations: int,
                 prompts_per_step: int, steps_per_rollout: int, stop: StopFlag, seed: Optional[int]) -> None:
        self.config = config
        self.max_inflight, capacity = config.sizes(prompts_per_step)
        self.prompts_per_step, self.steps_per_rollout = prompts_per_step, steps_per_rollout
        self.encode, self.sampling, self.num_generations = encode, sampling, num_generations
        self.stop, self.seed = stop, seed
        self.buffer = GroupBuffer(self.max_inflight, capacity)
        self.producer = StreamingProducer(engine, loop, self.buffer, self.request, scorer)
        self.first_key = 0  # the key of this epoch's first prompt
        self.prompts_drawn = 0  # prompts drawn this epoch
        self.exhausted = False  # the epoch's prompts are all drawn
        self._last_take: Optional[float] = None
        self._replay: Optional[tuple[int, set[int]]] = None  # resuming: (prompts drawn, keys to sample again)

    # ---------------------------------------------------------------- life
    def open(self) -> None:
        """Start keeping groups in flight (the engine must hold the trainer's weights)."""
        self.producer.start()

    def close(self) -> None:
        """Stop sampling (the groups in flight stay counted as to sample again)."""
        self.producer.close()

    def request(self, item: PromptItem) -> GroupRequest:
        """The request of ``item``'s group."""
        seed = None if self.seed is None else self.seed + item.key * self.num_generations
        return GroupRequest(item.key, item.prompt_ids, self.num_generations, self.sampling, seed)

    # ---------------------------------------------------------------- prompts
    def _items(self, batch: Any) -> list[PromptItem]:
        """A prompt batch (the data sampler's next) as prompts with the next keys.

        Raises:
            ValueError: a prompt with images (a streaming engine samples text prompts).
        """
        prompts = batch["prompt"]
        items = []
        for i, prompt in enumerate(prompts):
            encoded = self.encode([prompt])
            if encoded.images[0]:
                raise ValueError("GRPOConfig.streaming.enabled=True samples text prompts; this prompt has images: use "
                                 "the fixed schedule (streaming.enabled=False) for vision-language rollouts")
            row = {name: values[i] for name, values in batch.items()}
            items.append(PromptItem(self.first_key + self.prompts_drawn, row, tuple(int(t) for t in encoded.ids[0]),
                                    encoded.num_truncated > 0))
            self.prompts_drawn += 1
        return items

    # ---------------------------------------------------------------- the age bound
    def _stale(self, group: ScoredGroup, version: int) -> bool:
        oldest = group.oldest_version
        last = version + self.steps_per_rollout - 1
        return oldest is not None and last - oldest > self.config.max_off_policy_steps

    def _purge(self, version: int) -> bool:
        """Take the groups over the age bound out of ``ready`` (under the lock); whether any was."""
        buffer = self.buffer
        kept: deque[ScoredGroup] = deque()
        again: list[PromptItem] = []
        for group in buffer.ready:
            if not self._stale(group, version):
                kept.append(group)
                continue
            buffer.counts.stale += 1
            if self.config.on_stale == "regenerate":
                buffer.counts.regenerated += 1
                again.append(group.item)
            else:
                buffer.dropped.append(group.key)
        if len(kept) == len(buffer.ready):
            return False
        buffer.ready = kept
        buffer.pending.extendleft(reversed(again))
        return True

    def purge(self, version: int) -> None:
        """Apply the age bound to the finished groups for weights of ``version`` (after a weight update), so that
        stale groups free their place at once."""
        with self.buffer.cond:
            changed = self._purge(version)
        if changed:
            self.buffer.on_change()

    # ---------------------------------------------------------------- taking
    def take(self, count: int, version: int, draw: Optional[Callable[[], Optional[Any]]]) -> Optional[TakenGroups]:
        """The next ``count`` finished groups within the age bound for weights of ``version``, in the order they
        finished, waiting for them; ``draw()`` gives the data sampler's next prompt batch (None: the epoch's data is
        used up), called whenever fewer than ``max_inflight_groups`` prompts wait to be sent. The groups stay
        "taken" until :meth:`commit` (trained) or :meth:`untake`.

        Returns:
            The groups, or None when the epoch's data is used up and fewer than ``count`` can still finish.

        Raises:
            RolloutInterrupted: the stop flag was set (SIGTERM) while waiting.
            RuntimeError: the producer failed (a reward function, the engine), chained from its error.
            ValueError: a group holds a token of a version newer than ``version`` (the engine's versions are not
                the ones the trainer sent).
        """
        began = time.perf_counter()
        buffer = self.buffer
        taken: Optional[list[ScoredGroup]] = None
        while taken is None:
            self.stop.check("waiting for streamed groups")
            need_prompts = False
            with buffer.cond:
                buffer.raise_error()
                changed = self._purge(version)
                if len(buffer.ready) >= count:
                    taken = [buffer.ready.popleft() for _ in range(count)]
                    buffer.taken = taken
                    counts, buffer.counts = buffer.counts, StreamCounts()
                    in_flight, ready = len(buffer.in_flight), len(buffer.ready)
                elif self.exhausted and buffer.idle:
                    return None
                else:
                    need_prompts = not self.exhausted and len(buffer.pending) < self.max_inflight
                    if not need_prompts and not changed:
                        buffer.cond.wait(POLL_S)
            if changed or taken is not None:
                buffer.on_change()
            if need_prompts:
                batch = draw() if draw is not None else None
                if batch is None:
                    self.exhausted = True
                else:
                    buffer.feed(self._items(batch))
        for group in taken:
            newest = group.newest_version
            if newest is not None and newest > version:
                raise ValueError(f"group {group.key}: the streaming engine stamped a token with version {newest}, but "
                                 f"the trainer has sent weights up to version {version} (its optimizer steps): the "
                                 "engine's versions must be the ones update_weights was given")
        now = time.perf_counter()
        interval = now - (self._last_take if self._last_take is not None else began)
        self._last_take = now
        return TakenGroups(taken, version, counts, now - began, interval, in_flight, ready)

    def commit(self) -> None:
        """The taken groups are trained (their rollout's experience is made)."""
        with self.buffer.cond:
            self.buffer.trained.extend(g.key for g in self.buffer.taken)
            self.buffer.taken = []

    def untake(self) -> None:
        """The taken groups were not trained (the rollout failed or was interrupted): first in line again."""
        with self.buffer.cond:
            self.buffer.ready.extendleft(reversed(self.buffer.taken))
            self.buffer.taken = []

    # ---------------------------------------------------------------- epochs and checkpoints
    def end_epoch(self) -> None:
        """The epoch is over (its data used up, or its rollouts all made): groups not trained (finished ones too few
        for a rollout, any still sampled or waiting) are dropped, a warning names them, and the next epoch's keys
        follow this one's. Nothing happens before the first prompt is drawn."""
        buffer = self.buffer
        with buffer.cond:
            left = sorted([g.key for g in buffer.ready] + list(buffer.in_flight) + [i.key for i in buffer.pending])
            buffer.ready.clear()
            buffer.in_flight.clear()  # a group that still comes back is ignored (GroupBuffer.finish)
            buffer.pending.clear()
            buffer.trained, buffer.dropped = [], []
        if left:
            log.warning("the epoch ended with %d group(s) not trained (keys %s; fewer than the %d of a rollout): they "
                        "are dropped", len(left), left, self.prompts_per_step)
        self.first_key += self.prompts_drawn
        self.prompts_drawn, self.exhausted = 0, False

    @property
    def trained(self) -> list[int]:
        """The keys trained this epoch, in order."""
        with self.buffer.cond:
            return list(self.buffer.trained)

    @property
    def dropped(self) -> list[int]:
        """The keys dropped this epoch (dynamic sampling, the age bound with ``on_stale="drop"``), in order."""
        with self.buffer.cond:
            return list(self.buffer.dropped)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps, as plain data (see the module docstring): ``first_key``, ``prompts_drawn``,
        ``trained``, ``dropped``, ``ready`` (finished groups, taken ones first) and ``regenerate`` (the keys being
        sampled or waiting to be sent)."""
        buffer = self.buffer
        with buffer.cond:
            ready = [g.state() for g in [*buffer.taken, *buffer.ready]]
            regenerate = sorted([*buffer.in_flight, *(item.key for item in buffer.pending)])
            return {"first_key": self.first_key, "prompts_drawn": self.prompts_drawn, "trained": list(buffer.trained),
                    "dropped": list(buffer.dropped), "ready": ready, "regenerate": regenerate}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the prompts to sample again are found as the fetcher draws the checkpoint's
        prompt batches again (:meth:`replay`)."""
        buffer = self.buffer
        with buffer.cond:
            buffer.pending.clear()
            buffer.in_flight.clear()
            buffer.ready = deque(ScoredGroup.from_state(g) for g in state["ready"])
            buffer.taken = []
            buffer.trained, buffer.dropped = [int(k) for k in state["trained"]], [int(k) for k in state["dropped"]]
            buffer.counts = StreamCounts()
        self.first_key, self.prompts_drawn, self.exhausted = int(state["first_key"]), 0, False
        self._replay = (int(state["prompts_drawn"]), {int(k) for k in state["regenerate"]})

    def replay(self, batch: Any) -> None:
        """One of the checkpoint's prompt batches, drawn again: its prompts get their keys again, and those that were
        being sampled or waiting are queued to be sampled again."""
        assert self._replay is not None, "RolloutStream.replay follows load_state_dict"
        again = self._replay[1]
        self.buffer.feed([item for item in self._items(batch) if item.key in again])

    def check_replayed(self) -> None:
        """The checkpoint's prompt batches are drawn again.

        Raises:
            ValueError: they held another number of prompts (the data or its order changed).
        """
        if self._replay is None:
            return
        drawn, self._replay = self._replay[0], None
        if self.prompts_drawn != drawn:
            raise ValueError(f"the checkpoint's stream had drawn {drawn} prompts of this epoch, the data gives "
                             f"{self.prompts_drawn} in as many batches: resume with the same data and prompts_per_step")
