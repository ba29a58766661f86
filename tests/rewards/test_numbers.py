"""Numbers as people write them (issue 12): the table of forms in lightning_grpo.rewards.numbers, read the same way
by both GSM8K accuracy rewards for completions and golds. Every expected value below is worked by hand."""

import json
import threading
from fractions import Fraction
from pathlib import Path

import pytest

from lightning_grpo.rewards import extract_answer, gsm8k_format, make_gsm8k_accuracy
from lightning_grpo.rewards.gsm8k import gold_answer
from lightning_grpo.rewards.numbers import NOT_NUMBERS, NUMBER, NUMBER_FORMS, canonical, normalize_number

DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
LENIENT = make_gsm8k_accuracy(last_number_fallback=True)
STRICT = make_gsm8k_accuracy(last_number_fallback=False)
# Rows of NUMBER_FORMS whose example is not a valid gold (a gold is one number, optionally "%" and ".").
NOT_A_GOLD = {"words after"}


def _scores(completion: str, gold: str) -> tuple[float, float]:
    """(gsm8k_accuracy, gsm8k_accuracy_strict) of one completion against one gold."""
    return LENIENT([None], [completion], answer=[gold])[0], STRICT([None], [completion], answer=[gold])[0]


def _read(text: str) -> list:
    """The values of every number NUMBER finds in text."""
    return [normalize_number(m) for m in NUMBER.findall(text)]


# ---------------------------------------------------------------- the three cases of the issue


def test_unicode_minus_sign_is_a_minus():
    assert _scores("#### \u22123", "-3") == (1.0, 1.0)  # was 0: the minus was dropped and "3" read
    assert _scores("#### \u22123", "3") == (0.0, 0.0)
    assert extract_answer("#### \u22123") == "-3"


def test_leading_plus_counts_with_the_strict_reward():
    assert _scores("#### +5", "5") == (1.0, 1.0)  # strict was 0: "+" stopped the #### pattern
    assert extract_answer("#### +5", last_number_fallback=False) == "5"


def test_leading_dot_gold_parses():
    assert _scores("#### 0.5", ".5") == (1.0, 1.0)  # was ValueError "no numeric gold"
    assert _scores("#### 0.5", "Half of 1 is <<1/2=.5>>.5\n#### .5") == (1.0, 1.0)
    assert _scores("#### 5", ".5") == (0.0, 0.0)


# ---------------------------------------------------------------- the table of forms


@pytest.mark.parametrize("row", NUMBER_FORMS, ids=[row.form for row in NUMBER_FORMS])
def test_number_form_reads_as_its_value(row):
    # The example holds exactly one number, and it reads as the hand-worked value.
    assert _read(row.example) == [row.value]
    # As a completion's final answer, after each marker, it scores 1.0 against its value with both rewards.
    for completion in (f"#### {row.example}", f"\\boxed{{{row.example}}}", f"The answer is {row.example}"):
        assert _scores(completion, row.value) == (1.0, 1.0), completion
    # As a gold it reads the same way.
    if row.form in NOT_A_GOLD:
        with pytest.raises(ValueError, match="has no numeric gold"):
            LENIENT([None], ["#### 1"], answer=[row.example])
    else:
        assert _scores(f"#### {row.value}", row.example) == (1.0, 1.0)
        assert _scores(f"#### {row.value}", f"work\n#### {row.example}") == (1.0, 1.0)


@pytest.mark.parametrize("row", NOT_NUMBERS, ids=[row.form for row in NOT_NUMBERS])
def test_not_a_number_reads_nothing(row):
    assert all(value is None for value in _read(row.example))  # no part of it (e.g. a prefix "1") is read
    assert extract_answer(f"#### {row.example}") is None
    assert extract_answer(f"\\boxed{{{row.example}}}") is None
    with pytest.raises(ValueError, match="has no numeric gold"):
        LENIENT([None], ["#### 1"], answer=[row.example])


def test_table_paths_are_named():
    assert {row.path for row in NUMBER_FORMS + NOT_NUMBERS} == {"decimal", "math-verify"}
    assert all(row.value is not None for row in NUMBER_FORMS)
    assert all(row.value is None for row in NOT_NUMBERS)


# ---------------------------------------------------------------- rewards on whole completions


