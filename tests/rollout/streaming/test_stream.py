"""The streaming producer and the trainer's side of it (``RolloutStream``) on a scripted streaming engine, without a
trainer: each token's recorded version is the version that produced it; groups are taken in the order they finish;
the age bound drops (or sends again) exactly the groups over it, counted; dynamic sampling drops groups on arrival and
draws more prompts; a group whose engine is lost is sampled again, never lost or trained twice; a checkpoint of the
stream taken with groups in flight resumes training every prompt exactly once. Timing is fixed by the engine's gates
(events), never by sleeps."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from lightning_grpo.config import StreamingConfig
from lightning_grpo.protocols.collectives import Collectives
from lightning_grpo.protocols.rollout import RolloutInterrupted, StopFlag
from lightning_grpo.protocols.sampler import EncodedPrompts
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.rewards import RewardSet
from lightning_grpo.rollout.streaming import RolloutStream
from lightning_grpo.rollout.streaming.event_loop import EngineLoop
from lightning_grpo.rollout.streaming.group_scoring import GroupScorer
from lightning_grpo.rollout.streaming.scored_groups import ScoredGroup
from lightning_grpo.rollout.streaming.versions import newest_version_mask, version_metrics
from support.streaming import Gate, ScriptedStreamingEngine

G = 2
EOS = 2


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path):
    return AutoTokenizer.from_pretrained(tiny_llama_path)


def five_tokens(key: int, j: int) -> list[int]:
    """Completion j of group ``key``: 5 ids, the last EOS."""
    return [100 + key, 200 + j, 300, 400, EOS]


def chain(first: int = 4, after: int = 0, last: int = 8) -> dict[int, list[Gate]]:
    """Gates that make groups ``first``, ``first + 1``, ... finish one after the other, the first after group
    ``after``."""
    return {k: [Gate(at=0, after=after if k == first else k - 1)] for k in range(first, last)}


def alternating(prompts, completions, **columns):
    return [float(i % 2) for i in range(len(completions))]


def encode(prompts):
    return EncodedPrompts.of([[5, 6, int(p.split()[-1])] for p in prompts])


class Data:
    """The data sampler's prompt batches ("prompt k", answer "a<k>"), counting the batches drawn."""

    def __init__(self, prompts: int = 8, per_batch: int = 2, answers=None) -> None:
        self.rows = [(f"prompt {k}", answers(k) if answers else f"a{k}") for k in range(prompts)]
        self.per_batch, self.drawn = per_batch, 0

    def draw(self):
        start = self.drawn * self.per_batch
        if start >= len(self.rows):
            return None
        self.drawn += 1
        rows = self.rows[start : start + self.per_batch]
        return {"prompt": [p for p, _ in rows], "answer": [a for _, a in rows]}


def make_stream(engine, tokenizer, reward=alternating, *, k: int = 8, on_stale: str = "drop", dynamic: bool = False,
                inflight: int = 4) -> RolloutStream:
    config = StreamingConfig(enabled=True, max_inflight_groups=inflight, max_off_policy_steps=k, on_stale=on_stale)
    scorer = GroupScorer(RewardSet.from_specs([reward]), tokenizer, 0, dynamic)
    stream = RolloutStream(engine, EngineLoop(), config, scorer, encode, SamplingConfig(max_new_tokens=8), G, 2, 1,
                           StopFlag(), seed=100)
    engine.update_weights(None, 0)
    stream.open()
    return stream


def versions_of(group: ScoredGroup) -> list[list[int]]:
    return group.scored.rollout.completion_versions.tolist()


