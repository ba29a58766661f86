"""Numbers as people write them: one pattern that finds a number in text, and its exact value.

The GSM8K rewards (:mod:`lightning_grpo.rewards.gsm8k`) read completions and golds with this module, and the format
reward (:mod:`lightning_grpo.rewards.format`) uses the same pattern. Every accepted form is a row of
:data:`NUMBER_FORMS` (an example and the value it reads as, worked by hand), every form that is deliberately *not* a
number is a row of :data:`NOT_NUMBERS` (with the reason); the tests check each row. In short:

* **sign**: ``-``, ``+``, or a Unicode minus: minus sign U+2212, en dash U+2013, figure dash U+2012, small or
  fullwidth hyphen-minus U+FE63/U+FF0D. A sign right after a letter, digit, ``_``, ``)``, ``]`` or ``}`` is a
  binary operator, not a sign: ``5-3`` holds the numbers 5 and 3. Em dash and hyphen U+2010 are never signs.
* **currency** before the digits (after or before the sign), dropped: ``$``, ``\\$``, ``€``, ``£``, ``¥``, ``₹``,
  ``¢``, ``₩``, ``₽``, optionally followed by one space.
* **digits**: thousands groups of exactly three digits, separated by ``,``, ``{,}``, ``\\,``, a space, no-break
  space U+00A0, thin space U+2009, narrow no-break space U+202F or ``_`` (``1,000``, ``1 000``, ``1_000``); a
  decimal part after ``.``; a leading ``.`` (``.5``). ``.`` is always the decimal point, ``,`` never is.
* **fractions**: ``3/4``, and LaTeX ``\\frac{3}{4}``, ``\\dfrac{3}{4}``, ``\\tfrac{3}{4}`` (also ``\\frac34``) with
  integer numerator and denominator. Values stay exact: ``1/3`` is ``1/3``, not ``0.333...``.
* **scientific**: ``1e3``, ``1.5E-2``, ``2\\times 10^{3}``, ``2 \\cdot 10^3``, ``2×10^3``; exponent at most
  :data:`MAX_EXPONENT` in size (and at most :data:`MAX_DIGITS` digits in any number).
* **after the number**, not part of it: a trailing ``.``, ``%`` / ``\\%`` (``50%`` reads 50: GSM8K golds of percent
  questions are the percentage, ``"50"``), units and words (``18 dollars``).

Not numbers (nothing is read from them, so no prefix such as ``1`` is taken): a digit group that is not three
digits after ``,``/``_`` (``1,5``, ``1,50``, ``12_34``: a decimal comma or a list, ambiguous, so neither 15 nor
1.5 nor 1); digits touching the token on either side (``1.2.3``, ``3/4/5``); mixed numbers ``1 3/4`` and
``1\\frac{3}{4}`` (a whole number and a fraction, or two numbers? ambiguous); a zero denominator; a larger
exponent. A space is a thousands separator only before exactly three digits, so ``3 4`` holds two numbers.

Which path decides. A single regular expression (:data:`NUMBER_PATTERN`) finds the number. Its value is exact
(:class:`fractions.Fraction`): decimal arithmetic (:class:`decimal.Decimal`) decides every form except LaTeX
fractions, whose value comes from math-verify's LaTeX parser (``math_verify.parse``) and counts only when it is an
exact sympy ``Rational``. Equality is exact (``5.0 == 5``, ``0.75 == 3/4``, ``0.33 != 1/3``). math-verify does not
decide plain numbers and its ``verify`` is not used: with math-verify 0.9.0, ``parse`` reads ``1e3`` as 1,
``1\\,000`` as 0, ``50%`` as 0.5 and ``1,5`` as 1.5 or the set {1, 5}, and ``verify`` rounds to 6 decimal places
(``0.3333333`` equals ``1/3``).
"""

from __future__ import annotations

import re
import threading
from decimal import Decimal
from fractions import Fraction
from typing import NamedTuple, Optional

from math_verify import LatexExtractionConfig, parse

#: Largest accepted exponent size in ``1e3`` / ``2\times 10^{3}`` (a guard against ``1e999999999``).
MAX_EXPONENT = 100
#: Most digits one number may have (a guard against degenerate completions such as ``111...1``).
MAX_DIGITS = 1000

