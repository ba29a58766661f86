"""Where the experience fetcher stands in an epoch, and how a checkpoint keeps it (Lightning's ``loops/progress.py``
is the model: a plain record with ``state_dict``/``load_state_dict``).

The fit loop stores every process's :meth:`RolloutCursor.state_dict` under :data:`CURSOR_KEY` of its own checkpoint
state. Everything in it is plain data (ints, tensors, lists, dicts), so a checkpoint still loads with
``torch.load(weights_only=True)``. A checkpoint of the earlier layout (one key per part, :data:`LEGACY_KEYS`) is read
into the same shape (:func:`saved_cursor`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from lightning_grpo.loop.resume import experience_from_state, experience_state, rng_states, this_process
from lightning_grpo.rollout.prefetch import PrefetchedRollout
from lightning_grpo.training.experience import Experience

#: The fit loop's checkpoint key: every process's :meth:`RolloutCursor.state_dict`, by global rank.
CURSOR_KEY = "rollout_cursors"
#: The keys of one :meth:`RolloutCursor.state_dict`: the prompt batches drawn in the epoch, the RNG states the next
#: rollout starts from, the partly used rollout (or None) and the rollouts generated ahead (asynchronous).
PROMPT_BATCHES, RNG = "prompt_batches_drawn", "rng_states"
PARTIAL, PREFETCHED = "partial_rollout", "prefetched_rollouts"
#: Streaming rollouts: the stream's state in a cursor's state
#: (:meth:`lightning_grpo.rollout.streaming.RolloutStream.state_dict`: the keys trained and dropped this epoch, the
#: finished groups, the keys to sample again).
STREAM = "stream"
#: The earlier layout, one fit-loop key per part (each but the first a list by global rank) -> the key in a cursor's
#: state.
LEGACY_KEYS = {"prompt_batches_drawn": PROMPT_BATCHES, "rng_states": RNG, "partial_rollouts": PARTIAL,
               "prefetched_rollouts": PREFETCHED}


@dataclass
class RolloutCursor:
    """The fetcher's position in the current epoch.

    Attributes:
        drawn: prompt batches drawn from the epoch's DataLoader.
        making: while a rollout's experience is being made, the prompt batches drawn before its own (a checkpoint
            then regenerates it); else None.
        rng: while a synchronous rollout is being made, the RNG states it started from (a checkpoint written then,
            e.g. on SIGTERM, regenerates the same rollout on resume); else None.
        experience: the rollout whose micro-batches are handed out (None before the first).
        step: the optimizer step it was made at (seeds the shuffle of its micro-batches).
        micro_batches: its micro-batches in training order.
        consumed: how many of them were handed out.
        ahead: rollouts generated in the background ahead of it (asynchronous), oldest first, each with the prompt
            batches drawn before its own.
        exhausted: the epoch's prompt batches are all drawn (no more are generated ahead).
    """

    drawn: int = 0
    making: Optional[int] = None
    rng: Optional[dict] = None
    experience: Optional[Experience] = None
    step: int = 0
    micro_batches: list[Experience] = field(default_factory=list)
    consumed: int = 0
    ahead: deque[tuple[int, PrefetchedRollout]] = field(default_factory=deque)
    exhausted: bool = False

    @property
    def prompt_batches_drawn(self) -> int:
        """Prompt batches of this epoch's finished rollouts (a rollout being made, e.g. when a signal handler saves a
        checkpoint in its middle, does not count: the resumed run regenerates it)."""
        return self.drawn if self.making is None else self.making

    def begin_rollout(self, drawn_before: int, step: int, rng: Optional[dict]) -> None:
        """A rollout's experience is being made from the prompt batch after ``drawn_before`` at optimizer ``step``
        (``rng``: the RNG states it started from, synchronous rollouts)."""
        self.making, self.rng, self.step = drawn_before, rng, step
        self.experience, self.micro_batches, self.consumed = None, [], 0

    def partial_rollout(self) -> Optional[dict]:
        """The current rollout as plain data when some of its micro-batches are still to be handed out, else None."""
        if self.experience is None or self.consumed >= len(self.micro_batches):
            return None
        return {"experience": experience_state(self.experience), "step": self.step, "consumed": self.consumed}

    def position(self) -> tuple[int, list[dict]]:
        """The prompt batches drawn and the rollouts generated ahead that finished, oldest first, as plain data. A
        rollout generated ahead that failed or was interrupted, and the ones after it, are not kept: their prompt
        batches count as not drawn (regenerated on resume); so are all of them while a rollout is being made."""
        if self.making is not None:
            return self.making, []
        states: list[dict] = []
        for drawn_before, prefetched in self.ahead:
            if not prefetched.succeeded():
                return drawn_before, states
            states.append({"drawn_before": drawn_before, "rollout": prefetched.state()})
        return self.drawn, states

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (wait for the generations in flight first), as plain data:
        ``prompt_batches_drawn`` and ``prefetched_rollouts`` (:meth:`position`), ``rng_states`` (:attr:`rng` while a
        rollout is being made, else this process's now) and ``partial_rollout`` (:meth:`partial_rollout`)."""
        drawn, prefetched = self.position()
        return {PROMPT_BATCHES: drawn, RNG: self.rng or rng_states(), PARTIAL: self.partial_rollout(),
                PREFETCHED: prefetched}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        """Restore the partly used rollout (its experience on ``device``; the fetcher cuts its micro-batches again)
        and the rollouts generated ahead of :meth:`state_dict`. The RNG states and the prompt batches drawn are the
        fetcher's to apply (it restores the one and skips the other)."""
        partial = state.get(PARTIAL)
        if partial is not None:
            self.experience = experience_from_state(partial["experience"], device)
            self.step, self.consumed = int(partial["step"]), int(partial["consumed"])
        self.ahead = deque((int(entry["drawn_before"]), PrefetchedRollout.from_state(entry["rollout"]))
                           for entry in state.get(PREFETCHED) or [])


