"""The metrics and reward-function columns of multi-turn episodes (docs/multiturn.md, "Metrics")."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from lightning_grpo.protocols.episode import EpisodeRecord

#: Rates over tool calls that are 0, not NaN, when no call was made (as TRL's ``tools/failure_frequency``).
NO_CALLS_ZERO = ("tools/error_rate", "tools/timeout_rate")
#: The columns the reward functions get from the episodes (besides the dataset's).
EPISODE_COLUMNS = ("transcript", "env_reward")


def episode_columns(records: Sequence[EpisodeRecord], dataset_columns: Sequence[str] = ()) -> dict[str, list[Any]]:
    """``transcript`` (each episode's messages after the prompt, :attr:`EpisodeRecord.messages`) and ``env_reward``
    (the environment's reward, or None) for the reward functions.

    Raises:
        ValueError: the dataset already has a column of one of these names.
    """
    clash = sorted(set(EPISODE_COLUMNS) & set(dataset_columns))
    if clash:
        raise ValueError(f"the dataset has column(s) {clash}, which multi-turn episodes fill for the reward functions: "
                         "rename them")
    return {"transcript": [r.messages for r in records], "env_reward": [r.env_reward for r in records]}


def episode_metrics(records: Sequence[EpisodeRecord], completion_mask: Tensor,
                    env_mask: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
    """This process's multi-turn metrics as ``name -> (sum, count)`` (the rollout metrics reduce them over the
    processes: the mean is ``sum / count``).

    Args:
        records: the episodes of the rollout trained on.
        completion_mask, env_mask: their ``(N, T)`` model-token and environment-token masks.

    Returns:
        ``turns/mean`` (model turns per episode), ``tools/calls_per_episode``, ``tools/error_rate`` (failed calls /
        calls; the experience maker logs 0 when no call was made), ``tools/timeout_rate`` (timed-out calls /
        calls), ``tokens/env_fraction`` (environment tokens / all tokens after the prompts),
        ``episodes/budget_exceeded`` (the fraction of episodes an observation that did not fit the token budget
        ended) and ``episodes/done`` (the fraction the environment ended, e.g. with a final answer). ``turns/max``
        is :func:`max_turns` (a max over processes).
    """
    n = float(len(records))

    def total(values: list[float]) -> Tensor:
        return torch.tensor(float(sum(values)), dtype=torch.float64)

    calls = total([r.tool_calls for r in records])
    env_tokens = env_mask.sum().double().cpu()
    all_tokens = env_tokens + completion_mask.sum().double().cpu()
    count = torch.tensor(n, dtype=torch.float64)
    return {
        "turns/mean": (total([r.model_turns for r in records]), count),
        "tools/calls_per_episode": (calls, count),
        "tools/error_rate": (total([r.tool_errors for r in records]), calls),
        "tools/timeout_rate": (total([r.tool_timeouts for r in records]), calls),
        "tokens/env_fraction": (env_tokens, all_tokens),
        "episodes/budget_exceeded": (total([r.budget_exceeded for r in records]), count),
        "episodes/done": (total([r.done for r in records]), count),
    }


def max_turns(records: Sequence[EpisodeRecord]) -> Tensor:
    """``(1,)`` float64, the most model turns of an episode on this process (reduce with the max for ``turns/max``)."""
    return torch.tensor([float(max((r.model_turns for r in records), default=0))], dtype=torch.float64)