_UNICODE_MINUS = "\u2212\u2013\u2012\ufe63\uff0d"
_SIGN_CHAR = rf"[-+{_UNICODE_MINUS}]"
_SIGN = rf"(?<![\w)\]}}]){_SIGN_CHAR}"
_CURRENCY = r"(?:\\\$|[$€£¥₹¢₩₽])[ \t]?"
_SEPARATOR = r"(?:,|\{,\}|\\,|[ \u00a0\u2009\u202f_])"
_INTEGER = rf"(?:\d{{1,3}}(?:{_SEPARATOR}\d{{3}})+|\d+)"
_MAGNITUDE = rf"(?:{_INTEGER}(?:\.\d+)?|\.\d+)"
_TIMES_TEN = r"\s*(?:\\times|\\cdot|×|·)\s*10\^"
_EXPONENT = rf"(?:[eE]{_SIGN_CHAR}?\d+|{_TIMES_TEN}(?:\{{\s*{_SIGN_CHAR}?\d+\s*\}}|{_SIGN_CHAR}?\d+))"
_LATEX_ARGUMENT = rf"\s*(?:\{{\s*{_SIGN_CHAR}?\d+\s*\}}|\d)"
_LATEX_FRACTION = rf"(?<!\d)(?<!\d\s)\\[dt]?frac{_LATEX_ARGUMENT}{_LATEX_ARGUMENT}"
_SLASH_FRACTION = rf"(?<!\d\s){_MAGNITUDE}/{_MAGNITUDE}"
# Lookbehind: the token does not continue a number to its left (``1.2.3``, ``1,5``, ``3/4/5``) and is not an argument
# of a LaTeX fraction that was rejected as a whole (``1\\frac{3}{4}``, ``\\frac{1.5}{2}``).
_NOT_AFTER = r"(?<!\d)(?<!\d[.,_/])(?<!\d\\,)(?<!\d\{,\})(?<!frac)(?<!frac\{)(?<!\}\{)"
# Lookahead: nothing follows that would have made a longer number or an ambiguous one.
_NOT_BEFORE = (
    rf"(?!(?:[.,_/eE]|\{{,\}}|\\,|[eE]{_SIGN_CHAR})?\d)"  # more digits: 1,5  1.2.3  3/4/5  1e3,5
    rf"(?!{_SEPARATOR}\d{{3}}(?!\d))"  # a thousands group that was rejected: 1 000,5
    r"(?!\s\d+/\d)(?!\s*\\[dt]?frac)"  # a mixed number: 1 3/4, 1\frac{3}{4}
    rf"(?!{_TIMES_TEN})"  # a scientific suffix that was rejected
)

#: A number in text: a sign and/or a currency sign, then a LaTeX fraction, a slash fraction, or a decimal with an
#: optional exponent (see the module docstring). It has no capturing groups, so it can be embedded in other patterns.
NUMBER_PATTERN = (
    rf"{_NOT_AFTER}(?:{_SIGN}(?:{_CURRENCY})?|{_CURRENCY}(?:{_SIGN})?)?"
    rf"(?:{_LATEX_FRACTION}|{_SLASH_FRACTION}|{_MAGNITUDE}{_EXPONENT}?){_NOT_BEFORE}"
)
NUMBER = re.compile(NUMBER_PATTERN)

_MINUS_TABLE = str.maketrans({c: "-" for c in _UNICODE_MINUS})
_DROPPED = re.compile(r"\{,\}|\\,|\\\$|[$€£¥₹¢₩₽,_\s]")
_TIMES_TEN_POWER = re.compile(rf"{_TIMES_TEN}\{{?([-+]?\d+)\}}?$")
_LATEX_START = re.compile(r"\\[dt]?frac")
_LATEX_EXTRACTION = [LatexExtractionConfig()]


class NumberForm(NamedTuple):
    """One row of :data:`NUMBER_FORMS` or :data:`NOT_NUMBERS`."""

    form: str
    """What the row shows."""
    example: str
    """The number as written."""
    value: Optional[str]
    """Its canonical value (:func:`canonical`), worked by hand; ``None`` for a non-number."""
    path: str
    """Which path decides: ``"decimal"`` (this module's pattern and exact Decimal/Fraction arithmetic) or
    ``"math-verify"`` (the value of a LaTeX fraction)."""


