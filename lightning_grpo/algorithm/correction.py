"""Rejection masks of the rollout correction: which tokens keep their policy-gradient term when the sampler and the
trainer disagree (engine mismatch) or the rollout is stale (asynchronous rollouts).

Every mask reads the per-token log-ratio ``d_t = log pi_trainer(y_t) - log pi_sampler(y_t)``
(:func:`rollout_log_ratio`), where ``pi_trainer`` is the trainer's behaviour policy (the old logprobs, or the detached
current ones on a rollout's first update; with ``correction.bypass_mode`` the detached current ones, since the old
policy is then the sampler itself), and drops (keeps = False) the tokens or sequences outside its bound:

* :func:`geometric_mask`: the geometric mean of the sequence's ratios, ``exp(mean_t d_t)``, outside
  ``[low, high]`` (Liu, Li et al. 2025, "When Speed Kills Stability", part 3: Geo-RS, verl
  ``rollout_rs="seq_mean_k1"``; SkyRL's ``geo_mask``; AReaL ``agg=mean``). Length-invariant, unlike the product.
* :func:`kl_mask`: an estimate of KL(pi_sampler || pi_trainer) above a threshold, per token or aggregated over the
  sequence (verl ``rollout_rs="{token,seq_mean,seq_sum,seq_max}_{k1,k2,k3}"``, preset K3-RS; AReaL's
  ``kl_k1/k2/k3``), with Schulman's (2020) k1 ``-d``, k2 ``d**2 / 2`` and k3 ``exp(d) - 1 - d``.
* :func:`off_policy_mask`: DeepSeek-V3.2's off-policy sequence mask (arXiv:2512.02556 sec. 3.1, eq. 9; TRL
  ``off_policy_mask_threshold``): a negative-advantage token of a sequence whose mean
  ``log pi_sampler - log pi_theta`` exceeds delta.

The masks are pure functions of one sequence's tokens (the off-policy mask also of the current policy), so they do
not depend on how a step is split into micro-batches or processes. The rejected tokens stay in the loss
denominator, as in TRL (verl removes them from its response mask).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

from lightning_grpo.functional import LOG_RATIO_CLAMP, kl_penalty

if TYPE_CHECKING:
    from lightning_grpo.config.correction import CorrectionConfig

KL_MASK_AGGREGATIONS = ("token", "seq_mean", "seq_sum", "seq_max")


@dataclass
class CorrectionOutput:
    """What the rollout correction of one micro-batch computed, without grad (for the loss and the metrics).

    Attributes:
        log_ratio: ``(N, T)`` float32 ``log(pi_trainer / pi_sampler)`` on the loss tokens (0 elsewhere), or None when
            the engine reported no sampler logprobs.
        keep: knob name ("geometric", "kl", "off_policy") -> ``(N, T)`` bool, True where the knob keeps the token
            (and on every masked position).
    """

    log_ratio: Optional[Tensor] = None
    keep: dict[str, Tensor] = field(default_factory=dict)

    def combined(self) -> Optional[Tensor]:
        """``(N, T)`` bool, True where every knob keeps the token; None when no knob is on."""
        if not self.keep:
            return None
        masks = list(self.keep.values())
        out = masks[0]
        for other in masks[1:]:
            out = out & other
        return out


def rollout_log_ratio(trainer_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> Tensor:
    """``d = log pi_trainer - log pi_sampler`` on the loss tokens, 0 elsewhere (masked positions may hold anything,
    NaN included), clamped to +-20; float32 without grad.

    Args:
        trainer_logprobs: ``(N, T)`` float trainer logprobs of the behaviour policy.
        sampler_logprobs: ``(N, T)`` float logprobs the rollout engine reported for the same tokens.
        mask: ``(N, T)`` 0/1 loss mask.
    """
    with torch.no_grad():
        diff = trainer_logprobs.detach().float() - sampler_logprobs.float()
        return torch.where(mask.bool(), diff, 0.0).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _sequence_mean(values: Tensor, mask: Tensor) -> Tensor:
    """``(N, 1)`` mean over each row's loss tokens (0 for a row without any)."""
    return torch.where(mask, values, 0.0).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)


def _rows(keep: Tensor, mask: Tensor) -> Tensor:
    """A ``(N, 1)`` per-sequence decision as ``(N, T)``, True on masked positions."""
    return keep.expand_as(mask) | ~mask


def geometric_mask(log_ratio: Tensor, mask: Tensor, low: Optional[float], high: Optional[float]) -> Tensor:
    """Keep the sequences whose geometric-mean ratio ``g_i = exp(mean_t d_t)`` lies in ``[low, high]`` (Geo-RS).

    Args:
        log_ratio: ``(N, T)`` float ``d`` from :func:`rollout_log_ratio`.
        mask: ``(N, T)`` 0/1 loss mask.
        low: the lower bound in (0, 1], or None (none).
        high: the upper bound >= 1, or None (none).

    Returns:
        ``(N, T)`` bool, the sequence's decision on each of its tokens; True on masked positions.

    Example (golden): d = [[0.02, 0.0], [0.3, -0.3], [0.05, 0.05]], bounds [0.99, 1.01]: g = [1.01005, 1.0, 1.0513]
    -> keep [False, True, False] (the second sequence's token ratios 1.35 and 0.74 average out).
    """
    mask = mask.bool()
    mean = _sequence_mean(log_ratio.float(), mask)  # [N, 1] log g_i
    keep = torch.ones_like(mean, dtype=torch.bool)
    if low is not None:
        keep &= mean >= torch.log(torch.tensor(low, dtype=mean.dtype))
    if high is not None:
        keep &= mean <= torch.log(torch.tensor(high, dtype=mean.dtype))
    return _rows(keep, mask)


