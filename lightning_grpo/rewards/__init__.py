"""Reward functions for GRPO and their orchestration.

A reward function is ``fn(prompts: list, completions: list[str], **columns) -> list[float | None]``, called with
one entry per completion; dataset columns (e.g. ``answer``) arrive as keyword arguments. Config files name reward
functions by string; :func:`resolve_reward_function` turns a registered name (:data:`REWARD_FUNCTIONS`) or an
import path into the function.
"""

from __future__ import annotations

from lightning_grpo.rewards.format import gsm8k_format
from lightning_grpo.rewards.gsm8k import extract_answer, gold_answer, gsm8k_accuracy, make_gsm8k_accuracy
from lightning_grpo.rewards.math import make_math_accuracy, math_accuracy
from lightning_grpo.rewards.registry import REWARD_FUNCTIONS, resolve_reward_function
from lightning_grpo.rewards.reward_set import RewardSet, RewardSpec
from lightning_grpo.rewards.scoring import RewardScores, reward_function_names, score_completions

__all__ = [
    "REWARD_FUNCTIONS",
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
