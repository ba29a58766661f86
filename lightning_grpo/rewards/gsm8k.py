"""GSM8K answer extraction and the exact-match accuracy reward.

GSM8K (Cobbe et al., 2021, "Training Verifiers to Solve Math Word Problems") reference solutions end in a
line ``#### <number>``; the gold answer is that number. A completion's final answer is taken, in priority order,
from:

1. the last ``#### N``;
2. the last ``\\boxed{N}`` (braces matched, so ``\\boxed{\\text{42 apples}}`` works);
3. the last "the (final) answer is N" (case-insensitive; ``:``, ``$``, ``*`` and spaces may sit between);
4. if ``last_number_fallback``, the last number anywhere in the text.

A pattern counts only when a number directly follows its marker (after ``$``, ``\\$``, ``*``, ``:`` and
spaces); otherwise the next pattern is tried. Numbers are normalized: ``$`` and thousands commas
(``1,000``, ``1{,}000``) are dropped, a trailing ``.`` and any words or units after the number are ignored,
and the value is written in canonical decimal form (``5.0`` -> ``"5"``, ``-3.50`` -> ``"-3.5"``).

Comparison is **exact decimal equality** of the canonical values (no tolerance; :class:`decimal.Decimal`),
so ``5.0 == 5`` but ``0.33 != 1/3``. Fractions (``\\frac{7}{2}``, ``7/2``) are not evaluated (GSM8K golds are
plain decimals): ``\\boxed{\\frac{7}{2}}`` is not a numeric box, so the later patterns decide (the fallback
would take ``2``). All 8,792 GSM8K train+test reference solutions extract to their own gold.

math-verify is not used here: the rules above are the GSM8K ``####`` convention and plain decimals need no
symbolic algebra. Use :mod:`lightning_grpo.rewards.math` for LaTeX answers.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Callable, Optional

#: A number: optional minus (not when it is a binary minus, e.g. ``5-3``), optional ``$``, digits with
#: optional thousands commas, optional decimal part. A lone trailing ``.`` is not part of the number.
NUMBER_PATTERN = r"(?:(?<![\w)\]}])-)?(?:\\?\$\s?)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_NUMBER = re.compile(NUMBER_PATTERN)
# What may sit between a marker and its number.
_LEAD = r"[\s:*$\\]*"
_HASHES = re.compile(r"####" + _LEAD + "(" + NUMBER_PATTERN + ")")
_ANSWER_IS = re.compile(r"the\s+(?:final\s+)?answer\s+is" + _LEAD + "(" + NUMBER_PATTERN + ")", re.IGNORECASE)
_BOXED_OPEN = re.compile(r"\\boxed\s*\{")
_BOXED_LEAD = re.compile(r"^(?:\s|\\\$|\$|\\text\{|\\mathrm\{|\\textbf\{)*(" + NUMBER_PATTERN + ")")


def normalize_number(raw: str) -> Optional[str]:
    """Canonical decimal string of a matched number: ``"$1,000.50"`` -> ``"1000.5"``; ``None`` if not a number."""
    cleaned = re.sub(r"[\s$\\,]", "", raw.replace("{,}", ""))
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    text = format(value.normalize(), "f")
    return "0" if text == "-0" else text


def _boxed_contents(text: str) -> list[str]:
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


def extract_answer(text: str, last_number_fallback: bool = True) -> Optional[str]:
    """The final numeric answer of a completion, normalized (see the module docstring for the rules).

    Args:
        text: the completion text.
        last_number_fallback: when no marked answer (``####``, ``\\boxed``, "the answer is") holds a number,
            return the last number in the text instead of ``None``.

    Returns:
        The canonical decimal string (e.g. ``"1000"``, ``"-3"``, ``"2.5"``), or ``None`` if there is none.
    """
    text = text.replace("{,}", ",")
    hashes = _HASHES.findall(text)
    if hashes:
        return normalize_number(hashes[-1])
    for content in reversed(_boxed_contents(text)):
        match = _BOXED_LEAD.match(content)
        if match:
            return normalize_number(match.group(1))
        break  # only the last box counts
    answer_is = _ANSWER_IS.findall(text)
    if answer_is:
        return normalize_number(answer_is[-1])
    if last_number_fallback:
        numbers = _NUMBER.findall(text)
        if numbers:
            return normalize_number(numbers[-1])
    return None


def gold_answer(answer: str) -> str:
    """The gold number of a GSM8K ``answer`` field: the text after the last ``####``, stripped.

    A string without ``####`` (an already-extracted gold such as ``"72"``) is returned stripped.
    """
    return answer.rsplit("####", 1)[-1].strip()


def _gold_value(answer: str, index: int) -> str:
    stripped = gold_answer(answer)
    gold = normalize_number(stripped) if re.fullmatch(NUMBER_PATTERN + r"\.?", stripped) else None
    if gold is None:
        raise ValueError(f"answer[{index}]={answer!r} has no numeric gold (expected e.g. '72' or '... #### 72')")
    return gold


def make_gsm8k_accuracy(last_number_fallback: bool = True) -> Callable[..., list[float]]:
    """Build the GSM8K accuracy reward.

    Args:
        last_number_fallback: passed to :func:`extract_answer`. The returned function is named
            ``gsm8k_accuracy`` when True and ``gsm8k_accuracy_strict`` when False (the name is used in metric names).

    Returns:
        ``fn(prompts, completions, answer, **kwargs) -> list[float]``: 1.0 where the completion's extracted
        answer equals the gold exactly as a decimal, 0.0 otherwise (including when no number is found).
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
        return [float(p is not None and Decimal(p) == Decimal(g)) for p, g in zip(predictions, golds)]

    if not last_number_fallback:
        gsm8k_accuracy.__name__ = gsm8k_accuracy.__qualname__ = "gsm8k_accuracy_strict"
    return gsm8k_accuracy


#: The default GSM8K reward (with the last-number fallback).
gsm8k_accuracy = make_gsm8k_accuracy(last_number_fallback=True)
