"""Streaming rollouts (``GRPOConfig.streaming``): groups sampled concurrently on a
:class:`~lightning_grpo.protocols.streaming.StreamingEngine` that takes the trainer's weights in flight, each token
stamped with the version that produced it, scored as they arrive and trained as they are ready.

* :mod:`~lightning_grpo.rollout.streaming.scored_groups`: a prompt drawn (``PromptItem``), a group as rows with versions
  (``group_rollout``), a scored group waiting (``ScoredGroup``);
* :mod:`~lightning_grpo.rollout.streaming.buffer`: the state the producer and the trainer share, and its bounds;
* :mod:`~lightning_grpo.rollout.streaming.group_scoring`: rewards on arrival, dynamic sampling's filter;
* :mod:`~lightning_grpo.rollout.streaming.event_loop`: the engine's event loop on a thread of its own;
* :mod:`~lightning_grpo.rollout.streaming.producer`: the groups kept in flight;
* :mod:`~lightning_grpo.rollout.streaming.stream`: the trainer's side: prompts in data order, takes, the age bound,
  checkpoints;
* :mod:`~lightning_grpo.rollout.streaming.versions`: staleness metrics, the newest-version loss mask;
* :mod:`~lightning_grpo.rollout.streaming.streaming_engine`: streaming engines by name, and one seen as a rollout
engine.
"""

from lightning_grpo.rollout.streaming.stream import RolloutStream, TakenGroups
from lightning_grpo.rollout.streaming.streaming_engine import (
    StreamingRolloutEngine,
    make_streaming_engine,
    register_streaming_engine,
)

__all__ = ["RolloutStream", "StreamingRolloutEngine", "TakenGroups", "make_streaming_engine",
           "register_streaming_engine"]
