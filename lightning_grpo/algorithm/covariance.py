"""Clip-Cov and KL-Cov: restrain the tokens whose log-probability and advantage covary most (Cui et al. 2025, "The
Entropy Mechanism of Reinforcement Learning for Reasoning Language Models", arXiv:2505.22617, sec. 4; verl
``policy_loss.loss_mode="clip_cov"`` / ``"kl_cov"``, ``compute_policy_loss_clip_cov`` / ``_kl_cov``).

The entropy change of a softmax policy is driven by the covariance of a token's log-probability and its advantage;
per token it is estimated by the centered product ``cov_t = (log pi_t - c_logp) * (A_t - c_A)`` with the centers
``c`` the means over the loss tokens (sec. 4.1).

* **Clip-Cov**: among the tokens with ``lb < cov_t < ub`` (and whose PPO clip is not already active) a random
  ``max(int(ratio * n_tokens), 1)`` are chosen and get loss 0 and no gradient; the others keep the PPO loss.
* **KL-Cov**: the ``max(int(ratio * n_tokens), 1)`` tokens with the largest ``cov_t`` get ``+ coef * |log pi_t -
  log pi_old_t|``; the surrogate of every token is the unclipped ``-A * r_t`` (as in verl).

The selection is split into pure functions that take the centers, bounds, counts and thresholds as arguments, with
helpers that compute them from the tokens given, so a caller can pass statistics of a whole optimizer step
(:class:`CovarianceStats`). Random choices draw from an explicit ``torch.Generator``, never the global RNG.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from lightning_grpo.functional import LOG_RATIO_CLAMP, ClipStats, policy_loss


@dataclass(frozen=True)
class CovarianceStats:
    """Precomputed statistics of the covariance selection (e.g. over a whole optimizer step).

    Attributes:
        logprob_mean: center of the log-probabilities (mean over the loss tokens).
        advantage_mean: center of the per-token advantages (mean over the loss tokens).
        kl_threshold: KL-Cov selects the tokens with ``cov_t >= kl_threshold`` (see :func:`kl_cov_threshold`);
            None = the top tokens of the micro-batch itself.
    """

    logprob_mean: float
    advantage_mean: float
    kl_threshold: Optional[float] = None


def clip_cov_generator(seed: int, step: int) -> torch.Generator:
    """A CPU generator for Clip-Cov's draw at optimizer step ``step`` of a run seeded with ``seed``: the same
    ``(seed, step)`` gives the same stream on every device and process; different steps give different streams."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63))


def _check_ratio(name: str, ratio: float) -> None:
    if not 0 < ratio <= 1:
        raise ValueError(f"{name}={ratio} must be in (0, 1]")


def _per_token(advantages: Tensor, mask: Tensor) -> Tensor:
    return advantages.unsqueeze(1).expand(mask.shape) if advantages.dim() == 1 else advantages


def covariance_centers(logprobs: Tensor, advantages: Tensor, mask: Tensor) -> tuple[float, float]:
    """Means of the log-probabilities and the advantages over the loss tokens (0 when there are none).

    Args:
        logprobs: ``(N, T)`` float logprobs (masked positions may hold anything).
        advantages: ``(N,)`` per-sequence or ``(N, T)`` per-token float advantages.
        mask: ``(N, T)`` 0/1 loss mask.

    Returns:
        ``(logprob_mean, advantage_mean)``. Example (golden): logprobs [[-1, -3], [-2, NaN]], A [1, -2], mask
        [[1, 1], [1, 0]] -> (-2.0, 0.0).
    """
    mask = mask.bool()
    count = mask.sum().clamp(min=1)
    logprob_mean = torch.where(mask, logprobs.detach().float(), 0.0).sum() / count
    advantage_mean = torch.where(mask, _per_token(advantages, mask).detach().float(), 0.0).sum() / count
    return float(logprob_mean), float(advantage_mean)


