"""The GRPO objective of one micro-batch: per-token policy loss (PPO-clip at the token or sequence level, CISPO,
Clip-Cov or KL-Cov; per-token advantages with on-policy distillation), rollout correction (importance weight and
rejection masks), high-entropy selection, entropy bonus and KL, aggregated by ``loss_type``. Pure torch; the module
only runs the forward pass and logs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
from torch import Tensor

from lightning_grpo import functional as F
from lightning_grpo.algorithm.cispo import cispo_loss
from lightning_grpo.algorithm.correction import CorrectionOutput, correction_masks, rollout_log_ratio
from lightning_grpo.algorithm.covariance import CovarianceStats, clip_cov_loss, kl_cov_loss
from lightning_grpo.algorithm.distillation import distillation_advantages, reverse_kl
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
        correction: the rollout correction's log-ratio (with sampler logprobs) and rejection masks
            (:class:`~lightning_grpo.algorithm.correction.CorrectionOutput`).
        distillation_kl: ``(N, T)`` per-token reverse KL to the teacher (distillation), else None.
    """

    loss: Tensor
    mask: Tensor
    clip: F.ClipStats
    kl: Optional[Tensor] = None
    entropy: Optional[Tensor] = None
    importance_weights: Optional[Tensor] = None
    entropy_mask: Optional[Tensor] = None
    covariance_mask: Optional[Tensor] = None
    correction: CorrectionOutput = field(default_factory=CorrectionOutput)
    distillation_kl: Optional[Tensor] = None


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
    token_advantages: Optional[Tensor] = None,
) -> tuple[Tensor, F.ClipStats, Optional[Tensor]]:
    """``(N, T)`` per-token policy loss, its clip statistics and the covariance selection (or None);
    ``token_advantages`` (distillation, ``(N, T)``) replace the sequence ``advantages`` on every token."""
    if token_advantages is None:
        per_token_advantages = torch.where(mask, advantages.unsqueeze(1), 0.0)  # [N, T]
    else:
        per_token_advantages = torch.where(mask, token_advantages, 0.0)  # [N, T]
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
    per_sequence = sequence_level and token_advantages is None
    pg_advantages = advantages.unsqueeze(1) if per_sequence else per_token_advantages  # [N, 1] or [N, T]
    per_token, clip = F.policy_loss(
        log_ratio, torch.zeros_like(log_ratio), pg_advantages, eps_low, eps_high, config.clip_ratio_c, config.delta
    )
    return per_token.expand(mask.shape), _expand(clip, mask.shape), None


def _old_logprobs(detached: Tensor, old_logprobs: Optional[Tensor], sampler_logprobs: Optional[Tensor], mask: Tensor,
                  bypass: bool) -> Tensor:
    """``(N, T)`` old-policy logprobs: the sampler's in bypass mode, else ``old_logprobs`` or the detached current
    ones; the detached current ones at masked positions."""
    if bypass:
        if sampler_logprobs is None:
            raise ValueError("GRPOConfig.correction.bypass_mode=True takes the sampler's logprobs as the old policy's, "
                             "but this batch has none: use an engine that reports them (vLLM, rollout servers)")
        return torch.where(mask, sampler_logprobs.float(), detached)
    return detached if old_logprobs is None else torch.where(mask, old_logprobs.float(), detached)


def _rollout_correction(detached: Tensor, old: Tensor, sampler_logprobs: Optional[Tensor], mask: Tensor,
                        config: "GRPOConfig", advantages: Tensor) -> tuple[Optional[Tensor], CorrectionOutput]:
    """The importance weight (or None) and the rejection masks (:mod:`lightning_grpo.algorithm.correction`). Their
    log-ratio is ``old - sampler``, or ``current - sampler`` in bypass mode (``old`` is the sampler's there)."""
    weights = log_ratio = None
    if sampler_logprobs is not None:
        log_ratio = rollout_log_ratio(detached if config.correction.bypass_mode else old, sampler_logprobs, mask)
        if config.importance_weight_on():
            weights = rollout_importance_weights(
                old, sampler_logprobs, mask, config.tis_cap(), config.rollout_importance_sampling_level,
                config.importance_sampling_mode, low=config.importance_sampling_min,
            )
    behaviour = old if sampler_logprobs is None else torch.where(mask, sampler_logprobs.float(), detached)
    masks = correction_masks(config.correction, log_ratio, mask, logprobs=detached, behaviour_logprobs=behaviour,
                             advantages=advantages)
    return weights, CorrectionOutput(log_ratio, masks)


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
    teacher_logprobs: Optional[Tensor] = None,
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

    With ``teacher_logprobs`` (on-policy distillation) each token's advantage is
    :func:`~lightning_grpo.algorithm.distillation.distillation_advantages` of the old (behaviour) logprobs.
    With ``config.correction.bypass_mode`` the old logprobs are ``sampler_logprobs``.

    Then ``l`` times the importance weight ``clip(pi_old / pi_sampler, C_min, C)`` when ``sampler_logprobs`` are
    given and a bound is set (``config.importance_weight_on()``;
    :func:`~lightning_grpo.algorithm.importance.rollout_importance_weights` at
    ``config.rollout_importance_sampling_level``), times the rejection masks of ``config.correction``
    (:func:`~lightning_grpo.algorithm.correction.correction_masks`), times the high-entropy mask when
    ``config.top_entropy_quantile < 1``; then ``- entropy_coef * H`` and ``+ beta * KL(pi || pi_ref)`` (when
    ``ref_logprobs`` are given); then :func:`~lightning_grpo.functional.aggregate_loss` with ``config.loss_type`` and
    ``normalizer``.

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
        teacher_logprobs: ``(N, T)`` teacher logprobs of the same tokens (on-policy distillation), or None.

    Returns:
        :class:`ObjectiveOutput`.

    Raises:
        ValueError: a row with loss tokens has a non-finite advantage; ``entropy`` is missing although needed;
            shapes disagree; bypass mode without ``sampler_logprobs``.
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
    old = _old_logprobs(detached, old_logprobs, sampler_logprobs, mask, config.correction.bypass_mode)
    row_advantages = torch.where(has_tokens, advantages.float(), 0.0)  # [N]
    token_advantages = distillation_kl = None
    if teacher_logprobs is not None:  # on-policy distillation: per-token advantages from the reverse KL
        distill = config.distillation
        token_advantages = distillation_advantages(row_advantages, old, teacher_logprobs, mask, distill.coef,
                                                   distill.reward_weight)
        distillation_kl = reverse_kl(old, teacher_logprobs, mask)
    per_token, clip, covariance_mask = _policy_term(
        current, old, mask, row_advantages, config, generator, covariance_stats, clip_cov_selected, token_advantages
    )
    weights, correction = _rollout_correction(detached, old, sampler_logprobs, mask, config,
                                              row_advantages if token_advantages is None else token_advantages)
    if weights is not None:
        per_token = per_token * weights
    kept = correction.combined()
    if kept is not None:
        per_token = torch.where(kept, per_token, 0.0)
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
        correction=correction,
        distillation_kl=distillation_kl,
    )
