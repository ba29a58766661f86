"""score_completions: weighting, None handling, names, and the error contract."""

import functools
import logging
import math
import os
import time

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lightning_grpo.rewards import gsm8k_accuracy, gsm8k_format, reward_function_names, score_completions  # noqa: E402

PROMPTS = ["p0", "p1", "p2"]
COMPLETIONS = ["a", "bb", "ccc"]


def first(prompts, completions, **kwargs):
    return [1.0, 0.0, None]


def second(prompts, completions, **kwargs):
    return [2.0, None, None]


def length(prompts, completions, scale=1.0, **kwargs):
    return [scale * len(c) for c in completions]


class LengthReward:
    def __call__(self, prompts, completions, **kwargs):
        return [float(len(c)) for c in completions]


def test_weighted_sum_ignores_none_and_all_none_is_nan():
    scores = score_completions([first, second], PROMPTS, COMPLETIONS, {}, reward_weights=[1.0, 0.5])
    nan = math.nan
    torch.testing.assert_close(
        scores.per_function, torch.tensor([[1.0, 2.0], [0.0, nan], [nan, nan]]), equal_nan=True
    )
    # Row 0: 1*1 + 0.5*2 = 2; row 1: 1*0 (second is None) = 0; row 2: every function is None -> NaN.
    torch.testing.assert_close(scores.rewards, torch.tensor([2.0, 0.0, nan]), equal_nan=True)
    assert scores.rewards.dtype == scores.per_function.dtype == torch.float32
    assert scores.names == ["first", "second"]


def test_default_weights_are_one_and_columns_are_passed():
    def needs_answer(prompts, completions, answer, **kwargs):
        return [float(a) for a in answer]

    scores = score_completions([needs_answer, length], PROMPTS, COMPLETIONS, {"answer": ["1", "2", "3"]})
    torch.testing.assert_close(scores.rewards, torch.tensor([2.0, 4.0, 6.0]))


def test_real_rewards_match_direct_calls():
    completions = ["x\n#### 72", "the answer is 72", "#### 70", "nothing"]
    columns = {"answer": ["72"] * 4, "question": ["q"] * 4}
    scores = score_completions([gsm8k_accuracy, gsm8k_format], [None] * 4, completions, columns, [1.0, 0.25])
    accuracy = gsm8k_accuracy([None] * 4, completions, **columns)
    fmt = gsm8k_format([None] * 4, completions, **columns)
    assert accuracy == [1.0, 1.0, 0.0, 0.0] and fmt == [1.0, 0.0, 1.0, 0.0]
    torch.testing.assert_close(scores.per_function, torch.tensor([accuracy, fmt]).T)
    torch.testing.assert_close(scores.rewards, torch.tensor([1.25, 1.0, 0.25, 0.0]))
    assert scores.names == ["gsm8k_accuracy", "gsm8k_format"]


def test_names():
    half = functools.partial(functools.partial(length, scale=0.5))
    funcs = [length, half, LengthReward(), length, lambda p, c, **k: [0.0] * len(c)]
    assert reward_function_names(funcs) == ["length", "length_1", "LengthReward", "length_2", "<lambda>"]
    scores = score_completions(funcs[:3], PROMPTS, COMPLETIONS, {})
    torch.testing.assert_close(scores.per_function[:, 1], torch.tensor([0.5, 1.0, 1.5]))
    torch.testing.assert_close(scores.rewards, torch.tensor([2.5, 5.0, 7.5]))


def test_wrong_length_names_function_and_lengths():
    def short(prompts, completions, **kwargs):
        return [1.0, 1.0]

    with pytest.raises(ValueError, match=r"reward function 'short' returned 2 rewards for 3 completions"):
        score_completions([short], PROMPTS, COMPLETIONS, {})


def test_tensor_and_bool_values_are_accepted():
    def as_tensor(prompts, completions, **kwargs):
        return torch.tensor([0.5, 1.5, 2.5], dtype=torch.float64)

    def as_bool(prompts, completions, **kwargs):
        return [True, False, True]

    scores = score_completions([as_tensor, as_bool], PROMPTS, COMPLETIONS, {})
    torch.testing.assert_close(scores.rewards, torch.tensor([1.5, 1.5, 3.5]))


def test_raising_function_names_the_failing_sample():
    def boom(prompts, completions, **kwargs):
        return [1.0 / (len(c) - 2) for c in completions]  # "bb" (index 1) divides by zero

    with pytest.raises(RuntimeError, match=r"reward function 'boom' raised ZeroDivisionError on sample 1") as info:
        score_completions([boom], PROMPTS, COMPLETIONS, {})
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_raising_function_without_single_sample_cause():
    def batch_only(prompts, completions, **kwargs):
        if len(completions) > 1:
            raise KeyError("batch")
        return [0.0]

    with pytest.raises(RuntimeError, match=r"'batch_only' raised KeyError \(no single sample reproduces it\)"):
        score_completions([batch_only], PROMPTS, COMPLETIONS, {})


