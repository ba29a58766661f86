"""``GRPOConfig.streaming``: fully asynchronous training as AReaL runs it (Fu et al. 2025, arXiv:2505.24298), beside
the fixed schedule of ``GRPOConfig.max_staleness``: groups are sampled concurrently on rollout servers that take new
weights in flight, each token stamped with the weight version that produced it, and every optimizer step trains the
next groups that are ready. Validated on construction; docs/engines.md ("Streaming rollouts") maps each knob to
AReaL's, prime-rl's, verl's and slime's names. The producer is :mod:`lightning_grpo.rollout.streaming`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal, Optional

from lightning_grpo.config.groups import check_fields, fail

OnStale = Literal["drop", "regenerate"]


def _fail(name: str, value: object, requirement: str) -> None:
    fail(f"streaming.{name}", value, requirement)


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class StreamingConfig:
    """Streaming rollouts (``GRPOConfig.streaming``; ``--model.config.streaming.<field>`` on the command line).

    Raises:
        ValueError: on construction, a field out of range, of the wrong type, or set while ``enabled`` is False
            (the field and value are named).
    """

    enabled: bool = False
    """Stream rollouts (AReaL's fully asynchronous RL, prime-rl's orchestrator): up to ``max_inflight_groups`` groups
    are sampled at once on the rollout servers (``engine.name="vllm_server"``) while the trainer trains; after every
    optimizer step the new weights go to the servers without waiting for the groups in flight, whose later tokens
    carry the new version; each step trains the next ``prompts_per_step`` finished groups. Not with
    ``max_staleness > 0`` (the fixed schedule). False: the fixed schedule."""
    max_inflight_groups: Optional[int] = None
    """Most groups being sampled at once (>= 1; AReaL ``max_concurrent_rollouts``, prime-rl ``max_inflight``,
    slime ``sglang_server_concurrency`` in groups); None = twice the datamodule's ``prompts_per_step``."""
    buffer_groups: Optional[int] = None
    """Most groups held at once, being sampled or finished and waiting to be trained (>= ``max_inflight_groups``
    and >= ``prompts_per_step``; AReaL ``queue_size``): a group takes its place when it starts, so at most this many
    finished groups ever wait. None = ``max_inflight_groups + prompts_per_step``."""
    max_off_policy_steps: int = 8
    """The age bound (>= 0; prime-rl ``max_off_policy_steps``, default 8; AReaL ``max_head_offpolicyness``; NeMo-RL
    ``max_trajectory_age_steps``): a sample whose oldest token was sampled by weights more than this many optimizer
    steps older than the weights of the last optimizer step it is trained in is never trained (``on_stale``), counted
    in ``streaming/stale_groups``. The time a group waits in the buffer counts (its age grows with every step)."""
    on_stale: OnStale = "drop"
    """What happens to a group over the age bound: "drop" (prime-rl: the prompt is not trained this epoch) or
    "regenerate" (the prompt is sampled again from the current weights)."""
    newest_version_only: bool = False
    """Train only the tokens of each sample's newest weight version (slime ``--mask-offpolicy-in-partial-rollout``):
    the tokens a sample got before the last weight update it saw are context, with no loss (a loss mask); a sample
    of one version trains all its tokens."""

    def __post_init__(self) -> None:
        check_fields(self, "streaming.")
        for name in ("enabled", "newest_version_only"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "must be True or False")
        for name in ("max_inflight_groups", "buffer_groups"):
            value = getattr(self, name)
            if value is not None and (not _count(value) or value < 1):
                _fail(name, value, "must be an int >= 1 or None (derived from prompts_per_step)")
        if not _count(self.max_off_policy_steps) or self.max_off_policy_steps < 0:
            _fail("max_off_policy_steps", self.max_off_policy_steps, "must be an int >= 0")
        inflight, buffer = self.max_inflight_groups, self.buffer_groups
        if inflight is not None and buffer is not None and buffer < inflight:
            _fail("buffer_groups", buffer, f"must be >= streaming.max_inflight_groups={inflight} (a group takes its "
                  "place in the buffer when it starts)")
        if not self.enabled:
            for f in fields(self):
                if f.name != "enabled" and getattr(self, f.name) != f.default:
                    _fail(f.name, getattr(self, f.name), "is read only with streaming.enabled=True: set it, or "
                          "leave this at its default")

    def sizes(self, prompts_per_step: int) -> tuple[int, int]:
        """``(max_inflight_groups, buffer_groups)`` in effect for ``prompts_per_step`` groups per rollout (the
        datamodule's), the None ones derived.

        Raises:
            ValueError: ``buffer_groups`` below ``prompts_per_step`` (no step could ever be assembled).
        """
        inflight = self.max_inflight_groups or 2 * prompts_per_step
        buffer = self.buffer_groups or inflight + prompts_per_step
        if buffer < prompts_per_step:
            _fail("buffer_groups", buffer, f"must be >= the datamodule's prompts_per_step={prompts_per_step} (the "
                  "groups one optimizer step trains)")
        return inflight, max(buffer, inflight)
