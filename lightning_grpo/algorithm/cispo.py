"""CISPO: clipped importance-sampling-weight policy optimization (MiniMax-M1, arXiv:2506.13585, sec. 3.1).

Instead of clipping the token update (PPO, which drops the gradient of every clipped token), CISPO clips the
importance weight and stops its gradient: per token ``J = sg[r_hat_t] * A * log pi(y_t)`` with
``r_hat_t = clip(r_t, 1 - eps_low, 1 + eps_high)`` (eq. 4-5), so every token keeps a REINFORCE gradient
``r_hat_t * A * grad log pi(y_t)``. The paper sets no lower bound (a large ``eps_low``) and tunes only ``eps_high``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_grpo.functional import LOG_RATIO_CLAMP, ClipStats


def cispo_loss(
    logprobs: Tensor,
    log_ratio: Tensor,
    advantages: Tensor,
    epsilon_low: float,
    epsilon_high: float,
) -> tuple[Tensor, ClipStats]:
    """Per-token CISPO loss ``-sg[clip(r, 1 - epsilon_low, 1 + epsilon_high)] * A * logprobs`` (MiniMax-M1 eq. 4).

    Args:
        logprobs: ``(N, T)`` float current-policy logprobs (with grad; the loss's only gradient path).
        log_ratio: ``(N, T)`` token or ``(N, 1)`` sequence log importance ratio ``log pi - log pi_old`` (its
            gradient is ignored); clamped to +-20 before the exp.
        advantages: ``(N,)`` or ``(N, T)`` float advantages.
        epsilon_low, epsilon_high: the weight is clipped to ``[1 - epsilon_low, 1 + epsilon_high]``
            (``epsilon_low >= 1``: no lower bound, as in the paper).

    Returns:
        ``(loss, stats)``: ``(N, T)`` float per-token loss, and :class:`~lightning_grpo.functional.ClipStats` whose
        ``low`` / ``high`` mark tokens whose weight was clipped below / above, for either sign of the advantage
        (verl's ``pg_clipfrac``; their gradient is not zero), ``dual`` all False, ``ratio`` the unclipped ratio.

    Example (golden): logprobs -1, ratio 1.5, A = 2, eps_high 0.2 -> -1.2 * 2 * (-1) = 2.4, gradient -2.4
    (PPO would give this token no gradient).
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)  # [N, 1]
    with torch.no_grad():
        ratio = torch.exp(log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        weight = ratio.clamp(min=1 - epsilon_low, max=1 + epsilon_high)
    loss = -weight * advantages * logprobs  # [N, T]
    with torch.no_grad():
        shape = loss.shape
        stats = ClipStats(
            low=(ratio < 1 - epsilon_low).expand(shape),
            high=(ratio > 1 + epsilon_high).expand(shape),
            dual=torch.zeros(shape, dtype=torch.bool, device=loss.device),
            ratio=ratio.expand(shape),
        )
    return loss, stats