def kl_mask(log_ratio: Tensor, mask: Tensor, threshold: float, estimator: str = "k3",
            aggregation: str = "seq_mean") -> Tensor:
    """Keep what an estimate of KL(pi_sampler || pi_trainer) puts at or below ``threshold``.

    Per token, with ``d`` the log-ratio (:func:`~lightning_grpo.functional.kl_penalty` of the sampler against the
    trainer): k1 ``-d``, k2 ``d**2 / 2``, k3 ``exp(d) - 1 - d``; "token" compares each token's value, "seq_mean",
    "seq_sum" and "seq_max" the mean, sum or maximum over the sequence's loss tokens (its decision on each of them).
    k1 is signed (its mean is the KL, a single token's value is not), so its bound applies to the absolute value.

    Args:
        log_ratio: ``(N, T)`` float ``d`` from :func:`rollout_log_ratio`.
        mask: ``(N, T)`` 0/1 loss mask.
        threshold: the bound (> 0).
        estimator: "k1", "k2" or "k3".
        aggregation: "token", "seq_mean", "seq_sum" or "seq_max".

    Returns:
        ``(N, T)`` bool keep mask, True on masked positions.

    Raises:
        ValueError: unknown estimator or aggregation.

    Example (golden): d = [[0.1, -0.2]], k3 = [0.00517, 0.01873], seq_mean 0.01195: threshold 0.01 rejects the
    sequence, 0.02 keeps it; "token" with 0.01 keeps the first token only.
    """
    if aggregation not in KL_MASK_AGGREGATIONS:
        raise ValueError(f"kl_mask_aggregation={aggregation!r}: choose one of {', '.join(KL_MASK_AGGREGATIONS)}")
    mask = mask.bool()
    d = log_ratio.float()
    values = kl_penalty(-d, torch.zeros_like(d), estimator)  # kl_penalty's x = ref - logp is d here
    values = torch.where(mask, values, 0.0)
    if aggregation == "token":
        stat = values
    elif aggregation == "seq_mean":
        stat = _sequence_mean(values, mask)
    elif aggregation == "seq_sum":
        stat = values.sum(dim=1, keepdim=True)
    else:
        stat = torch.where(mask, values.abs() if estimator == "k1" else values, -torch.inf).amax(dim=1, keepdim=True)
    if estimator == "k1":
        stat = stat.abs()
    keep = stat <= threshold
    return (keep | ~mask) if aggregation == "token" else _rows(keep, mask)


def off_policy_mask(advantages: Tensor, logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor,
                    threshold: float) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask (arXiv:2512.02556 eq. 9; TRL ``GRPOTrainer.get_off_policy_mask``):
    ``M_t = 0`` when ``A_t < 0`` and ``(1 / |y|) sum_t (log pi_behaviour(y_t) - log pi_theta(y_t)) > delta``, else 1.

    Args:
        advantages: ``(N,)`` or ``(N, T)`` float advantages (per token with distillation).
        logprobs: ``(N, T)`` float current-policy logprobs (read without grad).
        behaviour_logprobs: ``(N, T)`` float logprobs of the policy that sampled (the sampler's; TRL falls back to
            the old policy's when the engine reports none).
        mask: ``(N, T)`` 0/1 loss mask.
        threshold: delta (>= 0).

    Returns:
        ``(N, T)`` bool keep mask, True on masked positions.

    Example (golden): behaviour [[-1, -1]], current [[-1.5, -1.3]] (mean KL 0.4), delta 0.3: rejected when A < 0,
    kept when A >= 0; delta 0.5 keeps it either way.
    """
    mask = mask.bool()
    with torch.no_grad():
        kl = torch.where(mask, behaviour_logprobs.float() - logprobs.detach().float(), 0.0)
        mean = _sequence_mean(kl, mask)  # [N, 1]
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        keep = (advantages >= 0) | (mean <= threshold)  # [N, 1] or [N, T]
        return keep.expand_as(mask) | ~mask


def correction_masks(config: "CorrectionConfig", log_ratio: Optional[Tensor], mask: Tensor, *,
                     advantages: Tensor, logprobs: Tensor, behaviour_logprobs: Tensor) -> dict[str, Tensor]:
    """The keep masks of the knobs ``config`` turns on (see the module docstring), by name: "geometric", "kl",
    "off_policy". Without sampler logprobs (``log_ratio`` None) the geometric and KL masks keep every token (the
    engine sampled with the trained policy itself).

    Args:
        config: ``GRPOConfig.correction``.
        log_ratio: ``(N, T)`` float ``d`` (:func:`rollout_log_ratio`), or None.
        mask: ``(N, T)`` 0/1 loss mask.
        advantages: ``(N,)`` or ``(N, T)`` float advantages (the off-policy mask reads their sign).
        logprobs: ``(N, T)`` float current-policy logprobs.
        behaviour_logprobs: ``(N, T)`` float sampler logprobs (or the old policy's when there are none).
    """
    mask = mask.bool()
    keep: dict[str, Tensor] = {}
    d = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device) if log_ratio is None else log_ratio
    if config.geo_mask_low is not None or config.geo_mask_high is not None:
        keep["geometric"] = geometric_mask(d, mask, config.geo_mask_low, config.geo_mask_high)
    if config.kl_mask_threshold is not None:
        keep["kl"] = kl_mask(d, mask, config.kl_mask_threshold, config.estimator, config.aggregation)
    if config.off_policy_mask_threshold is not None:
        keep["off_policy"] = off_policy_mask(advantages, logprobs, behaviour_logprobs, mask,
                                             config.off_policy_mask_threshold)
    return keep