def token_covariance(
    logprobs: Tensor, advantages: Tensor, mask: Tensor, logprob_mean: float, advantage_mean: float
) -> Tensor:
    """``cov_t = (logprobs_t - logprob_mean) * (A_t - advantage_mean)`` (arXiv:2505.22617 sec. 4.1).

    Args:
        logprobs: ``(N, T)`` float logprobs; advantages: ``(N,)`` or ``(N, T)``; mask: ``(N, T)`` 0/1.
        logprob_mean, advantage_mean: the centers (see :func:`covariance_centers`).

    Returns:
        ``(N, T)`` float32 without grad; ``-inf`` at masked positions (never selected).
    """
    mask = mask.bool()
    with torch.no_grad():
        centered_logp = logprobs.detach().float() - logprob_mean
        centered_adv = _per_token(advantages, mask).float() - advantage_mean
        return torch.where(mask, centered_logp * centered_adv, -torch.inf)


def selection_count(num_tokens: int, ratio: float) -> int:
    """``max(int(ratio * num_tokens), 1)`` tokens, verl's count for both Clip-Cov and KL-Cov.

    Raises:
        ValueError: ``ratio`` outside (0, 1] or ``num_tokens < 0``.
    """
    _check_ratio("ratio", ratio)
    if num_tokens < 0:
        raise ValueError(f"num_tokens={num_tokens} must be >= 0")
    return max(int(ratio * num_tokens), 1)


def clip_cov_mask(
    covariance: Tensor,
    mask: Tensor,
    lower: float,
    upper: float,
    count: int,
    generator: torch.Generator,
    exclude: Optional[Tensor] = None,
) -> Tensor:
    """Clip-Cov's tokens: ``count`` drawn at random, without replacement, from the loss tokens with
    ``lower < cov_t < upper`` that are not in ``exclude`` (all of them when fewer).

    Args:
        covariance: ``(N, T)`` float (see :func:`token_covariance`).
        mask: ``(N, T)`` 0/1 loss mask.
        lower, upper: the open covariance interval (``clip_cov_lb``, ``clip_cov_ub``).
        count: how many tokens to choose (>= 0; see :func:`selection_count`).
        generator: the random stream (a permutation of the candidates is drawn on its device).
        exclude: ``(N, T)`` bool tokens that may not be chosen (those whose PPO clip is already active), or None.

    Returns:
        ``(N, T)`` bool, True for the chosen tokens.

    Raises:
        ValueError: ``lower >= upper`` or ``count < 0``.
    """
    if lower >= upper:
        raise ValueError(f"clip_cov_lb={lower} must be < clip_cov_ub={upper}")
    if count < 0:
        raise ValueError(f"count={count} must be >= 0")
    candidates = mask.bool() & (covariance > lower) & (covariance < upper)
    if exclude is not None:
        candidates = candidates & ~exclude.bool()
    index = candidates.flatten().nonzero().flatten()  # [K]
    order = torch.randperm(index.numel(), generator=generator, device=generator.device)
    chosen = index[order[:count].to(index.device)]
    selected = torch.zeros(covariance.numel(), dtype=torch.bool, device=covariance.device)
    selected[chosen] = True
    return selected.view(covariance.shape)


def kl_cov_threshold(covariance: Tensor, mask: Tensor, ratio: float) -> float:
    """The covariance of the ``selection_count(n, ratio)``-th largest of the ``n`` loss tokens (KL-Cov's cut);
    ``inf`` when there are no loss tokens.

    Example (golden): covariances [3, 1, 2, 0.5, -1] of 5 tokens, ratio 0.4 -> 2 tokens -> threshold 2.0.
    """
    values = covariance[mask.bool()].float()
    if values.numel() == 0:
        return float("inf")
    count = selection_count(values.numel(), ratio)
    return float(torch.topk(values, count).values[-1])


def kl_cov_mask(covariance: Tensor, mask: Tensor, threshold: float) -> Tensor:
    """KL-Cov's tokens: the loss tokens with ``cov_t >= threshold``. Ties at the threshold are all selected (verl's
    ``topk`` picks one of them arbitrarily).

    Returns:
        ``(N, T)`` bool.
    """
    return mask.bool() & (covariance >= threshold)


def covariance_stats(logprobs: Tensor, advantages: Tensor, mask: Tensor, kl_cov_ratio: float) -> CovarianceStats:
    """:class:`CovarianceStats` of the tokens given (e.g. all the tokens of an optimizer step, concatenated)."""
    logprob_mean, advantage_mean = covariance_centers(logprobs, advantages, mask)
    covariance = token_covariance(logprobs, advantages, mask, logprob_mean, advantage_mean)
    return CovarianceStats(logprob_mean, advantage_mean, kl_cov_threshold(covariance, mask, kl_cov_ratio))


