"""Reward functions: GSM8K extraction/accuracy, GSM8K format, MATH accuracy (math-verify), and name resolution."""

import json
import os
import threading
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lightning_grpo.rewards import (  # noqa: E402
    REWARD_FUNCTIONS,
    RewardSet,
    extract_answer,
    gold_answer,
    gsm8k_accuracy,
    gsm8k_format,
    make_gsm8k_accuracy,
    math_accuracy,
    resolve_reward_function,
)

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def _rows(path: Path, n: int) -> list[dict]:
    if not path.exists():
        pytest.skip(f"dataset file {path} is absent (the shared data folder is not mounted next to the repo)")
    with path.open() as f:
        return [json.loads(next(f)) for _ in range(n)]


def _acc(completion: str, gold: str, fn=gsm8k_accuracy) -> float:
    return fn([None], [completion], answer=[gold])[0]


# ---------------------------------------------------------------- GSM8K accuracy


@pytest.mark.parametrize(
    "completion, gold",
    [
        ("so in total\n#### 1,000", "1000"),
        ("#### $18", "18"),
        ("#### 72.", "72"),
        ("#### 5.0", "5"),
        ("#### -3", "-3"),
        ("Therefore \\boxed{42}", "42"),
        ("The answer is 7.", "7"),
        ("#### 1000", "She has 10 * 100 = <<10*100=1000>>1000\n#### 1,000"),  # full GSM8K answer as gold
    ],
)
def test_gsm8k_accuracy_golden_correct(completion, gold):
    assert _acc(completion, gold) == 1.0


@pytest.mark.parametrize(
    "completion, gold",
    [("#### 71", "72"), ("#### 7.5", "7"), ("I cannot tell.", "7"), ("", "7"), ("#### 3", "-3")],
)
def test_gsm8k_accuracy_golden_wrong_or_missing(completion, gold):
    assert _acc(completion, gold) == 0.0


@pytest.mark.parametrize(
    "text, expected",
    [
        ("#### 12\nlater #### 13", "13"),  # last ####
        ("\\boxed{5} then #### 6", "6"),  # #### beats \boxed
        ("The answer is 4. So \\boxed{5}", "5"),  # \boxed beats "the answer is"
        ("\\boxed{1} and finally \\boxed{2}", "2"),  # last box
        ("\\boxed{\\text{42 apples}}", "42"),  # nested braces, units dropped
        ("\\boxed{\\$1{,}250}", "1250"),  # LaTeX dollar and {,} thousands separator
        ("The final answer is: **$-12.50** dollars", "-12.5"),
        ("THE ANSWER IS 9 cookies, not 10", "9"),  # "the answer is" beats a later number
        ("She has 3 apples and buys 4 more, 7 apples", "7"),  # last-number fallback
        ("10 - 3", "3"),  # a binary minus is not a sign
        ("#### 1,234,567.890", "1234567.89"),
        ("#### 0.0", "0"),
        ("no digits here", None),
    ],
)
def test_extract_answer_patterns(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("\\boxed{2\\sqrt{2}}", None),  # not 2
        ("\\boxed{3\\pi}", None),  # not 3
        ("\\boxed{5 - 2}", None),
        ("\\boxed{5x}", None),
        ("\\boxed{1,5}", None),
        ("The answer is 7, so \\boxed{2\\sqrt{2}}", None),  # the box is final: not 7, not its leading 2
        ("\\boxed{x = 5}", "5"),
        ("\\boxed{50\\%}", "50"),
        ("\\boxed{18 \\text{ dollars}}", "18"),
        ("\\boxed{5 m/s}", "5"),
        ("\\boxed{\\dfrac{3}{4}}", "0.75"),
    ],
)
def test_a_boxed_answer_is_read_whole(text, expected):
    assert extract_answer(text) == expected


def test_gsm8k_accuracy_does_not_read_a_leading_number_of_a_box():
    assert _acc("\\boxed{2\\sqrt{2}}", "2") == 0.0
    assert _acc("\\boxed{3\\pi}", "3") == 0.0
    assert _acc("\\boxed{3}", "3") == 1.0
    with pytest.raises(ValueError, match="has no numeric gold"):
        _acc("#### 15", "1,5")  # a gold keeps its meaning


