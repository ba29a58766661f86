"""RolloutRows and reward_columns on their own: rows of several generation rounds found again by row index, with the
sampler's episode records, reward columns and per-row metrics; the clash of a dataset column with a sampler's."""

import math

import pytest
import torch

from lightning_grpo.experience.collected import RolloutRows, reward_columns
from lightning_grpo.protocols.episode import EpisodeRecord
from lightning_grpo.protocols.rollout import RolloutOutput, RowMetric


def _output(texts, episodes=None, metrics=None, columns=None):
    n = len(texts)
    ones = torch.ones(n, 2, dtype=torch.long)
    return RolloutOutput(ones, ones, ones, ones, torch.zeros(n, dtype=torch.bool), list(texts), episodes=episodes,
                         metrics=metrics or {}, columns=columns or {})


def test_rows_of_two_rounds_are_found_by_row_index_with_their_metrics():
    rows = RolloutRows()
    first = _output(["a", "b"], [EpisodeRecord(model_turns=1), EpisodeRecord(model_turns=2)],
                    {"turns": RowMetric(torch.tensor([1.0, 2.0], dtype=torch.float64))})
    second = _output(["c", "d"], [EpisodeRecord(model_turns=3), EpisodeRecord(model_turns=4)],
                     {"turns": RowMetric(torch.tensor([3.0, 4.0], dtype=torch.float64),
                                         torch.tensor([1.0, 2.0], dtype=torch.float64))})
    assert rows.add(["p", "q"], {"answer": ["1", "2"]}, first).tolist() == [0, 1]
    assert rows.add(["r", "s"], {"answer": ["3", "4"]}, second).tolist() == [2, 3]
    kept = torch.tensor([3, 0])
    assert [(r.prompt, r.completion, r.columns) for r in rows.select(kept)] == [("s", "d", {"answer": "4"}),
                                                                              ("p", "a", {"answer": "1"})]
    assert [e.model_turns for e in rows.episodes(kept)] == [4, 1]
    turns = rows.metrics(kept)["turns"]
    assert turns.values.tolist() == [4.0, 1.0] and turns.weights().tolist() == [2.0, 1.0]  # a round without counts: 1


def test_single_turn_rows_are_one_turn_episodes_the_event_leaves_out_and_have_no_metrics():
    """A single-turn rollout's rows are one-turn episodes (its one model turn: the 2 completion tokens, its text);
    the rollout event carries no episodes for them, as before every row had one."""
    rows = RolloutRows()
    index = rows.add(["p"], {}, _output(["a"]))
    (row,) = rows.select(index)
    assert row.episode == EpisodeRecord.one_turn("a", 2, truncated=False) and row.episode.single_turn
    assert row.episode.turns[0].messages == [{"role": "assistant", "content": "a"}] and row.episode.done
    assert rows.episodes(index) is None and rows.metrics(index) == {} and len(rows) == 1


def test_reward_columns_add_the_samplers_and_refuse_a_clash():
    out = _output(["a"], columns={"transcript": [["t"]], "env_reward": [None]})
    assert reward_columns({"answer": ["1"]}, out) == {"answer": ["1"], "transcript": [["t"]], "env_reward": [None]}
    with pytest.raises(ValueError, match=r"column\(s\) \['env_reward', 'transcript'\], which the rollout's sampler"):
        reward_columns({"transcript": ["mine"], "env_reward": [1.0]}, out)


def test_a_row_metric_checks_its_shapes_and_reduction():
    with pytest.raises(ValueError, match=r"RowMetric.values must be \(N,\)"):
        RowMetric(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="one count per row"):
        RowMetric(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match="RowMetric.reduce='sum' is invalid"):
        RowMetric(torch.zeros(2), reduce="sum")  # type: ignore[arg-type]
    assert math.isnan(RowMetric(torch.zeros(1)).empty)
