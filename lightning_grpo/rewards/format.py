"""Format reward: does the completion end with a GSM8K-style ``#### <number>`` line?

The rule, precisely: after removing trailing whitespace and any trailing end-of-sequence markers
(``<|im_end|>``, ``<|endoftext|>``, ``<|eot_id|>``, any other ``<|...|>`` token, ``</s>``, ``<eos>``), the last
line of the completion must be ``####`` followed by one number and nothing else, where

* the line may be indented, and spaces may separate ``####`` and the number;
* the number is one match of :data:`lightning_grpo.rewards.numbers.NUMBER_PATTERN`, the forms the GSM8K accuracy
  reward reads (``1,000``, ``$18``, ``-3``, ``−3``, ``+5``, ``2.5``, ``.5``, ``3/4``, ``\\frac{3}{4}``, ...; not
  ``1,5``);
* one trailing ``.`` is allowed; words or units after the number (``#### 18 dollars``) are not.

The line may also be the whole completion. The score does not depend on the prompt or on correctness.
"""

from __future__ import annotations

import re

from lightning_grpo.rewards.gsm8k import NUMBER_PATTERN

_TRAILER = re.compile(r"(?:\s|<\|[^|<>]*\|>|</s>|<eos>)*\Z")
_FINAL_LINE = re.compile(r"(?:\A|\n)[ \t]*####[ \t]*" + NUMBER_PATTERN + r"\.?[ \t]*\Z")


def gsm8k_format(prompts: list, completions: list[str], **kwargs) -> list[float]:
    """1.0 for each completion whose last line (see the module docstring) is ``#### <number>``, else 0.0.

    Args:
        prompts: unused (present for the reward-function signature).
        completions: ``N`` completion texts.
        **kwargs: other dataset columns, unused.

    Returns:
        ``N`` floats in {0.0, 1.0}.
    """
    scores = []
    for completion in completions:
        trailer = _TRAILER.search(completion)
        body = completion if trailer is None else completion[: trailer.start()]
        scores.append(1.0 if _FINAL_LINE.search(body) else 0.0)
    return scores
