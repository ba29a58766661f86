"""The reward pool: pooled rewards give the same values at every width (and without a pool) as the plain function,
their calls really run concurrently (a barrier that only opens when ``width`` calls wait at once), errors name the
function and the rows, outcomes are counted, and every function's time is reported."""

from __future__ import annotations

import threading

import pytest
import torch

from lightning_grpo.rewards import PooledReward, RewardChunk, RewardPool, RewardSet, pooled, score_completions
from lightning_grpo.rewards.scoring import start_pooled

N, G = 12, 4
PROMPTS = [f"p{i // G}" for i in range(N)]
COMPLETIONS = [f"completion number {i} " + "x" * (i * 7 % 5) for i in range(N)]
COLUMNS = {"answer": [str(i % 3) for i in range(N)]}


def length_reward(prompts, completions, answer, **kwargs):
    return [len(c) / 10 + int(a) for c, a in zip(completions, answer, strict=True)]


def group_rank(prompts, completions, **kwargs):
    """A group-relative reward: the rank of each completion's length within its call (which must be one group)."""
    assert len(set(prompts)) == 1 and len(prompts) == G
    order = sorted(range(len(completions)), key=lambda i: (len(completions[i]), i))
    return [order.index(i) / (G - 1) for i in range(len(completions))]


@pytest.mark.parametrize("chunk_size", [1, 5, None])
def test_every_width_gives_the_plain_functions_rewards(chunk_size):
    expected = score_completions([length_reward], PROMPTS, COMPLETIONS, COLUMNS)
    for width in (1, 3, 8):
        scores = score_completions([pooled(length_reward, chunk_size)], PROMPTS, COMPLETIONS, COLUMNS,
                                   pool=RewardPool(width))
        torch.testing.assert_close(scores.per_function, expected.per_function, rtol=0, atol=0)
        assert scores.names == ["length_reward"]
    unpooled = score_completions([pooled(length_reward, chunk_size)], PROMPTS, COMPLETIONS, COLUMNS)
    torch.testing.assert_close(unpooled.rewards, expected.rewards, rtol=0, atol=0)


def test_group_chunks_are_the_groups():
    scores = score_completions([pooled(group_rank, "group"), length_reward], PROMPTS, COMPLETIONS, COLUMNS,
                               reward_weights=[2.0, 1.0], pool=RewardPool(3), group_size=G)
    ranks = [group_rank(PROMPTS[i:i + G], COMPLETIONS[i:i + G]) for i in range(0, N, G)]
    assert scores.per_function[:, 0].tolist() == pytest.approx([r for group in ranks for r in group])
    expected = 2 * scores.per_function[:, 0] + torch.tensor(length_reward(PROMPTS, COMPLETIONS, **COLUMNS))
    torch.testing.assert_close(scores.rewards, expected)
    with pytest.raises(ValueError, match="group size"):
        score_completions([pooled(group_rank, "group")], PROMPTS, COMPLETIONS, COLUMNS, pool=RewardPool(2))


class Barrier(PooledReward):
    """Each call waits at a barrier of ``parties``: it opens only when that many calls are inside at once."""

    chunk_size = 1
    outcomes = ("waited",)

    def __init__(self, parties: int, timeout: float = 30.0) -> None:
        super().__init__("barrier")
        self.barrier = threading.Barrier(parties, timeout=timeout)
        self.threads: set[str] = set()

    def score_chunk(self, prompts, completions, columns):
        self.threads.add(threading.current_thread().name)
        self.barrier.wait()
        return RewardChunk([1.0] * len(completions), {"waited": len(completions)})


def test_calls_run_width_at_a_time():
    reward = Barrier(parties=4)
    scores = score_completions([reward], PROMPTS[:8], COMPLETIONS[:8], {}, pool=RewardPool(4))
    assert scores.per_function[:, 0].tolist() == [1.0] * 8
    assert scores.outcomes == {"barrier/waited": 8.0}
    assert len(reward.threads) == 4 and all(t.startswith("lightning_grpo_reward") for t in reward.threads)
    with pytest.raises(RuntimeError, match="raised BrokenBarrierError on sample"):  # 3 threads never reach 4
        score_completions([Barrier(parties=4, timeout=1.0)], PROMPTS[:3], COMPLETIONS[:3], {}, pool=RewardPool(3))


def test_started_calls_run_while_the_plain_functions_run():
    """``start_pooled`` returns at once; the calls it started finish while this thread does other work."""
    gate = threading.Event()

    def waits_for_gate(prompts, completions, **kwargs):
        assert gate.wait(timeout=30), "the pooled call never saw the gate open"
        return [0.5] * len(completions)

    def opens_gate(prompts, completions, **kwargs):
        gate.set()  # runs on the scoring thread while the pooled calls are waiting in the pool
        return [1.0] * len(completions)

    funcs = [pooled(waits_for_gate), opens_gate]
    started = start_pooled(funcs, PROMPTS, COMPLETIONS, COLUMNS, RewardPool(4))
    scores = score_completions(funcs, PROMPTS, COMPLETIONS, COLUMNS, pool=None, started=started)
    assert scores.rewards.tolist() == [1.5] * N
    assert set(scores.seconds) == {"waits_for_gate", "opens_gate"}


def test_errors_name_the_function_and_the_rows():
    def fails_on_7(prompts, completions, **kwargs):
        if "number 7 " in completions[0]:
            raise KeyError("boom")
        return [0.0] * len(completions)

    with pytest.raises(RuntimeError, match="'fails_on_7' raised KeyError on sample 7"):
        score_completions([pooled(fails_on_7)], PROMPTS, COMPLETIONS, COLUMNS, pool=RewardPool(3))
    scores = score_completions([pooled(fails_on_7), length_reward], PROMPTS, COMPLETIONS, COLUMNS,
                               pool=RewardPool(3), tolerant={"fails_on_7"})
    assert scores.per_function[:, 0].isnan().all() and not scores.rewards.isnan().any()

    def wrong_length(prompts, completions, **kwargs):
        return [0.0]

    with pytest.raises(ValueError, match="returned 1 rewards for 6 completions"):
        score_completions([pooled(wrong_length, 6)], PROMPTS, COMPLETIONS, COLUMNS, pool=RewardPool(2))

    class Undeclared(PooledReward):
        def score_chunk(self, prompts, completions, columns):
            return RewardChunk([0.0] * len(completions), {"surprise": 1})

    with pytest.raises(ValueError, match="counted outcome 'surprise', which it does not declare"):
        score_completions([Undeclared("undeclared")], PROMPTS, COMPLETIONS, COLUMNS, pool=RewardPool(2))
    with pytest.raises(ValueError, match="chunk_size=0"):
        pooled(length_reward, 0)
    with pytest.raises(ValueError, match="width must be an integer >= 1"):
        RewardPool(0)


def test_reward_set_runs_pooled_functions_in_its_pool():
    rewards = RewardSet.from_specs([pooled(length_reward), "gsm8k_format"], pool_width=2)
    assert rewards.has_pooled and rewards.pool is not None and rewards.pool.width == 2
    scores = rewards.score(PROMPTS, COMPLETIONS, COLUMNS, group_size=G)
    assert scores.per_function[:, 0].tolist() == pytest.approx(length_reward(PROMPTS, COMPLETIONS, **COLUMNS))
    assert set(scores.seconds) == {"length_reward", "gsm8k_format"}
    rewards.close()
    assert not RewardSet.from_specs(["gsm8k_format"]).has_pooled
