"""The post-sync check (``engine.weight_sync_check``): after weights are pushed into an engine with its own copy
(colocated vLLM, rollout servers), the engine's teacher-forced logprobs of a fixed probe batch must equal the
policy's, or the sampler is not the policy being trained (a stale or mis-synced matrix: a tied head, a skipped
tensor, a failed reload).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from lightning_grpo.functional import token_logprobs
from lightning_grpo.protocols.weights import HFWeightSource

#: The post-sync probe: this many sequences of this many token ids, drawn once from a generator seeded with 0.
PROBE_SEQUENCES, PROBE_LENGTH = 4, 16


class WeightSyncCheckError(RuntimeError):
    """The engine's logprobs of the probe batch differ from the policy's by more than ``engine.weight_sync_check``."""


def probe_sequences(vocab_size: int) -> list[list[int]]:
    """The fixed probe batch of the post-sync check: :data:`PROBE_SEQUENCES` sequences of :data:`PROBE_LENGTH`
    token ids in ``[0, vocab_size)``, the same on every call."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (PROBE_SEQUENCES, PROBE_LENGTH), generator=generator).tolist()


@torch.no_grad()
def policy_probe_logprobs(model: nn.Module, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
    """``(S, L - 1)`` float32 logprobs of each token of ``sequences`` (equal lengths) given the ones before it, under
    ``model`` (temperature 1, no truncation): what an engine's teacher-forced logprobs compute. A forward pass of
    ``model`` (a collective under FSDP and for an :class:`~lightning_grpo.protocols.weights.HFWeightSource`
    such as the Megatron policy: every rank calls it)."""
    if isinstance(model, HFWeightSource):
        return model.teacher_forced_logprobs(sequences)
    device = next(model.parameters()).device
    ids = torch.tensor(list(sequences), dtype=torch.long, device=device)
    logits = model(input_ids=ids).logits[:, :-1]
    logprobs, _ = token_logprobs(logits, ids[:, 1:])
    return logprobs.float().cpu()


def probe_vocab_size(model: nn.Module, tokenizer_size: int) -> int:
    """The probe's vocabulary: token ids both the tokenizer and the model's embedding know."""
    config_size = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 1 << 62)
    return min(tokenizer_size, config_size)
