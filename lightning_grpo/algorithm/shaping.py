"""Reward shaping applied before advantages: DAPO's soft overlong punishment, scale/bias/clip, and the KL
penalty subtracted from the reward (``kl_in_reward``).

Order in :meth:`lightning_grpo.module.GRPOModule.make_experience` (documented in docs/algorithm.md):
weighted sum of the reward functions -> + overlong penalty -> scale, bias, clip -> - beta * sequence KL ->
group advantages.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from lightning_grpo.functional import kl_penalty
from lightning_grpo.protocols.collectives import Collectives


def overlong_penalty(lengths: Tensor, max_new_tokens: int, overlong_buffer: int, penalty_factor: float = 1.0) -> Tensor:
    """Soft overlong punishment (DAPO, Yu et al. 2025, arXiv:2503.14476, eq. 13), times ``penalty_factor``.

    With ``L_max = max_new_tokens`` and ``L_cache = overlong_buffer``::

        R(y) = 0                                  if |y| <= L_max - L_cache
             = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
             = -1                                 if |y| > L_max

    Args:
        lengths: ``(N,)`` completion lengths in tokens (the EOS token included, as verl's ``valid_response_length``).
        max_new_tokens: L_max (>= 1).
        overlong_buffer: L_cache, in tokens (1 <= L_cache <= L_max).
        penalty_factor: scales the penalty (verl's ``overlong_buffer.penalty_factor``; DAPO uses 1.0).

    Returns:
        ``(N,)`` float32 penalties in ``[-penalty_factor, 0]``, to be added to the reward.

    Raises:
        ValueError: if ``overlong_buffer`` is not in ``[1, max_new_tokens]`` or ``penalty_factor < 0``.

    Example (golden): L_max = 20, L_cache = 5: lengths 15, 16, 18, 20 -> 0, -0.2, -0.6, -1.0.
    """
    if not 1 <= overlong_buffer <= max_new_tokens:
        raise ValueError(f"overlong_buffer={overlong_buffer} must be in [1, max_new_tokens={max_new_tokens}]")
    if penalty_factor < 0:
        raise ValueError(f"overlong_penalty_factor={penalty_factor} must be >= 0")
    lengths = lengths.float()
    expected = float(max_new_tokens - overlong_buffer)
    penalty = ((expected - lengths) / overlong_buffer).clamp(min=-1.0, max=0.0)  # [N]
    return penalty * penalty_factor


def transform_rewards(rewards: Tensor, scale: float = 1.0, bias: float = 0.0, clip: Optional[float] = None) -> Tensor:
    """``clip(scale * r + bias, -clip, clip)`` (as verl's ``reward_model.reward_manager`` clipping / OpenRLHF's
    ``--reward_clip_range``); NaN (missing) rewards stay NaN.

    Args:
        rewards: ``(N,)`` float rewards.
        scale: multiplies the reward (> 0).
        bias: added after scaling.
        clip: symmetric bound (> 0) or None for no clipping.

    Returns:
        ``(N,)`` float32.

    Example (golden): r = [2, -3, 0.5], scale 2, bias -1, clip 2.5 -> [2.5, -2.5, 0.0].
    """
    out = rewards.float() * scale + bias
    if clip is not None:
        out = out.clamp(-clip, clip)
    return out


def sequence_kl(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: str = "k1") -> Tensor:
    """Per-sequence KL estimate ``sum_t kl_t`` over the completion tokens (verl's ``use_kl_in_reward``: the token
    rewards ``score - beta * kl_t`` summed over the sequence, which is what GRPO's outcome advantage sees).

    Args:
        logprobs: ``(N, T)`` float behaviour-policy logprobs of the sampled tokens.
        ref_logprobs: ``(N, T)`` float reference-policy logprobs.
        mask: ``(N, T)`` 0/1 loss mask; masked positions may hold anything (NaN included).
        estimator: "k1", "k2" or "k3" (see :func:`lightning_grpo.functional.kl_penalty`).

    Returns:
        ``(N,)`` float32 summed KL (no grad).

    Example (golden): logp = [[-1, -1]], ref = [[-2, -1]], mask [[1, 1]]: k1 -> 1.0, k3 -> exp(-1) = 0.3679.
    """
    mask = mask.bool()
    logprobs = torch.where(mask, logprobs.float(), 0.0)
    ref_logprobs = torch.where(mask, ref_logprobs.float(), 0.0)
    per_token = kl_penalty(logprobs, ref_logprobs, estimator)  # [N, T]
    return torch.where(mask, per_token, 0.0).sum(dim=1).detach()


def batch_reward_std(rewards: Tensor, valid: Tensor, collectives: Collectives) -> float:
    """The unbiased std of the ``valid`` entries of ``rewards`` over every data-parallel process
    (``scale_rewards="batch"``: one count, sum and sum of squares reduced, in float64); 0 for fewer than 2. A
    collective."""
    values = rewards[valid].double()
    moments = torch.stack([values.new_tensor(float(values.numel())), values.sum(), values.square().sum()])
    count, total, squares = collectives.reduce_sum(moments.to(rewards.device)).tolist()
    if count < 2:
        return 0.0
    return max(squares - total * total / count, 0.0) ** 0.5 / (count - 1) ** 0.5
