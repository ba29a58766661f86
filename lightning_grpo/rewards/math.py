"""MATH-500 accuracy reward: the completion's last ``\\boxed{...}`` checked against a LaTeX gold with math-verify.

Parsing and equivalence come from `math-verify <https://github.com/huggingface/Math-Verify>`_ (``parse`` and
``verify``; the MATH dataset is Hendrycks et al., 2021; MATH-500 is the subset of Lightman et al., 2023):

* completion: ``parse`` with one ``LatexExtractionConfig`` whose boxed pattern has the highest priority
  (``boxed_match_priority=0``) and whose normalization keeps the **last** box (``boxed="last"``; the library
  default ``"all"`` joins every box of the text into one set). As math-verify does for multi-part answers,
  boxes right before the last one are kept with it when they are under 10 characters away or joined to it by
  "and", "or", ``,`` or ``;`` within 70 characters: ``\\boxed{1} and \\boxed{2}`` is the set {1, 2}, which
  matches a gold ``1, 2`` but neither ``1`` nor ``2``, so listing candidates earns nothing. Without a box,
  only anchored LaTeX such as "The final answer is $x$" is taken (``try_extract_without_anchor=False``), so
  stray intermediate math does not count.
* gold: the ``answer`` column (raw LaTeX, e.g. ``\\frac{14}{3}``) is wrapped as ``\\boxed{<answer>}`` and parsed
  the same way; all 500 MATH-500 golds parse and each row's own ``solution`` verifies against its gold.
* ``verify(gold, prediction)``: symbolic/numeric equality (so ``\\frac{1}{2}`` equals ``0.5``, ``\\dfrac`` equals
  ``\\frac``), math-verify's defaults otherwise (floats rounded to 6 places, strict variables).

Timeouts: math-verify bounds each parse and comparison with ``signal.alarm`` (``parsing_timeout`` and
``timeout_seconds``), which only works in the main thread of the main interpreter; elsewhere it raises
ValueError. :func:`make_math_accuracy` therefore passes ``timeout_seconds`` when called in the main thread and
``None`` (no time limit, no signals) in any other thread, e.g. a rollout worker thread. In that case a
pathological expression can take long; run such workers in a process you can kill if that matters.
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

from math_verify import LatexExtractionConfig, LatexNormalizationConfig, parse, verify

_EXTRACTION = [
    LatexExtractionConfig(
        boxed_match_priority=0,
        try_extract_without_anchor=False,
        normalization_config=LatexNormalizationConfig(
            basic_latex=True, units=True, malformed_operators=True, nits=True, boxed="last", equations=False
        ),
    )
]


def _timeout(timeout_seconds: Optional[int]) -> Optional[int]:
    """``timeout_seconds`` in the main thread, ``None`` elsewhere (signal.alarm needs the main thread)."""
    return timeout_seconds if threading.current_thread() is threading.main_thread() else None


def parse_gold(answer: str, timeout_seconds: Optional[int] = 5) -> list:
    """Parse a MATH gold answer (raw LaTeX, without ``$`` or ``\\boxed``) with math-verify; ``[]`` if unparseable."""
    return parse("\\boxed{" + answer + "}", extraction_config=_EXTRACTION, parsing_timeout=_timeout(timeout_seconds))


def parse_completion(completion: str, timeout_seconds: Optional[int] = 5) -> list:
    """Parse a completion's final answer (its last ``\\boxed{...}``) with math-verify; ``[]`` if none."""
    return parse(completion, extraction_config=_EXTRACTION, parsing_timeout=_timeout(timeout_seconds))


def equivalent_answers(first: str, second: str, timeout_seconds: Optional[int] = 5) -> bool:
    """Whether two LaTeX answers (raw, without ``$`` or ``\\boxed``, e.g. two completions' boxes) are equivalent by
    math-verify: both parsed as golds (:func:`parse_gold`) and ``verify``-ed; False when either does not parse."""
    a, b = parse_gold(first, timeout_seconds), parse_gold(second, timeout_seconds)
    return bool(a) and bool(b) and bool(verify(a, b, timeout_seconds=_timeout(timeout_seconds)))


def make_math_accuracy(timeout_seconds: Optional[int] = 5) -> Callable[..., list[float]]:
    """Build the MATH accuracy reward.

    Args:
        timeout_seconds: per-parse and per-comparison limit in whole seconds, applied only in the main thread
            (see the module docstring); ``None`` disables it everywhere. A timed-out comparison scores 0.0.

    Returns:
        ``math_accuracy(prompts, completions, answer, **kwargs) -> list[float]``: 1.0 where the completion's last
        box is equivalent to the gold, 0.0 otherwise (including no box).

    Raises:
        ValueError: ``len(answer) != len(completions)``, or a gold that math-verify cannot parse (naming its index).
    """

    def math_accuracy(prompts: list, completions: list[str], answer: list[str], **kwargs) -> list[float]:
        if len(answer) != len(completions):
            raise ValueError(f"answer has {len(answer)} entries but there are {len(completions)} completions")
        scores = []
        for i, (completion, gold_text) in enumerate(zip(completions, answer, strict=True)):
            gold = parse_gold(gold_text, timeout_seconds)
            if not gold:
                raise ValueError(f"answer[{i}]={gold_text!r} cannot be parsed by math-verify")
            prediction = parse_completion(completion, timeout_seconds)
            correct = bool(prediction) and verify(gold, prediction, timeout_seconds=_timeout(timeout_seconds))
            scores.append(float(correct))
        return scores

    return math_accuracy


#: The default MATH reward (5 s limits in the main thread).
math_accuracy = make_math_accuracy()
