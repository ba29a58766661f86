"""Worked examples (few-shot turns) put before every question of a dataset.

A small model that never writes the answer format a reward checks (``#### <number>`` for GSM8K) gets the same reward
0 in every completion of a group, so its advantages, and its gradient, are all zero. One worked example in the
prompt, a user turn with an instruction-formatted question and an assistant turn with its solution, shows the format
(as the 8-shot GSM8K prompt of Wei et al. 2022, "Chain-of-Thought Prompting", does for evaluation).
"""

from __future__ import annotations

import re
from typing import Any, Iterable

#: GSM8K's calculator annotations in its solutions, e.g. ``<<48/2=24>>``.
_CALCULATOR_NOTE = re.compile(r"<<[^<>]*>>")


def fewshot_messages(rows: Iterable[dict[str, Any]], question_field: str, solution_field: str,
                     instruction: str) -> list[dict[str, str]]:
    """The chat turns of worked examples: per row a user turn (``instruction`` with ``{question}`` replaced by the
    row's question) and an assistant turn (the row's solution without GSM8K calculator annotations).

    Args:
        rows: the examples (e.g. the first rows of a train split, which are then left out of training).
        question_field: the column holding the question.
        solution_field: the column holding the worked solution (GSM8K: ``answer``, which ends ``#### <number>``).
        instruction: the user message template, with ``{question}``.

    Returns:
        ``[{"role": "user", ...}, {"role": "assistant", ...}, ...]``, two turns per row, in order.

    Raises:
        ValueError: a row whose question or solution is empty or not text (the field is named).
    """
    messages: list[dict[str, str]] = []
    for index, row in enumerate(rows):
        question, solution = _text(row, question_field, index), _text(row, solution_field, index)
        messages.append({"role": "user", "content": instruction.replace("{question}", question)})
        messages.append({"role": "assistant", "content": _CALCULATOR_NOTE.sub("", solution).strip()})
    return messages


def _text(row: dict[str, Any], field: str, index: int) -> str:
    value = row.get(field)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"few-shot example {index}: {field!r} is empty or not text: {value!r}")
    return value
