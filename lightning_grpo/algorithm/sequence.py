"""The policy importance ratio ``pi / pi_old`` at the token or the sequence level (GRPO, GSPO, GSPO-token).

Zheng et al. 2025, "Group Sequence Policy Optimization" (GSPO, arXiv:2507.18071): the ratio of a completion
``y_i`` is the length-normalized sequence likelihood ratio ``s_i = (pi(y_i) / pi_old(y_i)) ** (1 / |y_i|) =
exp(mean_t (log pi(y_t) - log pi_old(y_t)))`` (eq. 7), clipped and optimized once per sequence (eq. 5). GSPO-token
(sec. 4.3) gives each token ``s_i,t = sg[s_i] * pi(y_t) / sg[pi(y_t)]``: its value is ``s_i`` and its gradient is
that of ``log pi(y_t)`` times ``s_i``, so with one advantage per sequence it has GSPO's value and gradient.

Everything is returned in log space, to be fed to :func:`lightning_grpo.functional.policy_loss` as
``policy_loss(log_ratio, 0, A, ...)`` (the ratio is ``exp(log_ratio - 0)``).
"""

from __future__ import annotations

import torch
from torch import Tensor

POLICY_RATIO_LEVELS = ("token", "sequence", "sequence_token")


def sequence_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor) -> Tensor:
    """``log s_i = mean over the loss tokens of sequence i of (logprobs - old_logprobs)`` (GSPO eq. 7).

    Args:
        logprobs: ``(N, T)`` float current-policy logprobs (the gradient flows to the loss tokens only).
        old_logprobs: ``(N, T)`` float behaviour-policy logprobs.
        mask: ``(N, T)`` 0/1 loss mask; masked positions may hold anything (NaN included).

    Returns:
        ``(N,)`` float log-ratios; 0 for a row without loss tokens.

    Example (golden): logprobs [[-1, -2]], old [[-1.5, -1.5]] -> mean(0.5, -0.5) = 0.
    """
    mask = mask.bool()
    diff = torch.where(mask, logprobs - old_logprobs, 0.0)  # [N, T]
    return diff.sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # [N]


def policy_log_ratio(logprobs: Tensor, old_logprobs: Tensor, mask: Tensor, level: str = "token") -> Tensor:
    """Log of the policy importance ratio at ``level`` (TRL ``GRPOConfig.importance_sampling_level``).

    * ``"token"``: ``log r_t = logp_t - old_t`` (GRPO, DeepSeekMath eq. 3), shape ``(N, T)``.
    * ``"sequence"``: ``log s_i`` of :func:`sequence_log_ratio` (GSPO eq. 7), shape ``(N, 1)``; its gradient reaches
      every loss token of the sequence through the mean, ``d log s_i / d logp_t = 1 / |y_i|``.
    * ``"sequence_token"``: ``sg[log s_i] + logp_t - sg[logp_t]`` (GSPO-token, sec. 4.3), shape ``(N, T)``: the
      value of every token is ``log s_i``, the gradient is 1 w.r.t. its own logprob only.

    Args:
        logprobs: ``(N, T)`` float current-policy logprobs (with grad).
        old_logprobs: ``(N, T)`` float behaviour-policy logprobs (no grad).
        mask: ``(N, T)`` 0/1 loss mask; masked positions may hold anything and get log-ratio 0 and no gradient.
        level: "token", "sequence" or "sequence_token".

    Returns:
        ``(N, T)`` (``"token"``, ``"sequence_token"``) or ``(N, 1)`` (``"sequence"``) float log-ratios.

    Raises:
        ValueError: unknown ``level``.
    """
    if level not in POLICY_RATIO_LEVELS:
        raise ValueError(f"importance_sampling_level={level!r}: choose one of {', '.join(POLICY_RATIO_LEVELS)}")
    mask = mask.bool()
    if level == "token":
        return torch.where(mask, logprobs - old_logprobs, 0.0)
    sequence = sequence_log_ratio(logprobs, old_logprobs, mask).unsqueeze(1)  # [N, 1]
    if level == "sequence":
        return sequence
    own = logprobs - logprobs.detach()  # value 0, gradient 1 w.r.t. logp_t
    return torch.where(mask, sequence.detach() + own, 0.0)  # [N, T]