def saved_cursors(loop_state: dict) -> Optional[list[dict]]:
    """Every process's cursor state in a fit loop's checkpoint state (:data:`CURSOR_KEY`); a checkpoint of the
    earlier layout (:data:`LEGACY_KEYS`: the prompt batches drawn once, the other parts each a list by global rank)
    is read into the same shape; None when it holds neither (e.g. written by Lightning's own fit loop)."""
    if CURSOR_KEY in loop_state:
        return loop_state[CURSOR_KEY]
    if "prompt_batches_drawn" not in loop_state:
        return None
    parts = {old: loop_state.get(old) for old in LEGACY_KEYS if old != "prompt_batches_drawn"}
    lengths = {old: len(values) for old, values in parts.items() if values is not None}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"the checkpoint's fit loop state has per-process lists of different lengths {lengths}: it "
                         "was not written by GRPOFitLoop")
    return [{PROMPT_BATCHES: loop_state["prompt_batches_drawn"],
             **{LEGACY_KEYS[old]: None if values is None else values[rank] for old, values in parts.items()}}
            for rank in range(next(iter(lengths.values()), 1))]


def saved_cursor(loop_state: dict) -> Optional[dict]:
    """This process's entry of :func:`saved_cursors`, or None.

    Raises:
        ValueError: the checkpoint was written by a different number of processes (:func:`this_process`).
    """
    return this_process(saved_cursors(loop_state), "rollout cursors")


def pending_rollouts(cursors: Optional[list[dict]]) -> bool:
    """Whether any process's cursor holds a partly used rollout, rollouts generated ahead or streamed groups
    (finished, or to sample again): they belong to that process's data-parallel replica."""
    return any(state.get(PARTIAL) is not None or state.get(PREFETCHED)
               or (state.get(STREAM) is not None and (state[STREAM]["ready"] or state[STREAM]["regenerate"]))
               for state in cursors or [])
