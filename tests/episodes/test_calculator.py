"""The calculator tool: exact values worked by hand, refusals of anything that is not arithmetic, the limits."""

import pytest

from lightning_grpo.episodes.calculator import MAX_EXPONENT, CalculatorError, calculator, evaluate, format_number


@pytest.mark.parametrize(("expression", "value"), [
    ("123 * 456", "56088"),
    ("(12 + 7) * 3", "57"),
    ("7 - 10", "-3"),
    ("1 / 3", "0.333333333333"),
    ("2 / 4", "0.5"),
    ("10 / 4 * 2", "5"),            # exact: 10/4 = 5/2, times 2 = 5, no float rounding
    ("0.1 + 0.2", "0.3"),           # decimal literals are exact
    ("7 // 2", "3"),
    ("-7 // 2", "-4"),              # floor, as Python
    ("-7 % 3", "2"),
    ("2 ** 10", "1024"),
    ("2 ^ 10", "1024"),             # ^ is read as a power
    ("2 ** -2", "0.25"),
    ("9 ** 0.5", "3"),
    ("-(3 + 4) * +2", "-14"),
    ("1e3 + 1", "1001"),
    ("6 × 7 ÷ 2", "21"),
])
def test_values(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(("expression", "why"), [
    ("__import__('os').system('true')", "Call is not allowed"),
    ("x + 1", "Name is not allowed"),
    ("(1).real", "Attribute is not allowed"),
    ("'a' * 3", "is not a number"),
    ("1 < 2", "Compare is not allowed"),
    ("True + 1", "is not a number"),
    ("[1, 2]", "List is not allowed"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("(-8) ** 0.5", "not a real number"),
    ("1 +", "is not an arithmetic expression"),
    ("1 & 2", "BitAnd is not allowed"),
])
def test_refusals(expression, why):
    with pytest.raises(CalculatorError, match=why):
        evaluate(expression)


def test_limits():
    with pytest.raises(CalculatorError, match="exponent"):
        evaluate(f"2 ** {MAX_EXPONENT + 1}")
    with pytest.raises(CalculatorError, match="digits"):
        evaluate("999 ** 999")
    with pytest.raises(CalculatorError, match="digits"):
        evaluate("(10 ** 200) * (10 ** 200)")
    with pytest.raises(CalculatorError, match="longer than"):
        evaluate("1+" * 300 + "1")
    with pytest.raises(CalculatorError, match="parts"):
        evaluate("+".join(["1"] * 150))
    assert evaluate("2 ** 900") == str(2**900)  # 271 digits: within the limit, exact
    with pytest.raises(CalculatorError, match="digits"):
        evaluate("2 ** 1000")  # 302 digits


def test_format_number():
    from fractions import Fraction

    assert format_number(Fraction(56088)) == "56088"
    assert format_number(Fraction(-1, 8)) == "-0.125"
    assert format_number(Fraction(2, 3)) == "0.666666666667"
    assert format_number(0.0) == "0"