#: Every accepted form, each with an example and the value it must read as (the tests check every row).
NUMBER_FORMS: tuple[NumberForm, ...] = (
    NumberForm("integer", "72", "72", "decimal"),
    NumberForm("decimal", "2.5", "2.5", "decimal"),
    NumberForm("trailing zeros", "5.0", "5", "decimal"),
    NumberForm("zero", "0.0", "0", "decimal"),
    NumberForm("hyphen-minus", "-3", "-3", "decimal"),
    NumberForm("minus sign U+2212", "\u22123", "-3", "decimal"),
    NumberForm("en dash U+2013 as minus", "\u20133", "-3", "decimal"),
    NumberForm("figure dash U+2012 as minus", "\u20123", "-3", "decimal"),
    NumberForm("small hyphen-minus U+FE63", "\ufe633", "-3", "decimal"),
    NumberForm("fullwidth hyphen-minus U+FF0D", "\uff0d3", "-3", "decimal"),
    NumberForm("leading plus", "+5", "5", "decimal"),
    NumberForm("leading dot", ".5", "0.5", "decimal"),
    NumberForm("negative leading dot", "-.5", "-0.5", "decimal"),
    NumberForm("thousands comma", "1,000", "1000", "decimal"),
    NumberForm("thousands commas and decimals", "1,234,567.890", "1234567.89", "decimal"),
    NumberForm("LaTeX {,} thousands", "1{,}250", "1250", "decimal"),
    NumberForm("LaTeX \\, thousands", "1\\,250", "1250", "decimal"),
    NumberForm("space thousands", "18 000", "18000", "decimal"),
    NumberForm("no-break space U+00A0 thousands", "1\u00a0000", "1000", "decimal"),
    NumberForm("thin space U+2009 thousands", "1\u2009000\u2009000", "1000000", "decimal"),
    NumberForm("narrow no-break space U+202F thousands", "1\u202f000", "1000", "decimal"),
    NumberForm("underscore thousands", "1_000", "1000", "decimal"),
    NumberForm("dollar", "$18", "18", "decimal"),
    NumberForm("LaTeX dollar", "\\$18", "18", "decimal"),
    NumberForm("minus before currency", "-$5", "-5", "decimal"),
    NumberForm("minus after currency", "$-5", "-5", "decimal"),
    NumberForm("euro", "€5.50", "5.5", "decimal"),
    NumberForm("pound with thousands", "£1,000", "1000", "decimal"),
    NumberForm("yen", "¥500", "500", "decimal"),
    NumberForm("rupee", "₹20", "20", "decimal"),
    NumberForm("trailing period", "72.", "72", "decimal"),
    NumberForm("percent sign (a unit)", "50%", "50", "decimal"),
    NumberForm("LaTeX percent sign (a unit)", "50\\%", "50", "decimal"),
    NumberForm("words after", "18 dollars", "18", "decimal"),
    NumberForm("slash fraction", "3/4", "0.75", "decimal"),
    NumberForm("non-terminating slash fraction", "1/3", "1/3", "decimal"),
    NumberForm("negative slash fraction", "-3/4", "-0.75", "decimal"),
    NumberForm("reducible slash fraction", "6/8", "0.75", "decimal"),
    NumberForm("LaTeX \\frac", "\\frac{3}{4}", "0.75", "math-verify"),
    NumberForm("LaTeX \\dfrac", "\\dfrac{3}{4}", "0.75", "math-verify"),
    NumberForm("LaTeX \\tfrac", "\\tfrac{3}{4}", "0.75", "math-verify"),
    NumberForm("LaTeX \\frac shorthand", "\\frac34", "0.75", "math-verify"),
    NumberForm("LaTeX \\frac, non-terminating", "\\frac{2}{6}", "1/3", "math-verify"),
    NumberForm("LaTeX \\frac, minus outside", "-\\frac{3}{4}", "-0.75", "math-verify"),
    NumberForm("LaTeX \\frac, minus inside", "\\frac{-3}{4}", "-0.75", "math-verify"),
    NumberForm("LaTeX \\frac, whole", "\\frac{12}{3}", "4", "math-verify"),
    NumberForm("scientific", "1e3", "1000", "decimal"),
    NumberForm("scientific, negative exponent", "1.5E-2", "0.015", "decimal"),
    NumberForm("LaTeX \\times 10^{n}", "2\\times 10^{3}", "2000", "decimal"),
    NumberForm("\\cdot 10^n", "2 \\cdot 10^3", "2000", "decimal"),
    NumberForm("multiplication sign x 10^n", "2×10^3", "2000", "decimal"),
)