def _covariance(logprobs: Tensor, advantages: Tensor, mask: Tensor, stats: Optional[CovarianceStats]) -> Tensor:
    if stats is None:
        stats = CovarianceStats(*covariance_centers(logprobs, advantages, mask))
    return token_covariance(logprobs, advantages, mask, stats.logprob_mean, stats.advantage_mean)


def clip_cov_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    epsilon_low: float,
    epsilon_high: float,
    clip_ratio_c: Optional[float],
    delta: Optional[float],
    ratio: float,
    lower: float,
    upper: float,
    generator: torch.Generator,
    stats: Optional[CovarianceStats] = None,
    selected: Optional[Tensor] = None,
) -> tuple[Tensor, ClipStats, Tensor]:
    """Per-token Clip-Cov loss: the PPO loss of :func:`~lightning_grpo.functional.policy_loss`, set to 0 (no value,
    no gradient) on the tokens of :func:`clip_cov_mask` (arXiv:2505.22617 sec. 4.2; verl ``clip_cov``).

    The candidates exclude the tokens whose PPO (or dual) clip is active; the count is
    ``selection_count(loss tokens of this call, ratio)``; the centers come from ``stats`` or from these tokens.

    Args:
        logprobs, old_logprobs: ``(N, T)`` float (``logprobs`` with grad); advantages: ``(N, T)`` float (0 at
            masked positions); mask: ``(N, T)`` 0/1.
        epsilon_low, epsilon_high, clip_ratio_c, delta: the PPO clip (see ``policy_loss``).
        ratio, lower, upper: ``clip_cov_ratio``, ``clip_cov_lb``, ``clip_cov_ub``.
        generator: the random stream of the draw.
        stats: precomputed centers, or None.
        selected: ``(N, T)`` bool tokens chosen over the whole optimizer step (precomputed with the same rule), or
            None: drawn here from this call's tokens.

    Returns:
        ``(loss, clip_stats, selected)``: ``(N, T)`` float loss, the PPO :class:`ClipStats`, ``(N, T)`` bool tokens
        whose loss was dropped.
    """
    mask = mask.bool()
    loss, clip = policy_loss(logprobs, old_logprobs, advantages, epsilon_low, epsilon_high, clip_ratio_c, delta)
    if selected is None:
        covariance = _covariance(logprobs, advantages, mask, stats)
        count = selection_count(int(mask.sum()), ratio)
        selected = clip_cov_mask(covariance, mask, lower, upper, count, generator, exclude=clip.region | clip.dual)
    selected = selected & mask
    return torch.where(selected, 0.0, loss), clip, selected


def kl_cov_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    ratio: float,
    coef: float,
    stats: Optional[CovarianceStats] = None,
) -> tuple[Tensor, ClipStats, Tensor]:
    """Per-token KL-Cov loss ``-A * r_t`` (unclipped) ``+ coef * |log r_t|`` on the tokens of :func:`kl_cov_mask`
    (arXiv:2505.22617 sec. 4.2; verl ``kl_cov`` with ``ppo_kl_coef``).

    Args:
        logprobs, old_logprobs, advantages, mask: as in :func:`clip_cov_loss`.
        ratio, coef: ``kl_cov_ratio`` and ``ppo_kl_coef``.
        stats: precomputed centers and threshold (``kl_threshold`` None: the top tokens of this call).

    Returns:
        ``(loss, clip_stats, selected)``; ``clip_stats`` has no clipped token (the surrogate is unclipped).
    """
    mask = mask.bool()
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    policy_ratio = torch.exp(log_ratio)
    covariance = _covariance(logprobs, advantages, mask, stats)
    threshold = None if stats is None else stats.kl_threshold
    if threshold is None:
        threshold = kl_cov_threshold(covariance, mask, ratio)
    selected = kl_cov_mask(covariance, mask, threshold)
    loss = -advantages * policy_ratio + torch.where(selected, coef * log_ratio.abs(), 0.0)
    none = torch.zeros_like(mask)
    return loss, ClipStats(low=none, high=none, dual=none, ratio=policy_ratio.detach()), selected
