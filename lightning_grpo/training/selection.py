"""Statistics of a whole optimizer step that the objective needs per token, computed once at the step's start (the
loop plans each step before its first micro-batch; each micro-batch carries its plan, a
:class:`~lightning_grpo.training.experience.StepPlan`).

Three knobs select tokens by a statistic of "the batch" (the papers' definition): the high-entropy cut of
``top_entropy_quantile`` (arXiv:2506.01939 sec. 4), the covariance centers and KL-Cov's top-k cut, and Clip-Cov's
random draw (arXiv:2505.22617 sec. 4.2). Taken per micro-batch they would make the gradient depend on
``accumulate_grad_batches``. Here they are taken over every micro-batch of the step (and, for the quantile, the
centers and KL-Cov's cut, over every process), from a no-grad forward pass of the policy at the start of the step
(the weights do not change within a step), so accumulation changes memory, not the gradient. The extra pass costs
one forward of the step's tokens, only when one of these knobs is on.

Clip-Cov draws ``selection_count(tokens of this process's step)`` tokens on each process, in a canonical order
(rollout row, position), from ``clip_cov_generator(shuffle_seed, step)``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_grpo import functional as F
from lightning_grpo.algorithm import ObjectiveOutput, grpo_objective
from lightning_grpo.algorithm.covariance import (
    CovarianceStats,
    clip_cov_generator,
    kl_cov_threshold,
    selection_count,
    token_covariance,
)
from lightning_grpo.algorithm.entropy import entropy_threshold
from lightning_grpo.config import GRPOConfig
from lightning_grpo.protocols.collectives import Collectives, gather_per_process
from lightning_grpo.training.experience import Experience, StepPlan
from lightning_grpo.training.logprobs import CompletionLogprobs


def needs_step_selection(config: GRPOConfig) -> bool:
    """Whether the objective selects tokens by a statistic of the batch."""
    return config.top_entropy_quantile < 1 or config.policy_loss_mode != "vanilla"


class StepSelection:
    """Plans each optimizer step before its first micro-batch: the keyword arguments of
    :func:`lightning_grpo.algorithm.grpo_objective` that make the step's loss independent of its micro-batch split
    (:class:`~lightning_grpo.training.experience.StepPlan`, carried by each micro-batch).

    Args:
        config: the algorithm settings.
        logprobs: the completion-logprob computer (the same forward layout as training).
    """

    def __init__(self, config: GRPOConfig, logprobs: CompletionLogprobs) -> None:
        self.config = config
        self.logprobs = logprobs

    def plan(self, policy: nn.Module, members: list[Experience], collectives: Collectives, step: int) -> list[StepPlan]:
        """The statistics of the step whose micro-batches are ``members`` (in training order), one plan per
        micro-batch (the same statistics; Clip-Cov's selection of each). A collective under data parallelism (every
        process plans each step)."""
        cfg = self.config
        statistics: dict[str, Any] = {}
        selected: list[Tensor] = []
        if cfg.policy_loss_mode == "clip_cov":
            statistics["generator"] = clip_cov_generator(cfg.shuffle_seed, step)
        if needs_step_selection(cfg) and members:
            with torch.no_grad():
                passes = [self.logprobs(policy, mb, with_entropy=cfg.top_entropy_quantile < 1) for mb in members]
            masks = [mb.completion_mask.bool() for mb in members]
            if cfg.top_entropy_quantile < 1:
                local = torch.cat([e[m].float().cpu() for (_, e), m in zip(passes, masks, strict=True)])
                values = torch.cat(gather_per_process(local))
                statistics["entropy_threshold"] = entropy_threshold(values, cfg.top_entropy_quantile)
            if cfg.policy_loss_mode != "vanilla":
                selected = self._covariance(members, [lp for lp, _ in passes], masks, collectives, step, statistics)
        return [StepPlan(statistics, selected[i] if selected else None) for i in range(len(members))]

    def objective(self, batch: Experience, logprobs: Tensor, entropy: Optional[Tensor]) -> ObjectiveOutput:
        """:func:`lightning_grpo.algorithm.grpo_objective` of the micro-batch ``batch`` given the policy's ``(B, T)``
        float32 logprobs and entropy, with its step's statistics (``batch.step_plan``; without one, the batch's own);
        the old logprobs only after the rollout's first optimizer step, the reference ones unless the KL is in the
        reward, the teacher's with on-policy distillation.

        Raises:
            ValueError: ``batch`` is not ``on_policy`` but has no ``old_logprobs`` (outside
                ``correction.bypass_mode``, whose old policy is the sampler); see also ``grpo_objective``.
        """
        cfg = self.config
        if not batch.on_policy and batch.old_logprobs is None and not cfg.correction.bypass_mode:
            raise ValueError("an experience micro-batch after the rollout's first optimizer step needs old_logprobs")
        return grpo_objective(
            logprobs, batch.completion_mask, batch.advantages, cfg,
            old_logprobs=None if batch.on_policy else batch.old_logprobs,
            ref_logprobs=None if cfg.kl_in_reward else batch.ref_logprobs, sampler_logprobs=batch.sampler_logprobs,
            entropy=entropy, normalizer=batch.loss_normalizer, teacher_logprobs=batch.teacher_logprobs,
            **({} if batch.step_plan is None else batch.step_plan.objective_kwargs()),
        )

    def _covariance(self, members: list[Experience], logprobs: list[Tensor], masks: list[Tensor],
                    collectives: Collectives, step: int, statistics: dict[str, Any]) -> list[Tensor]:
        """The covariance centers (and KL-Cov's cut) over the step into ``statistics``; Clip-Cov's selection per
        micro-batch, else []."""
        cfg = self.config
        advantages = [torch.where(m, mb.advantages.float().unsqueeze(1), 0.0) for mb, m in zip(members, masks,
                                                                                                strict=True)]
        sums = torch.stack([
            sum(torch.where(m, lp.float(), 0.0).sum() for lp, m in zip(logprobs, masks, strict=True)),
            sum(torch.where(m, a, 0.0).sum() for a, m in zip(advantages, masks, strict=True)),
            sum(m.sum() for m in masks).float(),
        ]).double()
        total_logprob, total_advantage, count = collectives.reduce_sum(sums.to(masks[0].device)).tolist()
        centers = (total_logprob / max(count, 1.0), total_advantage / max(count, 1.0))
        covariances = [token_covariance(lp, a, m, *centers)
                       for lp, a, m in zip(logprobs, advantages, masks, strict=True)]
        threshold = None
        if cfg.policy_loss_mode == "kl_cov":
            values = torch.cat(gather_per_process(torch.cat([c[m].cpu() for c, m in zip(covariances, masks,
                                                                                         strict=True)])))
            threshold = kl_cov_threshold(values, torch.ones_like(values, dtype=torch.bool), cfg.kl_cov_ratio)
        statistics["covariance_stats"] = CovarianceStats(centers[0], centers[1], threshold)
        if cfg.policy_loss_mode == "clip_cov":
            return self._draw_clip_cov(members, logprobs, advantages, masks, covariances, step)
        return []

    def _draw_clip_cov(self, members: list[Experience], logprobs: list[Tensor], advantages: list[Tensor],
                       masks: list[Tensor], covariances: list[Tensor], step: int) -> list[Tensor]:
        """Clip-Cov's draw over the step: candidates ``lb < cov < ub`` whose PPO clip is not active, in the
        canonical order (rollout row, position), ``selection_count(step tokens)`` of them at random."""
        cfg = self.config
        keys, where = [], []
        for index, (mb, lp, a, m, c) in enumerate(zip(members, logprobs, advantages, masks, covariances,
                                                      strict=True)):
            old = lp if mb.on_policy or mb.old_logprobs is None else torch.where(m, mb.old_logprobs.float(), lp)
            if cfg.correction.bypass_mode and mb.sampler_logprobs is not None:  # the old policy is the sampler
                old = torch.where(m, mb.sampler_logprobs.float(), lp)
            _, clip = F.policy_loss(lp, old, a, cfg.epsilon_low, cfg.epsilon_high, cfg.clip_ratio_c, cfg.delta)
            candidates = m & (c > cfg.clip_cov_lb) & (c < cfg.clip_cov_ub) & ~(clip.region | clip.dual)
            row, col = candidates.nonzero(as_tuple=True)
            rows = mb.rows.to(row.device)[row] if mb.rows is not None else row
            keys.append(rows.long() * (1 << 20) + col.long())
            where.append(torch.stack([torch.full_like(row, index), row, col], dim=1))
        key, place = torch.cat(keys), torch.cat(where)
        place = place[key.argsort()]  # [K, 3] in canonical order
        count = selection_count(int(sum(m.sum() for m in masks)), cfg.clip_cov_ratio)
        chosen = place[torch.randperm(len(place), generator=clip_cov_generator(cfg.shuffle_seed, step))[:count]]
        selections = []
        for index in range(len(members)):
            selected = torch.zeros_like(masks[index])
            picked = chosen[chosen[:, 0] == index]
            selected[picked[:, 1], picked[:, 2]] = True
            selections.append(selected)
        return selections