def test_extract_answer_marker_without_number_falls_through():
    # "####" followed by a word does not count; the next patterns (here: the last number) decide.
    assert extract_answer("it is 8\n#### eight") == "8"
    assert extract_answer("it is 8\n#### eight", last_number_fallback=False) is None


def test_last_number_fallback_can_be_disabled():
    strict = make_gsm8k_accuracy(last_number_fallback=False)
    assert strict.__name__ == "gsm8k_accuracy_strict"
    assert gsm8k_accuracy.__name__ == "gsm8k_accuracy"
    assert extract_answer("so 3 + 4 = 7", last_number_fallback=False) is None
    assert _acc("so 3 + 4 = 7", "7") == 1.0
    assert _acc("so 3 + 4 = 7", "7", fn=strict) == 0.0
    assert _acc("so 3 + 4 = 7\n#### 7", "7", fn=strict) == 1.0


def test_gold_answer():
    assert gold_answer("48/2 = <<48/2=24>>24\n#### 72") == "72"
    assert gold_answer(" 1,000 ") == "1,000"


def test_gsm8k_accuracy_errors():
    with pytest.raises(ValueError, match="answer has 1 entries but there are 2 completions"):
        gsm8k_accuracy([None, None], ["#### 1", "#### 2"], answer=["1"])
    with pytest.raises(ValueError, match=r"answer\[1\]='seven' has no numeric gold"):
        gsm8k_accuracy([None, None], ["#### 1", "#### 7"], answer=["1", "seven"])


def test_gsm8k_reference_solutions_score_against_their_gold():
    rows = _rows(DATA / "gsm8k" / "train.jsonl", 21)
    solutions = [r["answer"] for r in rows[:20]]
    golds = [gold_answer(r["answer"]) for r in rows[:20]]
    next_golds = [gold_answer(r["answer"]) for r in rows[1:21]]
    assert gsm8k_accuracy([None] * 20, solutions, answer=golds) == [1.0] * 20
    # The full answer text works as gold too.
    assert gsm8k_accuracy([None] * 20, solutions, answer=solutions) == [1.0] * 20
    differ = [i for i in range(20) if float(golds[i].replace(",", "")) != float(next_golds[i].replace(",", ""))]
    assert len(differ) >= 15
    against_next = gsm8k_accuracy([None] * 20, solutions, answer=next_golds)
    assert [against_next[i] for i in differ] == [0.0] * len(differ)


# ---------------------------------------------------------------- GSM8K format


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("Step 1: 2+2=4\n#### 4", 1.0),
        ("#### 4", 1.0),
        ("work\n  ####  $1,000.  \n\n", 1.0),
        ("work\n#### -2.5<|im_end|>", 1.0),
        ("work\n#### 4\n<|endoftext|></s>  ", 1.0),
        ("work\n#### 4 apples", 0.0),  # words after the number
        ("work\n#### 4\nDone.", 0.0),  # not the last line
        ("work: #### 4", 0.0),  # not at the start of a line
        ("work\n#### four", 0.0),
        ("The answer is \\boxed{4}", 0.0),
        ("", 0.0),
    ],
)
def test_gsm8k_format(completion, expected):
    assert gsm8k_format([None], [completion]) == [expected]


# ---------------------------------------------------------------- MATH accuracy


@pytest.mark.parametrize(
    "completion, gold, expected",
    [
        ("So $x = \\boxed{\\frac{1}{2}}$.", "0.5", 1.0),
        ("\\boxed{\\dfrac{14}{3}}", "\\frac{14}{3}", 1.0),
        ("\\boxed{\\frac{14}{5}}", "\\frac{14}{3}", 0.0),
        ("\\boxed{1} was wrong. Recomputing carefully gives \\boxed{2}", "2", 1.0),  # the last box counts
        ("\\boxed{1} was wrong. Recomputing carefully gives \\boxed{2}", "1", 0.0),
        ("\\boxed{1} and \\boxed{2}", "1, 2", 1.0),  # math-verify joins boxes listed with "and"
        ("\\boxed{1} and \\boxed{2}", "2", 0.0),  # ... so listing candidates earns nothing
        ("x is $5$ and nothing is boxed", "5", 0.0),
        ("I do not know.", "5", 0.0),
    ],
)
def test_math_accuracy_golden(completion, gold, expected):
    assert math_accuracy([None], [completion], answer=[gold]) == [expected]


