"""Routing replay's vocabulary: the experts a mixture-of-experts policy routed each token to, as the rollout carries
them (``RolloutOutput.prompt_routed_experts`` and ``completion_routed_experts``: ``(N, P | T, moe_layers, top_k)``
:data:`ROUTED_DTYPE`, :data:`NO_EXPERT` where nothing was recorded), and what records them while an engine that
generates with the policy's own modules (HF ``generate``) runs: a :class:`RoutingRecorder`
(docs/algorithm.md "Routing replay").
"""

from __future__ import annotations

from typing import ContextManager, Protocol

import torch
from torch import Tensor

#: The dtype of the routed-experts fields: expert indices below 32,768.
ROUTED_DTYPE = torch.int16
#: The value of a position whose experts were not recorded (padding, a token never fed to the model): the trainer's
#: router then chooses itself. Never expert 0, so a value can never pass for a real selection (google/tunix PR #2046).
NO_EXPERT = -1


class RoutingRecorder(Protocol):
    """Records the experts a mixture-of-experts policy's routers select (the policy's
    :class:`~lightning_grpo.models.moe.MoeRouters`): what the HF engine is given when routing replay is on."""

    @property
    def moe_layers(self) -> int:
        """The policy's layers that route (the fields' third dimension)."""
        ...

    @property
    def top_k(self) -> int:
        """Experts per token (the fields' last dimension)."""
        ...

    def record(self) -> ContextManager[list[Tensor]]:
        """While open, each forward call of the policy appends its routers' selection, ``(rows, moe_layers, top_k)``
        :data:`ROUTED_DTYPE` (``rows``: the call's batch rows times positions, row-major), to the yielded list."""
        ...


def mask_routed(routed: Tensor, mask: Tensor) -> Tensor:
    """``routed`` (``(N, W, layers, k)``) with :data:`NO_EXPERT` wherever ``mask`` (``(N, W)``) is 0."""
    return torch.where(mask.bool().to(routed.device)[..., None, None], routed, torch.full_like(routed, NO_EXPERT))
