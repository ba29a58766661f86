"""The reward of multi-turn episodes whose environment scores them (docs/multiturn.md)."""

from __future__ import annotations

from typing import Optional


def env_reward(prompts: list, completions: list[str], env_reward: list[Optional[float]], **kwargs) -> list:
    """The environment's reward of each episode (the ``env_reward`` column: the last non-None ``reward`` its steps
    returned); None (unscored) where the environment gave none."""
    return [None if r is None else float(r) for r in env_reward]