@pytest.mark.parametrize(
    "completion, gold, lenient, strict",
    [
        # Unicode minus signs; the em dash is punctuation, so "####" has no number and the last number is 3.
        ("#### \u20133", "-3", 1.0, 1.0),
        ("#### -3", "\u22123", 1.0, 1.0),
        ("#### \u22123.5", "-3.5", 1.0, 1.0),
        ("#### \u20143", "-3", 0.0, 0.0),
        ("#### \u20143", "3", 1.0, 0.0),
        # Binary minus is not a sign: "5-3" holds 5 and 3, and is not evaluated.
        ("5-3", "-3", 0.0, 0.0),
        ("5-3", "2", 0.0, 0.0),
        ("5-3", "3", 1.0, 0.0),
        ("#### 5-3", "2", 0.0, 0.0),
        ("#### 5-3", "-3", 0.0, 0.0),
        # Decimal comma is no number: neither 15 nor 1.5 nor 1; the marker falls through to the last number.
        ("#### 1,5", "15", 0.0, 0.0),
        ("#### 1,5", "1.5", 0.0, 0.0),
        ("#### 1,5", "1", 0.0, 0.0),
        ("The answer is 1,5 pounds", "1.5", 0.0, 0.0),
        ("It was 3 before.\n#### 1,5", "3", 1.0, 0.0),
        # The dot is always the decimal point.
        ("#### 1.000", "1000", 0.0, 0.0),
        ("#### 1.000", "1", 1.0, 1.0),
        # Thousands separators.
        ("#### 1 000", "1000", 1.0, 1.0),
        ("#### 1\u202f000", "1,000", 1.0, 1.0),
        ("#### 1_000", "1000", 1.0, 1.0),
        ("#### 1,000.5", "1000.5", 1.0, 1.0),
        ("#### 1 000", "1", 0.0, 0.0),
        # Exact equality: fractions equal their decimal, a rounded decimal does not.
        ("#### 3/4", "0.75", 1.0, 1.0),
        ("#### 0.75", "3/4", 1.0, 1.0),
        ("#### 3/4", "0.7", 0.0, 0.0),
        ("#### 0.33", "1/3", 0.0, 0.0),
        ("#### 0.3333333", "1/3", 0.0, 0.0),  # math-verify's verify would say 1.0 (6-place rounding)
        ("#### 1/3", "0.33", 0.0, 0.0),
        ("\\boxed{\\frac{1}{3}}", "1/3", 1.0, 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "0.75", 1.0, 1.0),
        ("\\boxed{\\tfrac{3}{4}}", "3/4", 1.0, 1.0),
        ("\\boxed{\\frac{3}{4}}", "0.7", 0.0, 0.0),
        ("\\boxed{\\frac{3}{4}\\text{ cups}}", "0.75", 1.0, 1.0),
        ("the answer is $-\\frac{3}{4}$", "-0.75", 1.0, 1.0),
        ("So she uses $\\frac{3}{4}$ of a cup.", "0.75", 1.0, 0.0),
        ("#### 5.0", "5", 1.0, 1.0),
        ("#### 5", "5.0", 1.0, 1.0),
        # Mixed numbers are no number.
        ("#### 1 3/4", "1.75", 0.0, 0.0),
        ("#### 1 3/4", "1", 0.0, 0.0),
        ("#### 3/0", "3", 0.0, 0.0),
        # Percent is a unit: 50% reads 50 (GSM8K's percent golds are percentages).
        ("#### 50%", "50", 1.0, 1.0),
        ("#### 50%", "0.5", 0.0, 0.0),
        ("\\boxed{50\\%}", "50", 1.0, 1.0),
        ("#### 50", "50%", 1.0, 1.0),
        # Scientific notation (math-verify's parse reads 1e3 as 1).
        ("#### 1e3", "1000", 1.0, 1.0),
        ("#### 1e3", "1", 0.0, 0.0),
        ("#### 2 \\times 10^{3}", "2000", 1.0, 1.0),
        # Currency, trailing period and words around the number.
        ("#### \u20ac5", "5", 1.0, 1.0),
        ("#### -$5", "-5", 1.0, 1.0),
        ("#### 72.", "72", 1.0, 1.0),
        ("The answer is 72 dollars.", "72", 1.0, 1.0),
        ("So Natalia sold 72 clips in all.", "72", 1.0, 0.0),
    ],
)
def test_gsm8k_rewards_hand_worked(completion, gold, lenient, strict):
    assert _scores(completion, gold) == (lenient, strict)


def test_extract_answer_canonical_forms():
    assert extract_answer("\\boxed{\\frac{2}{6}}") == "1/3"
    assert extract_answer("#### $-1{,}250.50") == "-1250.5"
    assert extract_answer("#### 1000000000000000000000000000001") == "1000000000000000000000000000001"  # > 28 digits
    assert extract_answer("#### " + "1" * 1001) is None  # over MAX_DIGITS
    assert extract_answer("#### 1e101") is None  # over MAX_EXPONENT


def test_canonical():
    assert canonical(Fraction(3, 4)) == "0.75"
    assert canonical(Fraction(-3, 4)) == "-0.75"
    assert canonical(Fraction(3, 200)) == "0.015"
    assert canonical(Fraction(-1, 3)) == "-1/3"
    assert canonical(Fraction(2, 6)) == "1/3"
    assert canonical(Fraction(0)) == "0"
    assert canonical(Fraction(1000)) == "1000"
    assert canonical(Fraction(1, 10**100)) == "0." + "0" * 99 + "1"


def test_latex_fraction_outside_the_main_thread():
    # math-verify's parse uses signal.alarm only in the main thread; elsewhere no limit is passed.
    results = []
    thread = threading.Thread(target=lambda: results.append(_scores("\\boxed{\\frac{3}{4}}", "0.75")))
    thread.start()
    thread.join()
    assert results == [(1.0, 1.0)]


@pytest.mark.parametrize(
    "completion, expected",
    [
        ("work\n#### \u22123", 1.0),
        ("work\n#### +5", 1.0),
        ("work\n#### .5", 1.0),
        ("work\n#### \\frac{3}{4}", 1.0),
        ("work\n#### 1,5", 0.0),
        ("work\n#### 1 3/4", 0.0),
    ],
)
def test_gsm8k_format_reads_the_same_numbers(completion, expected):
    assert gsm8k_format([None], [completion]) == [expected]


def test_all_gsm8k_reference_solutions_extract_their_own_gold():
    files = [DATA / "gsm8k" / "train.jsonl", DATA / "gsm8k" / "test.jsonl"]
    if not all(f.exists() for f in files):
        pytest.skip(f"dataset files {files} are absent (the shared data folder is not mounted next to the repo)")
    solutions = [json.loads(line)["answer"] for f in files for line in f.open()]
    assert len(solutions) == 8792
    golds = [gold_answer(s) for s in solutions]
    assert [extract_answer(s) for s in solutions] == [g.replace(",", "") for g in golds]
    n = len(solutions)
    assert LENIENT([None] * n, solutions, answer=golds) == [1.0] * n
    assert STRICT([None] * n, solutions, answer=solutions) == [1.0] * n
