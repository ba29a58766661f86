"""A seeded synthetic arithmetic task: questions generated on the fly, train and test disjoint.

Each row is ``{"question": "What is 47 + 38?", "answer": "85", "fewshot": FEWSHOT}``: the data module puts the
``fewshot`` messages (one worked example, ``12 + 7``, which is in no split) between the system prompt and the
question, a one-shot chat prompt. The (a, op, b) triples are drawn without
replacement from one shuffled pool (:class:`random.Random` seeded with ``seed``): the first ``test_size`` form the
test split, the next ``train_size`` the train split, so no test question is ever trained on (same text, same
numbers), and the same seed gives the same splits on every machine (Python's Mersenne Twister is specified).

Operations and operand ranges (``level``):

* ``level=1``: ``a + b`` and ``a - b`` with 0 <= a, b <= 15 (a >= b for subtraction): 391 questions;
* ``level=2``: the same with 0 <= a, b <= 30: 1,456 questions;
* ``level=3``: ``a + b`` and ``a - b`` with 10 <= a, b <= 99, and ``a * b`` with 2 <= a <= 9 and 10 <= b <= 99;
* ``level=4``: ``a + b`` with a, b in 100, 107, ..., 996 and 100, 111, ..., 991, and ``a * b`` with 10 <= a, b <= 99.

(The worked example ``12 + 7`` is left out of every level.)
"""

from __future__ import annotations

import random
import re
from typing import Iterator

#: Dataset names of the task: ``arithmetic`` (level 1) and ``arithmetic-<level>``.
SYNTHETIC_NAME = re.compile(r"arithmetic(?:-([1-4]))?")
#: Most held-out questions of :func:`arithmetic_splits` (a third of the level's questions where that is fewer).
TEST_SIZE = 500

#: The instruction the arithmetic prompts get (``{question}`` is filled in by the data module).
ARITHMETIC_INSTRUCTION = "{question} Give the final answer on the last line as #### <number>."
#: The worked example before every question (a user turn and the assistant's answer).
FEWSHOT = [{"role": "user", "content": ARITHMETIC_INSTRUCTION.format(question="What is 12 + 7?")},
           {"role": "assistant", "content": "12 + 7 = 19\n#### 19"}]


def _triples(level: int) -> Iterator[tuple[int, str, int]]:  # noqa: C901 - one table of levels
    low, high = {1: (0, 15), 2: (0, 30)}.get(level, (10, 99))
    if level in (1, 2, 3):
        for a in range(low, high + 1):
            for b in range(low, high + 1):
                yield a, "+", b
                if a >= b:
                    yield a, "-", b
    if level == 3:
        for a in range(2, 10):
            for b in range(10, 100):
                yield a, "*", b
    if level == 4:
        for a in range(100, 1000, 7):
            for b in range(100, 1000, 11):
                yield a, "+", b
        for a in range(10, 100):
            for b in range(10, 100):
                yield a, "*", b


def arithmetic_rows(train_size: int, test_size: int, seed: int = 0, level: int = 1) -> dict[str, list[dict]]:
    """The train and test splits of the arithmetic task (see the module docstring).

    Args:
        train_size: training questions (>= 1).
        test_size: held-out questions (>= 0), never in the train split.
        seed: the generator's seed.
        level: 1, 2, 3 or 4.

    Returns:
        ``{"train": [...], "test": [...]}``, rows ``{"question": str, "answer": str}``.

    Raises:
        ValueError: a bad ``level`` or size, or more questions asked for than the level has (the count is named).
    """
    if level not in (1, 2, 3, 4):
        raise ValueError(f"level must be 1, 2, 3 or 4, got {level}")
    if train_size < 1 or test_size < 0:
        raise ValueError(f"train_size must be >= 1 and test_size >= 0, got {train_size} and {test_size}")
    pool = [t for t in _triples(level) if t != (12, "+", 7)]  # the worked example is in no split
    if train_size + test_size > len(pool):
        raise ValueError(f"level {level} has {len(pool)} distinct questions, asked for {train_size + test_size}")
    random.Random(seed).shuffle(pool)

    def row(a: int, op: str, b: int) -> dict:
        value = a + b if op == "+" else a - b if op == "-" else a * b
        return {"question": f"What is {a} {op} {b}?", "answer": str(value), "fewshot": FEWSHOT}

    return {"test": [row(*t) for t in pool[:test_size]],
            "train": [row(*t) for t in pool[test_size:test_size + train_size]]}


def arithmetic_splits(name: str, seed: int) -> dict[str, list[dict]]:
    """The splits a data module reads for the dataset ``name`` (:data:`SYNTHETIC_NAME`): ``min(TEST_SIZE, questions //
    3)`` test questions and every other question of the level for training.

    Raises:
        ValueError: ``name`` is not an arithmetic dataset name.
    """
    match = SYNTHETIC_NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"dataset={name!r} is not 'arithmetic' or 'arithmetic-<level 1-4>'")
    level = int(match.group(1) or 1)
    pool = sum(1 for t in _triples(level) if t != (12, "+", 7))
    test = min(TEST_SIZE, pool // 3)
    return arithmetic_rows(pool - test, test, seed=seed, level=level)
