"""The post-sync check (``engine.weight_sync_check``): after weights are pushed into an engine with its own copy
(colocated vLLM, rollout servers), the engine's teacher-forced logprobs of a fixed probe batch must equal the
policy's (:meth:`~lightning_grpo.protocols.weights.PolicyWeights.probe_logprobs`, scored by the trainer's backend), or
the sampler is not the policy being trained (a stale or mis-synced matrix: a tied head, a skipped tensor, a failed
reload).

How far apart two correct implementations are (:func:`sync_check_tolerance`): a logprob is ``z_y - logsumexp(z)``,
so a change ``dz`` of the logits moves it by ``dz_y - sum_v p_v dz_v = sum_{v != y} p_v (dz_y - dz_v)``, at most
``2 (1 - p_y) max_v |dz_v| <= 2 max|dz|`` (logsumexp is 1-Lipschitz in the max norm). Each side rounds every logit to
its compute dtype, ``|dz_v| <= u |z_v|`` with the unit roundoff ``u = 2**-p`` of a ``p``-bit significand (bfloat16:
8 bits, u = 2**-8 = 0.0039; float16 2**-11; float32 2**-24), so the two roundings give ``max|dz| <= 2 u max|z|`` and
``|d log p| <= 4 u max|z|``; the hidden state each side feeds the output layer carries its own rounding through the
layers, which we bound by as much again (measured on SmolLM2-135M, bfloat16 vLLM against the trainer: at most
3.4 u max|z| in float32, 2.9 u max|z| under bf16 autocast, 1.7 u max|z| in bfloat16 parameters; the probe's largest
logit is 33.5): ``8 u max|z|``, about 1.0 for SmolLM2 in bfloat16, 0.03 for the tests' tiny Llama (max|z| 0.88).
A matrix that was not synced moves the logprobs by the size of the training update itself, so in bfloat16 the check
catches a missing or wrong tensor (several nats on random tokens), not a stale one a few small steps old.
"""

from __future__ import annotations

import torch

from lightning_grpo.protocols.weights import PolicyWeights

#: Significand bits (the implicit one included) of the compute dtypes: the unit roundoff is ``2**-bits``.
SIGNIFICAND_BITS = {torch.float32: 24, torch.bfloat16: 8, torch.float16: 11, torch.float64: 53}

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


def sync_check_tolerance(dtype: torch.dtype, max_abs_logit: float, floor: float = 1e-4) -> float:
    """The largest ``|log p|`` difference two correct implementations computing the logits in ``dtype`` may show on
    the probe (the module docstring derives it): ``8 * 2**-p * max_abs_logit`` (``p``: ``dtype``'s significand bits),
    at least ``floor`` (float32 kernels that sum in another order: ~1e-6 measured, 1e-4 allowed). The value for
    ``engine.weight_sync_check`` when either the engine or the trainer computes in ``dtype``.

    Args:
        dtype: the coarser of the two compute dtypes (float32, bfloat16, float16, float64).
        max_abs_logit: the largest absolute logit of the probe batch under the policy (> 0).
        floor: the smallest tolerance returned.

    Raises:
        ValueError: an unknown ``dtype``, or ``max_abs_logit`` not a finite number > 0.
    """
    if dtype not in SIGNIFICAND_BITS:
        raise ValueError(f"dtype={dtype}: choose one of {', '.join(str(d) for d in SIGNIFICAND_BITS)}")
    if not 0 < max_abs_logit < float("inf"):
        raise ValueError(f"max_abs_logit={max_abs_logit} must be a finite number > 0")
    return max(floor, 8.0 * 2.0 ** -SIGNIFICAND_BITS[dtype] * float(max_abs_logit))
