"""pass@k, maj@k and mean@k (lightning_grpo.evaluation.evaluator): hand-worked values, brute force, ties, torchmetrics
use."""

import itertools
import math
import random

import pytest
import torch

from lightning_grpo.evaluation.evaluator import (
    MajAtK,
    MeanAtK,
    PassAtK,
    answer_key,
    majority_score,
    pass_at_k,
    same_answer,
)


@pytest.mark.parametrize("k, expected", [(1, 2 / 5), (2, 7 / 10), (3, 9 / 10), (4, 1.0), (5, 1.0)])
def test_pass_at_k_hand_worked_n5_c2(k, expected):
    # 1 - C(3, k) / C(5, k): C(3,1)/C(5,1) = 3/5, C(3,2)/C(5,2) = 3/10, C(3,3)/C(5,3) = 1/10, C(3,4) = C(3,5) = 0
    assert pass_at_k(5, 2, k) == pytest.approx(expected, abs=1e-12)
    assert pass_at_k(5, 2, k) == pytest.approx(1 - math.comb(3, k) / math.comb(5, k), abs=1e-12)


def test_pass_at_k_equals_brute_force_over_subsets():
    rng = random.Random(0)
    for _ in range(40):
        n = rng.randint(1, 9)
        correct = [rng.random() < 0.4 for _ in range(n)]
        k = rng.randint(1, n)
        subsets = list(itertools.combinations(correct, k))
        brute = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(n, sum(correct), k) == pytest.approx(brute, abs=1e-12)


def test_pass_at_k_rejects_bad_arguments():
    with pytest.raises(ValueError, match="n=3, c=1, k=4"):
        pass_at_k(3, 1, 4)
    with pytest.raises(ValueError, match="c=5"):
        pass_at_k(4, 5, 1)


def test_majority_score_with_ties_and_abstentions():
    assert majority_score(["7", "7", "8", None], [1.0, 1.0, 0.0, 0.0]) == 1.0
    assert majority_score(["7", "8", "8", "7"], [1.0, 0.0, 0.0, 1.0]) == 0.5  # tie 7 (right) vs 8 (wrong)
    assert majority_score(["1", "2", "3"], [0.0, 1.0, 0.0]) == pytest.approx(1 / 3)  # three-way tie
    assert majority_score([None, None], [1.0, 1.0]) == 0.0  # nobody voted
    assert majority_score(["5", "5", "6"], [0.0, 0.0, 1.0]) == 0.0  # the majority is wrong


def test_answer_key_reads_hashes_boxed_and_numbers():
    assert answer_key("so 3 + 4 = 7\n#### 7") == "7"
    assert answer_key("The answer is $1,000.") == "1000"
    assert answer_key("hence \\boxed{\\frac{\\pi}{2}}") == "\\frac{\\pi}{2}"
    assert answer_key("no idea") is None
    assert answer_key("\\boxed{2\\sqrt{2}}") == "2\\sqrt{2}"  # read whole, not 2
    assert answer_key("\\boxed{3 \\pi}") == "3\\pi"
    assert answer_key("\\boxed{\\frac{1}{2}}") == "0.5"


def test_maj_at_k_groups_answers_by_mathematical_equivalence():
    """2 sqrt 2 and sqrt 8 are one answer (3 votes with 2\\sqrt 2) and beat 2 (2 votes); by a leading number all
    five would have voted "2" and scored 3/5."""
    completions = ["\\boxed{2\\sqrt{2}}", "\\boxed{\\sqrt{8}}", "\\boxed{2}", "\\boxed{2.0}", "\\boxed{2\\sqrt 2}"]
    answers = [answer_key(c) for c in completions]
    assert answers == ["2\\sqrt{2}", "\\sqrt{8}", "2", "2", "2\\sqrt2"]
    assert majority_score(answers, [1.0, 1.0, 0.0, 0.0, 1.0]) == 1.0
    assert same_answer("0.5", "\\frac{1}{2}") and same_answer("\\sqrt{8}", "2\\sqrt{2}")
    assert not same_answer("0.33", "1/3") and not same_answer("2", "2\\sqrt{2}")
    assert majority_score(["1/3", "0.33", "0.33"], [1.0, 0.0, 0.0]) == 0.0  # numbers: exact values


def test_metrics_accumulate_over_batches():
    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    p1, p2 = PassAtK(1), PassAtK(2)
    for metric in (p1, p2):
        metric.update(rewards[:1])
        metric.update(rewards[1:])
    assert p1.compute().item() == pytest.approx((0.4 + 0.0) / 2)
    assert p2.compute().item() == pytest.approx((0.7 + 0.0) / 2)
    maj = MajAtK()
    maj.update(rewards[:, :4], [["3", "4", "3", "4"], ["1", "1", "1", "2"]])
    assert maj.compute().item() == pytest.approx((0.5 + 0.0) / 2)
    mean = MeanAtK()
    mean.update(torch.tensor([[1.0, float("nan"), 0.5, 0.5]]))
    assert mean.compute().item() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="n >= k=3"):
        PassAtK(3).update(rewards[:, :2])
    assert math.isnan(PassAtK(1).compute().item())
