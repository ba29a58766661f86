"""GSM8K answer extraction and the exact-match accuracy reward.

GSM8K (Cobbe et al., 2021, "Training Verifiers to Solve Math Word Problems") reference solutions end in a
line ``#### <number>``; the gold answer is that number. A completion's final answer is taken, in priority order,
from:

1. the last ``#### N``;
2. the last ``\\boxed{...}`` (braces matched), read whole: it must hold one number, optionally after ``x =`` and
   before a unit or words (``\\boxed{\\text{42 apples}}``, ``\\boxed{50\\%}``), else the completion has no numeric
   answer (``\\boxed{2\\sqrt{2}}`` is not 2, ``\\boxed{3\\pi}`` is not 3, ``\\boxed{5 - 2}`` is not 5) and nothing
   later in this list is tried: the box is the completion's final answer;
3. the last "the (final) answer is N" (case-insensitive; ``:``, ``$``, ``*`` and spaces may sit between);
4. if ``last_number_fallback``, the last number anywhere in the text.

A ``####`` or "the answer is" counts only when a number directly follows it (after ``$``, ``\\$``, ``*``, ``:``
and spaces); otherwise the next pattern is tried. What a number is, and its exact value, comes from
:mod:`lightning_grpo.rewards.numbers` (its table :data:`~lightning_grpo.rewards.numbers.NUMBER_FORMS` lists every
accepted form): ``-3``/``−3`` (U+2212 and other Unicode minus signs), ``+5``, ``.5``, ``1,000``/``1 000``/
``1{,}000``/``1_000``, ``$18``/``€5``, ``5.0``, ``3/4``, ``\\frac{3}{4}``/``\\dfrac``/``\\tfrac`` (value from
math-verify), ``1e3``/``2\\times 10^{3}``. What follows the number is not part of it: a trailing ``.``, ``%``
(``50%`` reads 50, as GSM8K writes the golds of percent questions), units and words. ``1,5`` (decimal comma or
list?) and mixed numbers ``1 3/4`` are no number at all, so a marker followed by one falls through; a sign right
after a digit or letter is a binary minus (``5-3`` holds 5 and 3). The extracted answer is written canonically
(``5.0`` -> ``"5"``, ``-3.50`` -> ``"-3.5"``, ``\\frac{2}{6}`` -> ``"1/3"``).

Comparison is **exact** equality of values (:class:`fractions.Fraction`; no float tolerance), so ``5.0 == 5`` and
``3/4 == 0.75`` but ``0.33 != 1/3`` and ``50% != 0.5``. Golds are read by the same rules: a gold is one number,
optionally followed by ``%`` and a ``.`` (``"72"``, ``"1,000"``, ``".5"``, ``"−3"``, ``"3/4"``). All 8,792 GSM8K
train+test reference solutions extract to their own gold.

math-verify's ``verify`` is not used (it rounds to 6 decimal places); :mod:`lightning_grpo.rewards.math` is the
reward for LaTeX answers.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Callable, Optional

from lightning_grpo.rewards.numbers import NUMBER, NUMBER_PATTERN, normalize_number

# What may sit between a marker and its number.
_LEAD = r"[\s:*$\\]*"
_HASHES = re.compile(r"####" + _LEAD + "(" + NUMBER_PATTERN + ")")
_ANSWER_IS = re.compile(r"the\s+(?:final\s+)?answer\s+is" + _LEAD + "(" + NUMBER_PATTERN + ")", re.IGNORECASE)
_BOXED_OPEN = re.compile(r"\\boxed\s*\{")
# Text wrappers inside a box (their content is kept), LaTeX spaces, and an "x =" before the number.
_BOX_WRAPPER = re.compile(r"\\(?:text|mathrm|textbf|textit|mbox|mathbf)\s*\{([^{}]*)\}")
_BOX_SPACES = re.compile(r"\\[,;:! ]|\\quad|\\qquad|~")
_BOX_DOLLAR = re.compile(r"(?<!\\)\$")  # math delimiters (``\\$`` is currency: the number pattern reads it)
_BOX_VARIABLE = re.compile(r"^[A-Za-z]\w*\s*=\s*")
_BOX_NUMBER = re.compile("(" + NUMBER_PATTERN + ")")
# What may follow the number in a box: a percent sign, a full stop, then words (units) after a space; no digit, no
# operator, no LaTeX command, no letter touching the number (``3x``).
_BOX_TAIL = re.compile(r"\s*(?:\\?%)?\.?(?:\s+[A-Za-z][A-Za-z\s./'-]*)?\s*")
# A gold: one number, then optionally a percent sign (a unit, dropped) and a full stop.
_GOLD = re.compile(r"(" + NUMBER_PATTERN + r")\s*(?:\\?%)?\.?")


def boxed_contents(text: str) -> list[str]:
    """Contents of every ``\\boxed{...}`` in ``text`` (braces matched; an unclosed box runs to the end)."""
    contents = []
    for match in _BOXED_OPEN.finditer(text):
        depth, start = 1, match.end()
        end = start
        while end < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            end += 1
        contents.append(text[start : end - 1 if depth == 0 else end])
    return contents


def boxed_number(content: str) -> Optional[str]:
    """The canonical number a box's content is, read whole (see the module docstring, rule 2), or None.

    Examples: ``"\\text{42 apples}"`` -> ``"42"``, ``"x = 5"`` -> ``"5"``, ``"\\frac{2}{6}"`` -> ``"1/3"``;
    ``"2\\sqrt{2}"``, ``"3\\pi"``, ``"5 - 2"``, ``"1,5"`` -> None.
    """
    text = content
    for _ in range(3):  # nested wrappers
        text = _BOX_WRAPPER.sub(lambda m: f" {m.group(1)} ", text)
    text = _BOX_VARIABLE.sub("", _BOX_SPACES.sub(" ", _BOX_DOLLAR.sub("", text)).strip())
    match = _BOX_NUMBER.match(text)
    if not match or not _BOX_TAIL.fullmatch(text[match.end() :]):
        return None
    return normalize_number(match.group(1))


def extract_answer(text: str, last_number_fallback: bool = True) -> Optional[str]:
    """The final numeric answer of a completion, normalized (see the module docstring for the rules).

    Args:
        text: the completion text.
        last_number_fallback: when no marked answer (``####``, ``\\boxed``, "the answer is") holds a number,
            return the last number in the text instead of ``None``.

    Returns:
        The canonical value (:func:`lightning_grpo.rewards.numbers.canonical`: ``"1000"``, ``"-3"``, ``"2.5"``,
        ``"1/3"``), or ``None`` if there is none or the number has no value (``3/0``).
    """
    hashes = _HASHES.findall(text)
    if hashes:
        return normalize_number(hashes[-1])
    boxes = boxed_contents(text)
    if boxes:  # the last box is the final answer, a number or not
        return boxed_number(boxes[-1])
    answer_is = _ANSWER_IS.findall(text)
    if answer_is:
        return normalize_number(answer_is[-1])
    if last_number_fallback:
        numbers = NUMBER.findall(text)
        if numbers:
            return normalize_number(numbers[-1])
    return None


def gold_answer(answer: str) -> str:
    """The gold number of a GSM8K ``answer`` field: the text after the last ``####``, stripped.

    A string without ``####`` (an already-extracted gold such as ``"72"``) is returned stripped.
    """
    return answer.rsplit("####", 1)[-1].strip()


def _gold_value(answer: str, index: int) -> Fraction:
    """The exact value of gold ``answer[index]`` (see :func:`gold_answer`), read like a completion's number."""
    match = _GOLD.fullmatch(gold_answer(answer))
    gold = normalize_number(match.group(1)) if match else None
    if gold is None:
        raise ValueError(f"answer[{index}]={answer!r} has no numeric gold (expected e.g. '72' or '... #### 72')")
    return Fraction(gold)


def make_gsm8k_accuracy(last_number_fallback: bool = True) -> Callable[..., list[float]]:
    """Build the GSM8K accuracy reward.

    Args:
        last_number_fallback: passed to :func:`extract_answer`. The returned function is named
            ``gsm8k_accuracy`` when True and ``gsm8k_accuracy_strict`` when False (the name is used in metric names).

    Returns:
        ``fn(prompts, completions, answer, **kwargs) -> list[float]``: 1.0 where the completion's extracted
        answer equals the gold exactly (as a rational number), 0.0 otherwise (including when no number is found).
        ``answer`` holds one gold per completion, either a number (``"1000"``) or a full GSM8K solution
        ending in ``#### 1,000``.

    Raises:
        ValueError: ``len(answer) != len(completions)``, or a gold that is not a number.
    """

    def gsm8k_accuracy(prompts: list, completions: list[str], answer: list[str], **kwargs) -> list[float]:
        if len(answer) != len(completions):
            raise ValueError(f"answer has {len(answer)} entries but there are {len(completions)} completions")
        golds = [_gold_value(a, i) for i, a in enumerate(answer)]
        predictions = [extract_answer(c, last_number_fallback=last_number_fallback) for c in completions]
        return [float(p is not None and Fraction(p) == g) for p, g in zip(predictions, golds, strict=True)]

    if not last_number_fallback:
        gsm8k_accuracy.__name__ = gsm8k_accuracy.__qualname__ = "gsm8k_accuracy_strict"
    return gsm8k_accuracy


#: The default GSM8K reward (with the last-number fallback).
gsm8k_accuracy = make_gsm8k_accuracy(last_number_fallback=True)
