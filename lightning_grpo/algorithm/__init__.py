"""The GRPO variants beyond the core functions of :mod:`lightning_grpo.functional`, as pure torch functions:
reward shaping (overlong punishment, scale/bias/clip, KL in the reward), rollout importance correction,
high-entropy token selection, dynamic sampling and the per-micro-batch objective that puts them together.

Every knob is mapped to its TRL / verl name and its paper in ``docs/algorithm.md``.
"""

from lightning_grpo.algorithm.dynamic_sampling import DynamicSampler, ScoredRollout, informative_groups
from lightning_grpo.algorithm.entropy import high_entropy_mask
from lightning_grpo.algorithm.importance import rollout_importance_weights
from lightning_grpo.algorithm.objective import ObjectiveOutput, grpo_objective
from lightning_grpo.algorithm.shaping import overlong_penalty, sequence_kl, transform_rewards

__all__ = [
    "DynamicSampler",
    "ObjectiveOutput",
    "ScoredRollout",
    "grpo_objective",
    "high_entropy_mask",
    "informative_groups",
    "overlong_penalty",
    "rollout_importance_weights",
    "sequence_kl",
    "transform_rewards",
]
