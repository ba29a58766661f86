"""The GRPO variants beyond the core functions of :mod:`lightning_grpo.functional`, as pure torch functions:
reward shaping (overlong punishment, scale/bias/clip, KL in the reward), rollout importance correction and
rejection masks, on-policy distillation, sequence-level policy ratios (GSPO), CISPO, Clip-Cov / KL-Cov token
selection, high-entropy token selection, dynamic sampling and the per-micro-batch objective that puts them together.

Every knob is mapped to its TRL / verl name and its paper in ``docs/algorithm.md``.
"""

from lightning_grpo.algorithm.cispo import cispo_loss
from lightning_grpo.algorithm.correction import (
    CorrectionOutput,
    correction_masks,
    geometric_mask,
    kl_mask,
    off_policy_mask,
    rollout_log_ratio,
)
from lightning_grpo.algorithm.covariance import (
    CovarianceStats,
    clip_cov_generator,
    clip_cov_loss,
    clip_cov_mask,
    covariance_centers,
    covariance_stats,
    kl_cov_loss,
    kl_cov_mask,
    kl_cov_threshold,
    selection_count,
    token_covariance,
)
from lightning_grpo.algorithm.distillation import distillation_advantages, reverse_kl
from lightning_grpo.algorithm.dynamic_sampling import DynamicSampler, ScoredRollout, informative_groups
from lightning_grpo.algorithm.entropy import high_entropy_mask
from lightning_grpo.algorithm.importance import rollout_importance_weights
from lightning_grpo.algorithm.objective import ObjectiveOutput, grpo_objective
from lightning_grpo.algorithm.sequence import policy_log_ratio, sequence_log_ratio
from lightning_grpo.algorithm.shaping import overlong_penalty, sequence_kl, transform_rewards

__all__ = [
    "CorrectionOutput",
    "CovarianceStats",
    "DynamicSampler",
    "ObjectiveOutput",
    "ScoredRollout",
    "cispo_loss",
    "clip_cov_generator",
    "clip_cov_loss",
    "clip_cov_mask",
    "covariance_centers",
    "correction_masks",
    "covariance_stats",
    "distillation_advantages",
    "geometric_mask",
    "grpo_objective",
    "high_entropy_mask",
    "informative_groups",
    "kl_cov_loss",
    "kl_cov_mask",
    "kl_cov_threshold",
    "kl_mask",
    "off_policy_mask",
    "overlong_penalty",
    "policy_log_ratio",
    "reverse_kl",
    "rollout_importance_weights",
    "rollout_log_ratio",
    "selection_count",
    "sequence_kl",
    "sequence_log_ratio",
    "token_covariance",
    "transform_rewards",
]
