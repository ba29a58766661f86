"""What the generation rounds of one rollout collected, row by row: each completion's prompt, text, reward columns and
episode record, and the sampler's per-row metrics (:class:`RolloutRows`), found again by ``row_index`` once dynamic
sampling has chosen the rows to train on; and the reward functions' columns of a rollout (:func:`reward_columns`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from lightning_grpo.protocols.episode import EpisodeRecord
from lightning_grpo.protocols.rollout import RolloutOutput, RowMetric


def reward_columns(columns: dict[str, list], out: RolloutOutput) -> dict[str, list]:
    """The columns the reward functions get for ``out``'s completions: the dataset's (each repeated G times), then
    those the sampler adds (``out.columns``; multi-turn: ``transcript``, ``env_reward``).

    Raises:
        ValueError: the dataset has a column the sampler fills (named).
    """
    clash = sorted(set(out.columns) & set(columns))
    if clash:
        raise ValueError(f"the dataset has column(s) {clash}, which the rollout's sampler fills for the reward "
                         f"functions (multi-turn episodes: transcript, env_reward): rename them")
    return {**columns, **out.columns}


@dataclass
class Row:
    """One generated row: its prompt, completion text, reward columns and episode record (single-turn: one turn)."""

    prompt: Any
    completion: str
    columns: dict[str, Any]
    episode: EpisodeRecord


class RolloutRows:
    """Every row one rollout's generation rounds produced, in order (a row's position is its ``row_index``)."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self._metrics: list[dict[str, RowMetric]] = []  # each round's sampler metrics

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, prompts: Sequence[Any], columns: dict[str, list], out: RolloutOutput) -> Tensor:
        """Append one round's rows (``prompts`` and ``columns`` one entry per completion of ``out``); returns their
        ``(N,)`` long ``row_index``."""
        offset = len(self.rows)
        self.rows.extend(Row(p, c, {k: v[i] for k, v in columns.items()}, out.episodes[i])
                         for i, (p, c) in enumerate(zip(prompts, out.completions, strict=True)))
        self._metrics.append(out.metrics)
        return torch.arange(offset, len(self.rows))

    def select(self, index: Optional[Tensor]) -> list[Row]:
        """The rows at ``index`` (``(M,)`` long ``row_index``; None: none)."""
        return [] if index is None else [self.rows[i] for i in index.tolist()]

    def episodes(self, index: Optional[Tensor]) -> Optional[list[EpisodeRecord]]:
        """The episode records of the rows at ``index`` (what the rollout event carries); None for a single-turn
        rollout, whose rows are one-turn episodes (``EpisodeRecord.single_turn``: the event and the completion table
        show plain completions)."""
        records = [row.episode for row in self.select(index)]
        return records if any(not r.single_turn for r in records) else None

    def metrics(self, index: Optional[Tensor]) -> dict[str, RowMetric]:
        """The sampler's per-row metrics (``RolloutOutput.metrics`` of every round) of the rows at ``index``."""
        if index is None or not self._metrics:
            return {}
        return {name: RowMetric.cat([m[name] for m in self._metrics]).select(index) for name in self._metrics[0]}