def test_recorded_versions_are_the_versions_that_produced_each_token(tokenizer):
    """Group 0 samples two tokens, waits for the weights of version 1 (an update in flight) and samples the rest
    under them; the others finish at once, in the order they started. The first take gets the first two finished
    (1, 2), the second 3 and 0; every recorded version is the engine's, and the staleness metrics of the second
    rollout are their golden values."""
    engine = ScriptedStreamingEngine(five_tokens, EOS, gates={0: [Gate(at=2, version=1)], **chain()})
    stream, data = make_stream(engine, tokenizer), Data()
    try:
        first = stream.take(2, 0, data.draw)
        assert first.prompt_keys == [1, 2] and first.version == 0
        engine.update_weights(None, 1)  # the optimizer step's weights, in flight
        stream.purge(1)
        stream.commit()
        second = stream.take(2, 1, data.draw)
        stream.commit()
    finally:
        stream.close()
    assert second.prompt_keys == [3, 0]
    for group in first.groups + second.groups:
        assert versions_of(group) == [engine.sampled[(group.key, 1)]] * G  # the engine's, token by token
    assert versions_of(second.groups[1]) == [[0, 0, 1, 1, 1]] * G  # the sample that spans the update
    assert second.groups[1].oldest_version == 0 and second.groups[1].newest_version == 1
    rollout = second.groups[0].scored.rollout
    assert rollout.completion_mask.tolist() == [[1] * 5] * G and rollout.truncated.tolist() == [False] * G
    assert rollout.sampler_logprobs[0].tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5])
    assert [(key, seed) for key, _, seed in engine.requests][:4] == [(0, 100), (1, 102), (2, 104), (3, 106)]
    versions = torch.cat([versions_of_tensor(g) for g in second.groups])
    metrics = version_metrics(versions, versions >= 0, 1, Collectives())
    # ages: group 3: 10 tokens of age 1; group 0: per completion [1, 1, 0, 0, 0]
    assert metrics["streaming/token_staleness/mean"] == pytest.approx(14 / 20)
    assert metrics["streaming/token_staleness/max"] == 1.0 and metrics["streaming/token_staleness/p90"] == 1.0
    assert metrics["streaming/sample_staleness/mean"] == 1.0 and metrics["streaming/sample_staleness/max"] == 1.0
    assert metrics["streaming/partial_ratio"] == 0.5 and metrics["streaming/max_partial_span"] == 1.0
    assert metrics["rollout/staleness_mean"] == pytest.approx(0.7) and metrics["rollout/staleness_max"] == 1.0
    assert stream.trained == [1, 2, 3, 0]


def versions_of_tensor(group: ScoredGroup) -> torch.Tensor:
    return group.scored.rollout.completion_versions


def test_version_metrics_and_newest_version_mask_golden():
    versions = torch.tensor([[3, 3, 4], [5, 5, -1]])
    metrics = version_metrics(versions, torch.ones_like(versions), 5, Collectives())
    assert metrics["streaming/token_staleness/mean"] == 1.0 and metrics["streaming/token_staleness/max"] == 2.0
    assert metrics["streaming/token_staleness/p90"] == 2.0  # quantile of [0, 0, 1, 2, 2]
    assert metrics["streaming/sample_staleness/mean"] == 1.0 and metrics["streaming/sample_staleness/max"] == 2.0
    assert metrics["streaming/partial_ratio"] == 0.5 and metrics["streaming/max_partial_span"] == 1.0
    mask = newest_version_mask(torch.tensor([[3, 3, 4, -1], [5, 5, 5, 5]]), torch.ones(2, 4, dtype=torch.long))
    assert mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]


@pytest.mark.parametrize("on_stale", ["drop", "regenerate"])
def test_the_age_bound_drops_exactly_the_groups_over_it(tokenizer, on_stale):
    """``max_off_policy_steps=0``: after the update to version 1, group 3 (sampled by version 0) and group 0 (its
    first tokens by version 0) are over the bound, counted; "drop" never trains them, "regenerate" samples them again
    from version 1 and trains them then. Groups 1 and 2 (age 0 when taken) are trained."""
    engine = ScriptedStreamingEngine(five_tokens, EOS, gates={0: [Gate(at=2, version=1)], **chain()})
    stream, data = make_stream(engine, tokenizer, k=0, on_stale=on_stale), Data()
    try:
        assert stream.take(2, 0, data.draw).prompt_keys == [1, 2]
        stream.commit()
        engine.update_weights(None, 1)
        stream.purge(1)
        taken, stale = [], 0
        while (next_groups := stream.take(2, 1, data.draw)) is not None:
            taken += next_groups.prompt_keys
            stale += next_groups.counts.stale
            assert all(g.oldest_version == 1 for g in next_groups.groups)  # nothing over the bound is trained
            stream.commit()
    finally:
        stream.close()
    assert stale == 2
    if on_stale == "drop":
        assert stream.dropped == [3, 0] and sorted(taken) == [4, 5, 6, 7]
    else:
        assert stream.dropped == [] and sorted(taken) == [0, 3, 4, 5, 6, 7]
        assert engine.sampled[(3, 2)] == [1] * 5 and engine.sampled[(0, 2)] == [1] * 5  # sent again, fresh
    assert sorted(stream.trained) == sorted([1, 2, *taken])


def test_dynamic_sampling_drops_groups_on_arrival_and_draws_more_prompts(tokenizer):
    """The primary reward is the group's answer's digit: constant for prompts 1, 2 and 5, so those groups are dropped
    as they arrive, counted, and the stream draws more prompts until every rollout has informative groups."""

    def by_answer(prompts, completions, answer, **columns):
        return [1.0 if a in ("a1", "a2", "a5") else float(i % 2) for i, a in enumerate(answer)]

    engine = ScriptedStreamingEngine(five_tokens, EOS, gates={k + 1: [Gate(at=0, after=k)] for k in range(7)})
    stream, data = make_stream(engine, tokenizer, by_answer, dynamic=True), Data()
    taken, uninformative = [], 0
    try:
        while (groups := stream.take(2, 0, data.draw)) is not None:
            taken.append(groups.prompt_keys)
            uninformative += groups.counts.uninformative
            stream.commit()
    finally:
        stream.close()
    assert taken == [[0, 3], [4, 6]]  # in the order they finished, the dropped ones skipped
    assert uninformative == 3 and stream.dropped == [1, 2, 5]
    assert data.drawn == 4  # more prompts were drawn for the dropped groups
    stream.end_epoch()  # group 7 finished alone: too few for a rollout
    assert stream.first_key == 8 and stream.trained == []


