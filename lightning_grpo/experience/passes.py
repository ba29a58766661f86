"""Step 3 of an experience (:meth:`lightning_grpo.experience.maker.ExperienceMaker.make`): the no-grad logprob passes
over a rollout (the old policy's, the reference policy's and on-policy distillation's teacher's) and the KL in the
reward.

* old logprobs: needed when the rollout is reused (``num_iterations > 1`` or mini-batches) or the KL goes in the
  reward; never in ``correction.bypass_mode``, whose old policy is the sampler (verl ``bypass_mode``);
* reference logprobs: ``beta > 0``;
* teacher logprobs: with a teacher (``GRPOConfig.distillation``, :mod:`lightning_grpo.distillation`);
* with ``kl_in_reward``: the shaped rewards minus ``beta * sum_t KL_t`` of the behaviour policy (the old one, or the
  sampler in bypass mode) to the reference;
* a mixture-of-experts policy with ``routing_replay="R2"``: the old-logprob pass records its routing into the
  experience (replayed in the updates); with ``routing_replay_diagnostics``, one more no-grad pass of the policy
  without replay measures what the sampler/trainer mismatch would be without it
  (``sampling/without_replay/*``, docs/training.md "Metrics").
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Optional

import torch
from torch import Tensor, nn

from lightning_grpo.algorithm.shaping import sequence_kl
from lightning_grpo.config import GRPOConfig
from lightning_grpo.models.moe import ReplayStats
from lightning_grpo.protocols.teacher import Teacher
from lightning_grpo.training.experience import Experience
from lightning_grpo.training.logprobs import CompletionLogprobs
from lightning_grpo.training.routing_replay import PolicyRouting

#: The prefix of the mismatch metrics measured without routing replay (``routing_replay_diagnostics``).
WITHOUT_REPLAY = "sampling/without_replay"


class LogprobPasses:
    """The logprob passes of a rollout (see the module docstring).

    Args:
        config: the algorithm settings.
        logprobs: the completion-logprob computer (the old and reference passes; a model teacher's too).
        teacher: on-policy distillation's teacher, which scores every rollout's tokens into
            ``Experience.teacher_logprobs``; None without distillation.
    """

    def __init__(self, config: GRPOConfig, logprobs: CompletionLogprobs, teacher: Optional[Teacher] = None) -> None:
        self.config = config
        self.logprobs = logprobs
        self.teacher = teacher

    def run(
        self,
        experience: Experience,
        shaped: Tensor,
        scored: Tensor,
        extra: dict[str, tuple[Tensor, Tensor]],
        policy: nn.Module,
        ref: Optional[nn.Module],
        micro_batch_size: int,
        forward_context: Callable[[], ContextManager],
        max_tokens: Optional[int] = None,
    ) -> Tensor:
        """Old, reference and teacher logprobs into ``experience`` (``(N, T)`` float32 each, when needed), in passes
        of ``micro_batch_size`` sequences (of ``max_tokens`` tokens when given) inside ``forward_context()``. Returns
        the ``(N,)`` rewards: ``shaped``, or with ``kl_in_reward`` ``shaped - beta * sequence KL`` (the metrics
        ``kl`` and ``rewards/kl_penalty/mean`` into ``extra`` as ``(sum, count)``; ``scored``: the ``(N,)`` bool rows
        that have a reward).

        Raises:
            ValueError: ``correction.bypass_mode`` and the engine reported no sampler logprobs.
        """
        cfg = self.config
        n = len(experience)
        reused_later = cfg.num_iterations > 1 or (cfg.mini_batch_size or n) < n
        bypass = cfg.correction.bypass_mode  # the sampler's logprobs are the old policy's
        if bypass and experience.sampler_logprobs is None:
            raise ValueError("GRPOConfig.correction.bypass_mode=True takes the sampler's logprobs as the old policy's, "
                             "but the rollout engine reported none: use an engine that does (vLLM, rollout servers)")
        routing = self.logprobs.routing
        if (reused_later or cfg.kl_in_reward) and not bypass:
            recording = routing.recording(experience) if routing is not None and routing.mode == "R2" else None
            with recording if recording is not None else contextlib.nullcontext() as around:
                experience.old_logprobs = self.logprobs.batched(policy, experience, micro_batch_size,
                                                                forward_context, max_tokens=max_tokens, around=around)
        if routing is not None and cfg.routing_replay_diagnostics:
            self._without_replay(routing, experience, extra, policy, micro_batch_size, forward_context, max_tokens)
        if ref is not None:  # the reference routes by itself (a LoRA policy's reference shares its routers)
            with routing.suspended() if routing is not None else contextlib.nullcontext():
                experience.ref_logprobs = self.logprobs.batched(ref, experience, micro_batch_size, forward_context,
                                                                max_tokens=max_tokens)
        if self.teacher is not None:
            experience.teacher_logprobs = self.teacher.score(experience, micro_batch_size, forward_context,
                                                             max_tokens=max_tokens)
        if not cfg.kl_in_reward:
            return shaped
        behaviour = experience.sampler_logprobs if bypass else experience.old_logprobs
        assert behaviour is not None and experience.ref_logprobs is not None
        kl = sequence_kl(behaviour, experience.ref_logprobs, experience.completion_mask, cfg.kl_estimator)
        extra["kl"] = (kl.sum(), experience.completion_mask.sum().float())
        extra["rewards/kl_penalty/mean"] = (-cfg.beta * kl[scored].sum(), scored.sum().float())
        experience.ref_logprobs = None  # the KL is in the reward, not in the loss
        if not reused_later:
            experience.old_logprobs = None
        return shaped - cfg.beta * kl

    def _without_replay(self, routing: PolicyRouting, experience: Experience, extra: dict[str, tuple[Tensor, Tensor]],
                        policy: nn.Module, micro_batch_size: int, forward_context: Callable[[], ContextManager],
                        max_tokens: Optional[int]) -> None:
        """``routing_replay_diagnostics``: the policy's logprobs with its routers' own choices, and the mismatch they
        would give against the sampler's, over the loss tokens, into ``extra`` as ``(sum, count)``:
        ``sampling/without_replay/router_disagreement`` (over (position, MoE layer) pairs with a replayed selection),
        and with sampler logprobs ``sampling/without_replay/k3_kl`` and
        ``sampling/without_replay/sampling_logp_difference/mean`` (as ``sampling/k3_kl`` and
        ``sampling/sampling_logp_difference/mean`` of the training step, which replays)."""
        stats = ReplayStats()
        with routing.unreplayed(stats):
            logprobs = self.logprobs.batched(policy, experience, micro_batch_size, forward_context,
                                             max_tokens=max_tokens)
        zero = torch.zeros((), dtype=torch.float64)
        extra[f"{WITHOUT_REPLAY}/router_disagreement"] = (
            (stats.differing if stats.differing is not None else zero).cpu(),
            (stats.counted if stats.counted is not None else zero).cpu())
        if experience.sampler_logprobs is None:
            return
        mask = experience.completion_mask.bool()
        d = (logprobs.float() - experience.sampler_logprobs.float())[mask].double()
        count = mask.sum().double()
        extra[f"{WITHOUT_REPLAY}/k3_kl"] = ((torch.exp(d) - d - 1).sum(), count)
        extra[f"{WITHOUT_REPLAY}/sampling_logp_difference/mean"] = (d.abs().sum(), count)
