"""The GRPO objective of one micro-batch: per-token policy loss (PPO-clip at the token or sequence level, CISPO,
Clip-Cov or KL-Cov), rollout importance correction, high-entropy selection, entropy bonus and KL, aggregated by
``loss_type``. Pure torch; the module only runs the forward pass and logs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

from lightning_grpo import functional as F
from lightning_grpo.algorithm.cispo import cispo_loss
from lightning_grpo.algorithm.covariance import CovarianceStats, clip_cov_loss, kl_cov_loss
from lightning_grpo.algorithm.entropy import high_entropy_mask
from lightning_grpo.algorithm.importance import rollout_importance_weights
from lightning_grpo.algorithm.sequence import policy_log_ratio

if TYPE_CHECKING:
    from lightning_grpo.config import GRPOConfig


@dataclass
class ObjectiveOutput:
    """The loss of one micro-batch and what was computed on the way (all but ``loss`` without grad).

    Attributes:
        loss: 0-dim float, the micro-batch's share of the step loss (``sum / normalizer``).
        mask: ``(N, T)`` bool loss mask.
        clip: the :class:`lightning_grpo.functional.ClipStats` (with the per-token ratio; at the sequence level
            every token of a sequence carries the sequence's ratio and clip flags).
        kl: ``(N, T)`` per-token KL to the reference (KL in the loss), else None.
        entropy: ``(N, T)`` per-token entropy, else None.
        importance_weights: ``(N, T)`` rollout importance weights (TIS), else None.
        entropy_mask: ``(N, T)`` bool high-entropy tokens that got the policy-gradient loss, else None.
        covariance_mask: ``(N, T)`` bool tokens whose loss Clip-Cov dropped or that KL-Cov penalized, else None.
    """

    loss: Tensor
    mask: Tensor
    clip: F.ClipStats
    kl: Optional[Tensor] = None
    entropy: Optional[Tensor] = None
    importance_weights: Optional[Tensor] = None
    entropy_mask: Optional[Tensor] = None
    covariance_mask: Optional[Tensor] = None


def _expand(clip: F.ClipStats, shape: torch.Size) -> F.ClipStats:
    ratio = None if clip.ratio is None else clip.ratio.expand(shape)
    return F.ClipStats(clip.low.expand(shape), clip.high.expand(shape), clip.dual.expand(shape), ratio)


def _policy_term(
    current: Tensor,
    old: Tensor,
    mask: Tensor,
    advantages: Tensor,
    config: "GRPOConfig",
    generator: Optional[torch.Generator],
    covariance_stats: Optional[CovarianceStats],
    clip_cov_selected: Optional[Tensor] = None,
) -> tuple[Tensor, F.ClipStats, Optional[Tensor]]:
    """``(N, T)`` per-token policy loss, its clip statistics and the covariance selection (or None)."""
    per_token_advantages = torch.where(mask, advantages.unsqueeze(1), 0.0)  # [N, T]
    eps_low, eps_high = config.epsilon_low, config.epsilon_high
    if config.policy_loss_mode == "clip_cov":
        if generator is None:
            generator = torch.Generator().manual_seed(config.shuffle_seed)
        return clip_cov_loss(
            current, old, per_token_advantages, mask, epsilon_low=eps_low, epsilon_high=eps_high,
            clip_ratio_c=config.clip_ratio_c, delta=config.delta, ratio=config.clip_cov_ratio,
            lower=config.clip_cov_lb, upper=config.clip_cov_ub, generator=generator, stats=covariance_stats,
            selected=clip_cov_selected,
        )
    if config.policy_loss_mode == "kl_cov":
        return kl_cov_loss(
            current, old, per_token_advantages, mask, ratio=config.kl_cov_ratio, coef=config.ppo_kl_coef,
            stats=covariance_stats,
        )
    log_ratio = policy_log_ratio(current, old, mask, config.importance_sampling_level)  # [N, T] or [N, 1]
    if config.loss_type == "cispo":
        per_token, clip = cispo_loss(torch.where(mask, current, 0.0), log_ratio, per_token_advantages, eps_low,
                                     eps_high)
        return per_token, clip, None
    sequence_level = config.importance_sampling_level == "sequence"
    pg_advantages = advantages.unsqueeze(1) if sequence_level else per_token_advantages  # [N, 1] or [N, T]
    per_token, clip = F.policy_loss(
        log_ratio, torch.zeros_like(log_ratio), pg_advantages, eps_low, eps_high, config.clip_ratio_c, config.delta
    )
    return per_token.expand(mask.shape), _expand(clip, mask.shape), None


def grpo_objective(
    logprobs: Tensor,
    mask: Tensor,
    advantages: Tensor,
    config: "GRPOConfig",
    *,
    old_logprobs: Optional[Tensor] = None,
    ref_logprobs: Optional[Tensor] = None,
    sampler_logprobs: Optional[Tensor] = None,
    entropy: Optional[Tensor] = None,
    normalizer: Optional[float] = None,
    generator: Optional[torch.Generator] = None,
    covariance_stats: Optional[CovarianceStats] = None,
    entropy_threshold: Optional[float] = None,
    clip_cov_selected: Optional[Tensor] = None,
) -> ObjectiveOutput:
    """GRPO loss of a micro-batch (DeepSeekMath eq. 3 with the variants of ``config``).

    Per token: the policy loss ``l``, chosen by ``config`` (docs/algorithm.md maps each to its paper):

    * PPO-clip (clip-higher, dual clip, delta; :func:`~lightning_grpo.functional.policy_loss`) of the ratio at
      ``config.importance_sampling_level``: per token (GRPO), per sequence (GSPO eq. 5/7, the sequence's loss on each
      of its tokens) or GSPO-token (:func:`~lightning_grpo.algorithm.sequence.policy_log_ratio`);
    * ``loss_type="cispo"``: :func:`~lightning_grpo.algorithm.cispo.cispo_loss` (MiniMax-M1 eq. 4), with the weight
      at the same level;
    * ``policy_loss_mode="clip_cov"`` / ``"kl_cov"``: :mod:`lightning_grpo.algorithm.covariance` (arXiv:2505.22617
      sec. 4; token level only).

    Then ``l`` times the TIS weight ``min(pi_old / pi_sampler, C)`` when ``sampler_logprobs`` are given and
    ``config.tis_cap()`` is set (:func:`~lightning_grpo.algorithm.importance.rollout_importance_weights`
    at ``config.rollout_importance_sampling_level``), times the high-entropy mask when ``config.top_entropy_quantile
    < 1``; then ``- entropy_coef * H`` and ``+ beta * KL(pi || pi_ref)`` (when ``ref_logprobs`` are given); then
    :func:`~lightning_grpo.functional.aggregate_loss` with ``config.loss_type`` and ``normalizer``.

    Values at masked positions (logprobs, old/ref/sampler logprobs, entropy) never reach the loss or its
    gradient, even when they are NaN or inf: they are replaced before any arithmetic and the gradient path through
    them is cut. Rows without any loss token may have any advantage.

    Args:
        logprobs: ``(N, T)`` float32 current-policy logprobs (with grad).
        mask: ``(N, T)`` 0/1 loss mask.
        advantages: ``(N,)`` float advantages.
        config: the :class:`~lightning_grpo.config.GRPOConfig`.
        old_logprobs: ``(N, T)`` behaviour-policy logprobs; None = the detached ``logprobs`` (the policy has not
            changed since the rollout, so the ratio is exactly 1).
        ref_logprobs: ``(N, T)`` reference-policy logprobs for the KL term, or None (no KL in the loss).
        sampler_logprobs: ``(N, T)`` rollout-engine logprobs, or None (no importance correction).
        entropy: ``(N, T)`` per-token entropy; with grad when ``config.entropy_coef > 0``. Needed when
            ``entropy_coef > 0`` or ``top_entropy_quantile < 1``.
        normalizer: the optimizer step's loss denominator (see :func:`~lightning_grpo.functional.loss_normalizer`);
            None = this micro-batch's own.
        generator: the random stream of Clip-Cov's draw (e.g. ``clip_cov_generator(config.shuffle_seed, step)``);
            None = a generator seeded with ``config.shuffle_seed`` alone (the same stream at every call). The global
            RNG is never used.
        covariance_stats: Clip-Cov / KL-Cov centers (and KL-Cov threshold) precomputed over the optimizer step; None =
            computed from this micro-batch's loss tokens (as verl does per micro-batch), so then the selection
            depends on how the step is split into micro-batches.
        entropy_threshold: the high-entropy cut precomputed over the optimizer step's tokens on every process
            (:func:`~lightning_grpo.algorithm.entropy.entropy_threshold`); None = this micro-batch's own quantile.
        clip_cov_selected: ``(N, T)`` bool, Clip-Cov's tokens drawn over the whole optimizer step; None = drawn
            from this micro-batch. :mod:`lightning_grpo.training.selection` computes all three per step, so that the
            step's gradient does not depend on the micro-batch split.

    Returns:
        :class:`ObjectiveOutput`.

    Raises:
        ValueError: a row with loss tokens has a non-finite advantage; ``entropy`` is missing although needed;
            shapes disagree.
    """
    if logprobs.shape != mask.shape or advantages.shape != logprobs.shape[:1]:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)}, mask {tuple(mask.shape)} and advantages {tuple(advantages.shape)} "
            "must be (N, T), (N, T) and (N,)"
        )
    mask = mask.bool()
    has_tokens = mask.any(dim=1)  # [N]
    if not torch.isfinite(advantages[has_tokens]).all():
        bad = (has_tokens & ~torch.isfinite(advantages)).nonzero().flatten().tolist()
        raise ValueError(f"advantages of rows {bad} are not finite although those rows have loss tokens")
    detached = logprobs.detach()
    current = torch.where(mask, logprobs, detached)  # the gradient never flows through masked positions
    old = detached if old_logprobs is None else torch.where(mask, old_logprobs.float(), detached)
    row_advantages = torch.where(has_tokens, advantages.float(), 0.0)  # [N]
    per_token, clip, covariance_mask = _policy_term(
        current, old, mask, row_advantages, config, generator, covariance_stats, clip_cov_selected
    )
    weights = None
    cap = config.tis_cap()
    if sampler_logprobs is not None and cap is not None:
        weights = rollout_importance_weights(
            old, sampler_logprobs, mask, cap,
            config.rollout_importance_sampling_level, config.importance_sampling_mode,
        )
        per_token = per_token * weights
    needs_entropy = config.entropy_coef > 0 or config.top_entropy_quantile < 1
    if needs_entropy and entropy is None:
        raise ValueError("entropy is required when entropy_coef > 0 or top_entropy_quantile < 1")
    entropy_mask = None
    if config.top_entropy_quantile < 1:
        assert entropy is not None
        entropy_mask = high_entropy_mask(entropy, mask, config.top_entropy_quantile, entropy_threshold)
        per_token = torch.where(entropy_mask, per_token, 0.0)
    if config.entropy_coef > 0:
        assert entropy is not None
        per_token = per_token - config.entropy_coef * torch.where(mask, entropy, entropy.detach())
    kl = None
    if ref_logprobs is not None and config.beta > 0:
        ref = torch.where(mask, ref_logprobs.float(), detached)
        kl = F.kl_penalty(current, ref, config.kl_estimator)
        per_token = per_token + config.beta * kl
    loss = F.aggregate_loss(per_token, mask, config.loss_type, config.max_new_tokens, normalizer)
    return ObjectiveOutput(
        loss=loss,
        mask=mask,
        clip=clip,
        kl=None if kl is None else kl.detach(),
        entropy=None if entropy is None else entropy.detach(),
        importance_weights=weights,
        entropy_mask=entropy_mask,
        covariance_mask=covariance_mask,
    )