def test_tolerant_function_becomes_nan_with_warning(caplog):
    def flaky(prompts, completions, **kwargs):
        raise OSError("judge unreachable")

    with caplog.at_level(logging.WARNING, logger="lightning_grpo.rewards.scoring"):
        scores = score_completions([length, flaky], PROMPTS, COMPLETIONS, {}, tolerant={"flaky"})
    assert torch.isnan(scores.per_function[:, 1]).all()
    torch.testing.assert_close(scores.rewards, torch.tensor([1.0, 2.0, 3.0]))
    assert "'flaky' raised OSError on sample 0: judge unreachable" in caplog.text
    assert "(tolerant)" in caplog.text


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_non_finite_value_names_function_and_index(bad):
    def spiky(prompts, completions, **kwargs):
        return [0.0, 1.0, bad]

    with pytest.raises(ValueError, match=r"reward function 'spiky' returned non-finite .* at index 2"):
        score_completions([spiky], PROMPTS, COMPLETIONS, {})


def test_non_number_value():
    def texty(prompts, completions, **kwargs):
        return [0.0, "yes", 1.0]

    with pytest.raises(ValueError, match=r"reward function 'texty' returned 'yes' at index 1, not a number"):
        score_completions([texty], PROMPTS, COMPLETIONS, {})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"reward_weights": [1.0]}, r"reward_weights=\[1.0\] must be 2 finite numbers"),
        ({"reward_weights": [1.0, math.inf]}, r"reward_weights=\[1.0, inf\] must be 2 finite numbers"),
        ({"tolerant": ["lenght"]}, r"tolerant names \['lenght'\] are not reward functions"),
        ({"columns": {"answer": ["1"]}}, r"column 'answer' has 1 entries but there are 3 completions"),
        ({"columns": {"completions": COMPLETIONS}}, r"column 'completions' clashes"),
        ({"prompts": ["p0"]}, r"prompts has 1 entries but there are 3 completions"),
        ({"reward_funcs": []}, r"reward_funcs is empty"),
    ],
)
def test_argument_errors(kwargs, message):
    arguments = dict(reward_funcs=[length, first], prompts=PROMPTS, completions=COMPLETIONS, columns={}) | kwargs
    with pytest.raises(ValueError, match=message):
        score_completions(**arguments)


def test_busy_seconds_is_the_length_of_the_union_of_the_spans():
    from lightning_grpo.rewards.scoring import busy_seconds

    assert busy_seconds([]) == 0.0
    assert busy_seconds([(5.0, 6.0), (0.0, 2.0), (1.0, 3.0)]) == 4.0  # [0, 3] and [5, 6]; the gap 3..5 not counted
    assert busy_seconds([(0.0, 5.0), (1.0, 2.0)]) == 5.0  # a call inside another counts once
    assert busy_seconds([(0.0, 1.0), (1.0, 2.0), (2.0, 3.0)]) == 3.0  # back to back: the sum


def test_a_pooled_rewards_seconds_are_the_time_its_calls_ran_not_the_gaps(monkeypatch):
    """``timing/reward_<name>_s`` of a pooled function: its calls ran 0..2 and 1..3 (at once) and 5..6 (after
    waiting for a pool thread): 4 s, not the 6 s from the first call's start to the last call's end. A plain
    function that "sleeps" 2 s on a fake clock: 2 s."""
    from concurrent.futures import Future

    from lightning_grpo.rewards import RewardChunk, StartedScores, pooled
    from lightning_grpo.rewards.scoring import _Call

    clock = [10.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

    def slow(prompts, completions, **kwargs):
        clock[0] += 2.0
        return [1.0] * len(completions)

    ran = []
    for row, (began, ended) in enumerate([(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]):
        done: Future = Future()
        done.set_result(None)
        ran.append((_Call(row, row + 1, RewardChunk([0.5]), began=began, ended=ended), done))
    funcs = [slow, pooled(lambda p, c, **k: [0.5] * len(c), chunk_size=1, name="judge")]
    scores = score_completions(funcs, ["p"] * 3, ["a", "b", "c"], {}, started=StartedScores([1], [ran], 3))
    assert scores.seconds == {"slow": 2.0, "judge": 4.0}
    assert scores.per_function.tolist() == [[1.0, 0.5]] * 3