#: Forms that are deliberately no number (value ``None``): nothing, not even a prefix, is read from them.
NOT_NUMBERS: tuple[NumberForm, ...] = (
    NumberForm("decimal comma or list: neither 15 nor 1.5 nor 1", "1,5", None, "decimal"),
    NumberForm("two-digit group after a comma", "1,50", None, "decimal"),
    NumberForm("European thousands with decimal comma", "1.000,5", None, "decimal"),
    NumberForm("space thousands with decimal comma", "1 000,5", None, "decimal"),
    NumberForm("underscore group not of three digits", "12_34", None, "decimal"),
    NumberForm("two decimal points", "1.2.3", None, "decimal"),
    NumberForm("two slashes (a date?)", "3/4/5", None, "decimal"),
    NumberForm("mixed number", "1 3/4", None, "decimal"),
    NumberForm("LaTeX mixed number", "1\\frac{3}{4}", None, "decimal"),
    NumberForm("zero denominator", "3/0", None, "decimal"),
    NumberForm("LaTeX zero denominator", "\\frac{3}{0}", None, "math-verify"),
    NumberForm("LaTeX fraction with a non-integer argument", "\\frac{1.5}{2}", None, "decimal"),
    NumberForm("exponent over MAX_EXPONENT", "1e101", None, "decimal"),
)


def _parsing_timeout() -> Optional[int]:
    """math-verify's ``signal.alarm`` limit works only in the main thread (as in :mod:`.math`); none elsewhere."""
    return 5 if threading.current_thread() is threading.main_thread() else None


def _latex_fraction(latex: str) -> Optional[Fraction]:
    """Exact value of a matched ``\\frac``/``\\dfrac``/``\\tfrac`` via math-verify; ``None`` unless a Rational."""
    parsed = parse("$" + latex + "$", extraction_config=_LATEX_EXTRACTION, parsing_timeout=_parsing_timeout())
    if not parsed or not getattr(parsed[0], "is_Rational", False):  # sympy Integer or Rational, not zoo or Float
        return None
    return Fraction(int(parsed[0].p), int(parsed[0].q))


def _decimal(text: str) -> Optional[Fraction]:
    """Exact value of a signed decimal with an optional exponent, separators and currency already dropped."""
    match = _TIMES_TEN_POWER.search(text)
    if match:
        text = text[: match.start()] + "e" + match.group(1)
    _, _, exponent = text.lower().partition("e")
    if exponent and abs(int(exponent)) > MAX_EXPONENT:
        return None
    return Fraction(Decimal(text))


def number_value(token: str) -> Optional[Fraction]:
    """The exact value of one number as written (a whole match of :data:`NUMBER_PATTERN`), or ``None``.

    ``None`` also when ``token`` is not one whole match, when a denominator is zero, when an exponent is over
    :data:`MAX_EXPONENT`, and when it has more than :data:`MAX_DIGITS` digits.
    Examples: ``"$1,000.50"`` -> ``Fraction(2001, 2)``; ``"\\frac{2}{6}"`` -> ``Fraction(1, 3)``.
    """
    token = token.strip()
    if not NUMBER.fullmatch(token) or sum(c.isdigit() for c in token) > MAX_DIGITS:
        return None
    text = token.translate(_MINUS_TABLE)
    latex = _LATEX_START.search(text)
    if latex:  # sign and currency before the fraction are ours; the fraction is math-verify's
        value = _latex_fraction(text[latex.start() :])
        return -value if value is not None and "-" in text[: latex.start()] else value
    parsed = [_decimal(part) for part in _DROPPED.sub("", text).split("/")]
    parts = [part for part in parsed if part is not None]
    if len(parts) != len(parsed) or (len(parts) == 2 and parts[1] == 0):
        return None
    return parts[0] if len(parts) == 1 else parts[0] / parts[1]


def canonical(value: Fraction) -> str:
    """The one text of an exact value: a plain decimal when it terminates (``"1000"``, ``"-0.75"``,
    ``"1234567.89"``; no exponent, no ``"-0"``), else the reduced fraction ``"p/q"`` (``"1/3"``)."""
    denominator, twos, fives = value.denominator, 0, 0
    while denominator % 2 == 0:
        denominator, twos = denominator // 2, twos + 1
    while denominator % 5 == 0:
        denominator, fives = denominator // 5, fives + 1
    if denominator != 1:
        return f"{value.numerator}/{value.denominator}"
    places = max(twos, fives)
    digits = str(abs(value.numerator) * 10**places // value.denominator).rjust(places + 1, "0")
    if places:
        digits = (digits[:-places] + "." + digits[-places:]).rstrip("0").rstrip(".")
    return "-" + digits if value < 0 else digits


def normalize_number(token: str) -> Optional[str]:
    """:func:`canonical` of :func:`number_value`: ``"$1,000.50"`` -> ``"1000.5"``, ``"−3"`` -> ``"-3"``,
    ``"\\frac{2}{6}"`` -> ``"1/3"``; ``None`` if ``token`` is not a number (see :data:`NOT_NUMBERS`)."""
    value = number_value(token)
    return None if value is None else canonical(value)
