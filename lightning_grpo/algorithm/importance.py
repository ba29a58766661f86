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

import torch
from torch import Tensor

from lightning_grpo.functional import LOG_RATIO_CLAMP


def rollout_importance_weights(
    old_logprobs: Tensor,
    sampler_logprobs: Tensor,
    mask: Tensor,
    cap: float,
    level: str = "token",
    mode: str = "truncate",
) -> Tensor:
    """Importance weights ``pi_old / pi_sampler``, capped, for the per-token policy-gradient loss.

    ``level="token"``: ``w_t = exp(old_t - sampler_t)``; ``level="sequence"``: every token of a sequence gets
    ``exp(sum_t (old_t - sampler_t))`` (TRL ``sequence_*`` modes, verl ``rollout_is_level="sequence"``).
    ``mode="truncate"``: ``min(w, cap)`` (TIS); ``mode="mask"``: ``w`` where ``w <= cap`` else 0 (TRL ``*_mask``,
    verl ``rollout_is_mode="mask"``). Log-ratios are clamped to +-20 before the exp.

    Args:
        old_logprobs: ``(N, T)`` float trainer logprobs of the behaviour policy.
        sampler_logprobs: ``(N, T)`` float logprobs reported by the rollout engine for the same tokens.
        mask: ``(N, T)`` 0/1 loss mask; masked positions may hold anything (NaN included).
        cap: the truncation threshold C (>= 1).
        level: "token" or "sequence" (``GRPOConfig.rollout_importance_sampling_level``).
        mode: "truncate" or "mask".

    Returns:
        ``(N, T)`` float32 weights without grad; 1 at masked positions.

    Raises:
        ValueError: unknown ``level`` / ``mode`` or ``cap < 1``.

    Example (golden): old = [[-1, -2, -0.5]], sampler = [[-1.5, -1, -0.5]], cap 1.5: token/truncate ->
    [1.5, 0.3679, 1.0]; token/mask -> [0, 0.3679, 1.0]; sequence -> exp(-0.5) = 0.6065 on every token.
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"rollout_importance_sampling_level={level!r}: choose token or sequence")
    if mode not in ("truncate", "mask"):
        raise ValueError(f"importance_sampling_mode={mode!r}: choose truncate or mask")
    if cap < 1:
        raise ValueError(f"importance_sampling_cap={cap} must be >= 1")
    with torch.no_grad():
        mask = mask.bool()
        diff = torch.where(mask, old_logprobs.float() - sampler_logprobs.float(), 0.0)  # [N, T]
        if level == "sequence":
            diff = diff.sum(dim=1, keepdim=True).expand_as(diff)
        weights = torch.exp(diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        if mode == "truncate":
            weights = weights.clamp(max=cap)
        else:
            weights = torch.where(weights <= cap, weights, 0.0)
        return torch.where(mask, weights, 1.0)
