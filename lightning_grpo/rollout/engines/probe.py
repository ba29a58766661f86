"""The post-sync check (``engine.weight_sync_check``): after weights are pushed into an engine with its own copy
(colocated vLLM, rollout servers), the engine's teacher-forced logprobs of a fixed probe batch must equal the
policy's (:meth:`~lightning_grpo.protocols.weights.PolicyWeights.probe_logprobs`, scored by the trainer's backend), or
the sampler is not the policy being trained (a stale or mis-synced matrix: a tied head, a skipped tensor, a failed
reload).
"""

from __future__ import annotations

import torch

from lightning_grpo.protocols.weights import PolicyWeights

#: The post-sync probe: this many sequences of this many token ids, drawn once from a generator seeded with 0.
PROBE_SEQUENCES, PROBE_LENGTH = 4, 16


class WeightSyncCheckError(RuntimeError):
    """The engine's logprobs of the probe batch differ from the policy's by more than ``engine.weight_sync_check``."""


def probe_sequences(vocab_size: int) -> list[list[int]]:
    """The fixed probe batch of the post-sync check: :data:`PROBE_SEQUENCES` sequences of :data:`PROBE_LENGTH`
    token ids in ``[0, vocab_size)``, the same on every call."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (PROBE_SEQUENCES, PROBE_LENGTH), generator=generator).tolist()


def probe_batch(weights: PolicyWeights, tokenizer_size: int) -> list[list[int]]:
    """The probe batch of ``weights``' policy: :func:`probe_sequences` over the token ids both the tokenizer and the
    policy's embedding know."""
    return probe_sequences(min(tokenizer_size, weights.vocab_size or 1 << 62))
