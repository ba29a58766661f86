"""Routed experts for tests of routing replay: a function of each token's id (so a value can be checked against the
token it sits on after any cut, join or layout) and a fixed engine whose rollouts carry them."""

from __future__ import annotations

import torch

from lightning_grpo.protocols.engine import EngineCapabilities
from lightning_grpo.protocols.rollout import RolloutOutput
from lightning_grpo.protocols.sampling import SamplingConfig
from support.algorithm import FixedRolloutEngine


def experts_of(ids: torch.Tensor, mask: torch.Tensor, layers: int, top_k: int, num_experts: int) -> torch.Tensor:
    """``(*ids.shape, layers, top_k)`` int16: token ``x``'s experts in layer ``l`` are ``(7x + 3l + j) % E`` for
    ``j < top_k`` (distinct while ``top_k <= E``; other than a random router's own choice almost everywhere), -1
    where ``mask`` is 0."""
    layer = torch.arange(layers).view(1, 1, layers, 1)
    j = torch.arange(top_k).view(1, 1, 1, top_k)
    values = (7 * ids.long().unsqueeze(-1).unsqueeze(-1) + 3 * layer + j) % num_experts
    return torch.where(mask.bool()[..., None, None], values, -1).to(torch.int16)


class RoutedEngine(FixedRolloutEngine):
    """:class:`~support.algorithm.FixedRolloutEngine` whose rollouts carry routed experts (:func:`experts_of` of the
    ids, -1 at pads), as an engine whose capabilities say ``returns_routed_experts``."""

    capabilities = EngineCapabilities(uses_policy_parameters=True, returns_routed_experts=True)

    def __init__(self, completion_ids: torch.Tensor, eos_id: int, layers: int, top_k: int, num_experts: int,
                 sampler_logprobs: bool = False) -> None:
        super().__init__(completion_ids, eos_id)
        self.shape = (layers, top_k, num_experts)
        self.report_logprobs = sampler_logprobs

    def generate(self, prompt_ids, num_generations: int, sampling: SamplingConfig) -> RolloutOutput:
        out = super().generate(prompt_ids, num_generations, sampling)
        out.prompt_routed_experts = experts_of(out.prompt_ids, out.prompt_mask, *self.shape)
        out.completion_routed_experts = experts_of(out.completion_ids, out.completion_mask, *self.shape)
        if self.report_logprobs:  # a sampler whose logprobs are -1 per token (the mismatch metrics are then finite)
            out.sampler_logprobs = -out.completion_mask.float()
        return out