def test_math_accuracy_real_rows():
    rows = _rows(DATA / "math500" / "test.jsonl", 2)
    assert rows[0]["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)"
    solutions = [r["solution"] for r in rows]
    golds = [r["answer"] for r in rows]
    assert math_accuracy([None, None], solutions, answer=golds) == [1.0, 1.0]
    assert math_accuracy([None, None], solutions, answer=golds[::-1]) == [0.0, 0.0]
    assert math_accuracy([None], ["\\boxed{(3, \\pi/2)}"], answer=golds[:1]) == [1.0]


def test_math_accuracy_works_outside_the_main_thread():
    results = []

    def worker():
        try:
            results.append(math_accuracy([None, None], ["\\boxed{\\frac{1}{2}}", "\\boxed{3}"], answer=["0.5", "4"]))
        except Exception as err:  # surfaced below
            results.append(err)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert results == [[1.0, 0.0]]


def test_math_accuracy_errors():
    with pytest.raises(ValueError, match="answer has 2 entries but there are 1 completions"):
        math_accuracy([None], ["\\boxed{1}"], answer=["1", "2"])
    with pytest.raises(ValueError, match=r"answer\[0\]='' cannot be parsed"):
        math_accuracy([None], ["\\boxed{1}"], answer=[""])


# ---------------------------------------------------------------- registry


def test_resolve_reward_function():
    assert resolve_reward_function("gsm8k_accuracy") is gsm8k_accuracy
    assert resolve_reward_function("math_accuracy") is math_accuracy
    assert resolve_reward_function(gsm8k_format) is gsm8k_format
    assert resolve_reward_function("lightning_grpo.rewards.format:gsm8k_format") is gsm8k_format
    assert resolve_reward_function("lightning_grpo.rewards.format.gsm8k_format") is gsm8k_format
    assert set(REWARD_FUNCTIONS) >= {"gsm8k_accuracy", "gsm8k_format", "math_accuracy"}
    assert REWARD_FUNCTIONS["gsm8k_accuracy_strict"].__name__ == "gsm8k_accuracy_strict"


def test_an_evaluation_set_names_its_accuracy_check():
    """``RewardSet.accuracy_for``: the check a datamodule names for an evaluation set (``EvalSource.eval_accuracy``),
    else the module's ``accuracy_reward``; rewards never look datasets up themselves."""
    rewards = RewardSet.from_specs([gsm8k_format, "gsm8k_accuracy"], accuracy="gsm8k_accuracy")
    assert rewards.accuracy_for(None) is gsm8k_accuracy
    assert rewards.accuracy_for("math_accuracy") is math_accuracy
    assert RewardSet.from_specs([gsm8k_format]).accuracy_for(None) is gsm8k_format  # default: the first function
    with pytest.raises(ValueError, match="unknown reward function 'no_such_check'"):
        rewards.accuracy_for("no_such_check")


@pytest.mark.parametrize(
    "spec, message",
    [
        ("gsm8k_acc", "unknown reward function 'gsm8k_acc'; registered: "),
        ("no_such_pkg.module:fn", "cannot import reward function 'no_such_pkg.module:fn'"),
        ("lightning_grpo.rewards.format:missing", "cannot import reward function 'lightning_grpo.rewards.format:miss"),
        ("lightning_grpo.rewards.gsm8k:NUMBER_PATTERN", "resolves to str, which is not callable"),
        (3, "reward function spec 3 must be a callable or a string"),
    ],
)
def test_resolve_reward_function_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        resolve_reward_function(spec)
