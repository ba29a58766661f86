"""The built-in calculator tool: arithmetic on numbers, evaluated from the expression's syntax tree, never ``eval``.

Allowed: integer and decimal literals (``12``, ``3.5``, ``1e3``), ``+ - * / // % **``, unary ``+``/``-`` and
parentheses. Everything else (names, calls, attributes, strings, comparisons, ...) is an error naming what was
found. Results are exact (:class:`fractions.Fraction`) except where a non-integer power makes them irrational; an
integer result is written without a decimal point (``56088``), any other to 12 significant digits (``0.333333333333``).

Limits, so that a model cannot make the trainer compute forever: the expression is at most
:data:`MAX_EXPRESSION_CHARS` characters and :data:`MAX_NODES` syntax nodes; a power's exponent is at most
:data:`MAX_EXPONENT` in magnitude; every intermediate result has at most :data:`MAX_DIGITS` digits (numerator and
denominator). A limit hit is a :class:`CalculatorError` (the tool turns it into an error observation).
"""

from __future__ import annotations

import ast
import math
import operator
from decimal import Decimal, localcontext
from fractions import Fraction
from typing import Callable, Union

MAX_EXPRESSION_CHARS = 500
MAX_NODES = 200
MAX_EXPONENT = 1000
MAX_DIGITS = 300
_MAX_BITS = MAX_DIGITS * math.log2(10)

Number = Union[Fraction, float]


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate (the message says why)."""


def _check_size(value: Number) -> Number:
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CalculatorError("the result is not a finite number")
        return value
    if max(abs(value.numerator), value.denominator).bit_length() > _MAX_BITS + 1:
        raise CalculatorError(f"an intermediate result has more than {MAX_DIGITS} digits")
    return value


def _power(base: Number, exponent: Number) -> Number:
    if isinstance(exponent, Fraction) and exponent.denominator == 1 and isinstance(base, Fraction):
        e = exponent.numerator
        if abs(e) > MAX_EXPONENT:
            raise CalculatorError(f"the exponent {e} is larger than {MAX_EXPONENT} in magnitude")
        if base == 0 and e < 0:
            raise CalculatorError("division by zero (0 to a negative power)")
        if base != 0 and abs(e) * math.log2(max(abs(base.numerator), base.denominator)) > _MAX_BITS + 1:
            raise CalculatorError(f"the power has more than {MAX_DIGITS} digits")
        return base**e
    if abs(float(exponent)) > MAX_EXPONENT:
        raise CalculatorError(f"the exponent {float(exponent):g} is larger than {MAX_EXPONENT} in magnitude")
    if float(base) < 0:
        raise CalculatorError("a negative number to a non-integer power is not a real number")
    try:
        return math.pow(float(base), float(exponent))
    except (OverflowError, ValueError) as err:
        raise CalculatorError(f"the power cannot be computed: {err}") from err


def _divide(kind: str) -> Callable[[Number, Number], Number]:
    def divide(a: Number, b: Number) -> Number:
        if b == 0:
            raise CalculatorError("division by zero")
        if kind == "/":
            return a / b
        if kind == "//":
            return Fraction(math.floor(a / b))
        return a - b * math.floor(a / b)

    return divide


_BINARY: dict[type, Callable[[Number, Number], Number]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: _divide("/"),
    ast.FloorDiv: _divide("//"), ast.Mod: _divide("%"), ast.Pow: _power,
}
_UNARY: dict[type, Callable[[Number], Number]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _evaluate(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CalculatorError(f"{value!r} is not a number")
        if isinstance(value, float) and not math.isfinite(value):
            raise CalculatorError(f"{value!r} is not a finite number")
        return _check_size(Fraction(value) if isinstance(value, int) else Fraction(repr(value)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        return _check_size(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    what = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
    raise CalculatorError(f"{what} is not allowed: only numbers, + - * / // % ** and parentheses")


def format_number(value: Number) -> str:
    """An integer without a decimal point, any other value to 12 significant digits (trailing zeros dropped)."""
    if isinstance(value, Fraction) and value.denominator == 1:
        return str(value.numerator)
    if isinstance(value, Fraction):
        with localcontext() as context:
            context.prec = 12
            decimal = Decimal(value.numerator) / Decimal(value.denominator)
    else:
        decimal = Decimal(repr(value))
        with localcontext() as context:
            context.prec = 12
            decimal = +decimal
    text = format(decimal.normalize(), "f") if abs(decimal.adjusted()) < 15 else format(decimal.normalize(), "e")
    return "0" if text in ("-0", "0E+0") else text


def evaluate(expression: str) -> str:
    """The value of an arithmetic ``expression`` as text (see the module docstring).

    Raises:
        CalculatorError: a syntax error, a disallowed construct, division by zero or a limit hit.
    """
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be text, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    text = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as err:
        raise CalculatorError(f"{expression!r} is not an arithmetic expression ({err.msg})") from err
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculatorError(f"the expression has more than {MAX_NODES} parts")
    return format_number(_evaluate(tree))


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "(12 + 7) * 3".

    Returns:
        The value, e.g. "57".
    """
    return evaluate(expression)
