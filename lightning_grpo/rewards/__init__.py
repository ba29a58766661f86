"""Reward functions for GRPO and their orchestration.

A reward function is ``fn(prompts: list, completions: list[str], **columns) -> list[float | None]``, called with
one entry per completion; dataset columns (e.g. ``answer``) arrive as keyword arguments. Config files name reward
functions by string; :func:`resolve_reward_function` turns a registered name (:data:`REWARD_FUNCTIONS`) or an
import path into the function.

Rewards that take time run in a bounded pool (:mod:`lightning_grpo.rewards.pool`): the sandboxed code reward
(:mod:`lightning_grpo.rewards.code`) here, and in the compute layer the reward model
(:mod:`lightning_grpo.rewards.reward_model`) and the LLM judge (:mod:`lightning_grpo.rewards.judge`), which this
package does not import (they need torch models and HTTP). docs/rewards.md describes every reward source.
"""

from __future__ import annotations

from lightning_grpo.rewards.code import CODE_OUTCOMES, CodeReward, code_block_format, extract_code
from lightning_grpo.rewards.format import gsm8k_format
from lightning_grpo.rewards.gsm8k import extract_answer, gold_answer, gsm8k_accuracy, make_gsm8k_accuracy
from lightning_grpo.rewards.math import make_math_accuracy, math_accuracy
from lightning_grpo.rewards.pool import PooledFunction, PooledReward, RewardChunk, RewardPool, pooled
from lightning_grpo.rewards.registry import REWARD_FUNCTIONS, resolve_reward_function
from lightning_grpo.rewards.reward_set import RewardSet, RewardSpec
from lightning_grpo.rewards.scoring import (
    RewardScores,
    StartedScores,
    reward_function_names,
    score_completions,
    start_pooled,
)

__all__ = [
    "CODE_OUTCOMES",
    "CodeReward",
    "PooledFunction",
    "PooledReward",
    "REWARD_FUNCTIONS",
    "RewardChunk",
    "RewardPool",
    "StartedScores",
    "code_block_format",
    "extract_code",
    "pooled",
    "start_pooled",
    "RewardScores",
    "RewardSet",
    "RewardSpec",
    "extract_answer",
    "gold_answer",
    "gsm8k_accuracy",
    "gsm8k_format",
    "make_gsm8k_accuracy",
    "make_math_accuracy",
    "math_accuracy",
    "resolve_reward_function",
    "reward_function_names",
    "score_completions",
]
