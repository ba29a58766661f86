"""The metrics and reward-function columns of multi-turn episodes (docs/multiturn.md, "Metrics"), which the turn
loop puts on its :class:`~lightning_grpo.protocols.rollout.RolloutOutput` (``metrics``, ``columns``)."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor

from lightning_grpo.protocols.episode import EpisodeRecord
from lightning_grpo.protocols.rollout import RowMetric

#: The columns the reward functions get from the episodes (besides the dataset's).
EPISODE_COLUMNS = ("transcript", "env_reward")


def episode_columns(records: Sequence[EpisodeRecord]) -> dict[str, list[Any]]:
    """``transcript`` (each episode's messages after the prompt, :attr:`EpisodeRecord.messages`) and ``env_reward``
    (the environment's reward, or None) for the reward functions (:data:`EPISODE_COLUMNS`)."""
    return {"transcript": [r.messages for r in records], "env_reward": [r.env_reward for r in records]}


def episode_metrics(records: Sequence[EpisodeRecord], completion_mask: Tensor,
                    env_mask: Tensor) -> dict[str, RowMetric]:
    """Each episode's share of the multi-turn metrics (the experience maker logs them over the rows trained on, all
    processes: a mean is the sum of the rows' values over the sum of their counts).

    Args:
        records: the episodes of a rollout, one per row.
        completion_mask, env_mask: their ``(N, T)`` model-token and environment-token masks.

    Returns:
        ``turns/mean`` and ``turns/max`` (model turns per episode), ``tools/calls_per_episode``,
        ``tools/error_rate`` (failed calls / calls; 0 when no call was made, as TRL's ``tools/failure_frequency``),
        ``tools/timeout_rate`` (timed-out calls / calls; 0 likewise), ``tokens/env_fraction`` (environment tokens /
        all tokens after the prompts), ``episodes/budget_exceeded`` (the fraction of episodes an observation that did
        not fit the token budget ended) and ``episodes/done`` (the fraction the environment ended, e.g. with a final
        answer).
    """

    def per_row(values: Sequence[float]) -> Tensor:
        return torch.tensor([float(v) for v in values], dtype=torch.float64)

    turns = per_row([r.model_turns for r in records])
    calls = per_row([r.tool_calls for r in records])
    env_tokens = env_mask.sum(dim=1).double().cpu()
    all_tokens = env_tokens + completion_mask.sum(dim=1).double().cpu()
    return {
        "turns/mean": RowMetric(turns),
        "turns/max": RowMetric(turns, reduce="max"),
        "tools/calls_per_episode": RowMetric(calls),
        "tools/error_rate": RowMetric(per_row([r.tool_errors for r in records]), calls, empty=0.0),
        "tools/timeout_rate": RowMetric(per_row([r.tool_timeouts for r in records]), calls, empty=0.0),
        "tokens/env_fraction": RowMetric(env_tokens, all_tokens),
        "episodes/budget_exceeded": RowMetric(per_row([r.budget_exceeded for r in records])),
        "episodes/done": RowMetric(per_row([r.done for r in records])),
    }
