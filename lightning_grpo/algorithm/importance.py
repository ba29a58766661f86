"""Rollout-vs-trainer importance correction: truncated importance sampling (TIS) for engines whose sampler
differs from the trainer's forward pass (vLLM kernels, bf16, other attention), so that ``pi_sampler != pi_old``.

Yao, Liu et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"
(fengyao.notion.site/off-policy-rl): the policy-gradient term of each token is multiplied by
``min(pi_old(y_t) / pi_sampler(y_t), C)`` (their eq. 3). ``pi_old`` is always the *trainer's* logprob of the
behaviour policy (recomputed, or the detached current logprobs on the first step of a rollout), never the
sampler's: the PPO ratio corrects the policy change, TIS corrects the engine mismatch (as TRL and verl do).
Its level is ``GRPOConfig.rollout_importance_sampling_level``, independent of the policy ratio's level
(``importance_sampling_level``, GSPO). With asynchronous rollouts (``GRPOConfig.max_staleness``) the sampler is also
older than the trainer: ``pi_old`` is then AReaL's proximal policy and the weight its behaviour-policy correction
(Fu et al. 2025, arXiv:2505.24298; docs/algorithm.md, "Asynchronous rollouts").
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_grpo.functional import LOG_RATIO_CLAMP

ROLLOUT_IMPORTANCE_LEVELS = ("token", "sequence", "geometric")


def _check_arguments(cap: Optional[float], level: str, mode: str, low: Optional[float]) -> None:
    if level not in ROLLOUT_IMPORTANCE_LEVELS:
        raise ValueError(f"rollout_importance_sampling_level={level!r}: choose one of "
                         f"{', '.join(ROLLOUT_IMPORTANCE_LEVELS)}")
    if mode not in ("truncate", "mask"):
        raise ValueError(f"importance_sampling_mode={mode!r}: choose truncate or mask")
    if cap is not None and cap < 1:
        raise ValueError(f"importance_sampling_cap={cap} must be >= 1")
    if low is not None and not 0 < low <= 1:
        raise ValueError(f"importance_sampling_min={low} must be in (0, 1]")
    if cap is None and low is None:
        raise ValueError("an importance weight needs importance_sampling_cap or importance_sampling_min")


def rollout_importance_weights(
    old_logprobs: Tensor,
    sampler_logprobs: Tensor,
    mask: Tensor,
    cap: Optional[float],
    level: str = "token",
    mode: str = "truncate",
    low: Optional[float] = None,
) -> Tensor:
    """Importance weights ``pi_old / pi_sampler``, bounded, for the per-token policy-gradient loss.

    ``level="token"``: ``w_t = exp(old_t - sampler_t)``; ``level="sequence"``: every token of a sequence gets
    ``exp(sum_t (old_t - sampler_t))`` (TRL ``sequence_*`` modes, verl ``rollout_is="sequence"``);
    ``level="geometric"``: every token gets the geometric mean ``exp(mean_t (old_t - sampler_t))`` (length-invariant;
    Liu, Li et al. 2025, "When Speed Kills Stability", part 3; verl's Geo-RS reads the same statistic).
    ``mode="truncate"``: ``clip(w, low, cap)`` (TIS; TRL ``*_truncate`` with ``vllm_importance_sampling_clip_min``
    / ``_clip_max``); ``mode="mask"``: ``w`` where ``low <= w <= cap`` else 0 (TRL ``*_mask``; with ``level="token"``
    and ``[0.5, 5]`` this is IcePop's two-sided token mask: inclusionAI 2025, "Small Leak Can Sink a Great Ship", the
    Ring-1T report). Log-ratios are clamped to +-20 before
    the exp.

    Args:
        old_logprobs: ``(N, T)`` float trainer logprobs of the behaviour policy.
        sampler_logprobs: ``(N, T)`` float logprobs reported by the rollout engine for the same tokens.
        mask: ``(N, T)`` 0/1 loss mask; masked positions may hold anything (NaN included).
        cap: the upper bound C (>= 1), or None (none).
        level: "token", "sequence" or "geometric" (``GRPOConfig.rollout_importance_sampling_level``).
        mode: "truncate" or "mask".
        low: the lower bound in (0, 1] (``GRPOConfig.importance_sampling_min``), or None (none).

    Returns:
        ``(N, T)`` float32 weights without grad; 1 at masked positions.

    Raises:
        ValueError: unknown ``level`` / ``mode``, ``cap < 1``, ``low`` outside (0, 1], or neither bound.

    Example (golden): old = [[-1, -2, -0.5]], sampler = [[-1.5, -1, -0.5]], cap 1.5: token/truncate ->
    [1.5, 0.3679, 1.0]; token/mask -> [0, 0.3679, 1.0]; with low 0.5 as well, token/mask -> [0, 0, 1.0] and
    token/truncate -> [1.5, 0.5, 1.0]; sequence -> exp(-0.5) = 0.6065 on every token; geometric -> exp(-0.5 / 3) =
    0.8465 on every token.
    """
    _check_arguments(cap, level, mode, low)
    with torch.no_grad():
        mask = mask.bool()
        diff = torch.where(mask, old_logprobs.float() - sampler_logprobs.float(), 0.0)  # [N, T]
        if level == "sequence":
            diff = diff.sum(dim=1, keepdim=True).expand_as(diff)
        elif level == "geometric":
            diff = (diff.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1)).expand_as(diff)
        weights = torch.exp(diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        if mode == "truncate":
            weights = weights.clamp(min=low, max=cap)
        else:
            inside = torch.ones_like(weights, dtype=torch.bool)
            if cap is not None:
                inside &= weights <= cap
            if low is not None:
                inside &= weights >= low
            weights = torch.where(inside, weights, 0.0)
        return torch.where(mask, weights, 1.0)