def test_a_group_whose_engine_is_lost_is_sampled_again_never_lost_or_twice(tokenizer):
    engine = ScriptedStreamingEngine(five_tokens, EOS, gates={1: [Gate(at=2, lose=1)]})
    stream, data = make_stream(engine, tokenizer), Data()
    taken, resampled = [], 0
    try:
        while (groups := stream.take(2, 0, data.draw)) is not None:
            taken += groups.prompt_keys
            resampled += groups.counts.resampled
            stream.commit()
    finally:
        stream.close()
    assert engine.lost == [(1, 1)] and resampled == 1
    assert sorted(taken) == list(range(8)) and sorted(stream.trained) == list(range(8))
    assert sorted(key for key, attempt, _ in engine.requests if key == 1) == [1, 1]  # two requests of group 1
    assert engine.sampled[(1, 2)] == [0] * 5


def test_a_checkpoint_with_groups_in_flight_resumes_every_prompt_exactly_once(tokenizer):
    """The stream's state after one rollout: group 0 in flight (waiting for an update that never comes before the
    "kill"), group 3 finished; a new stream loads it, finds the prompts to sample again as the same batches are drawn
    again, and the two runs together train each of the 8 prompts once."""
    engine = ScriptedStreamingEngine(five_tokens, EOS, gates={0: [Gate(at=2, version=1)], **chain()})
    stream, data = make_stream(engine, tokenizer), Data()
    try:
        assert stream.take(2, 0, data.draw).prompt_keys == [1, 2]
        stream.commit()
        with stream.buffer.cond:  # group 3 finishes (an event the producer signals), group 0 waits for version 1
            assert stream.buffer.cond.wait_for(lambda: len(stream.buffer.ready) == 1, timeout=60)
        state = stream.state_dict()
    finally:
        stream.close()
    assert state["trained"] == [1, 2] and state["dropped"] == [] and state["prompts_drawn"] == 2 * data.drawn
    assert [g["item"]["key"] for g in state["ready"]] == [3]
    assert state["regenerate"] == sorted(set(range(state["prompts_drawn"])) - {1, 2, 3})  # 0 and any drawn after
    restarted = ScriptedStreamingEngine(five_tokens, EOS)
    resumed, again = make_stream(restarted, tokenizer), Data()
    try:
        resumed.load_state_dict(torch.load(_saved(state), weights_only=True))
        for _ in range(data.drawn):
            resumed.replay(again.draw())
        resumed.check_replayed()
        taken = []
        while (groups := resumed.take(2, 0, again.draw)) is not None:
            taken += groups.prompt_keys
            resumed.commit()
    finally:
        resumed.close()
    assert taken[0] == 3  # the finished group first, then group 0 sampled again and the rest
    assert sorted([1, 2, *taken]) == list(range(8)) and sorted(resumed.trained) == list(range(8))
    assert [key for key, _, _ in restarted.requests][0] == 0  # sampled again before the new prompts


def _saved(state: dict):
    """``state`` through ``torch.save`` / ``torch.load(weights_only=True)``, as a checkpoint keeps it."""
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def test_the_end_of_the_data_and_the_producers_errors_reach_the_trainer(tokenizer):
    def broken(prompts, completions, **columns):
        raise ZeroDivisionError("bad reward")

    engine = ScriptedStreamingEngine(five_tokens, EOS)
    stream = make_stream(engine, tokenizer, broken)
    try:
        with pytest.raises(RuntimeError, match="reward function 'broken' raised ZeroDivisionError"):
            stream.take(2, 0, Data().draw)
    finally:
        stream.close()
    stopped = make_stream(ScriptedStreamingEngine(five_tokens, EOS, gates={0: [Gate(at=0, version=5)]}), tokenizer)
    stopped.stop.set()
    try:
        with pytest.raises(RolloutInterrupted):
            stopped.take(2, 0, Data().draw)
    finally:
        stopped.close()
    short = make_stream(ScriptedStreamingEngine(five_tokens, EOS), tokenizer)
    data = Data(prompts=3)
    try:
        assert short.take(2, 0, data.draw).prompt_keys == [0, 1]
        short.commit()
        assert short.take(2, 0, data.draw) is None  # one prompt left: no rollout
    finally:
        short.close()
    short.end_epoch()
    assert short.first_key == 3
