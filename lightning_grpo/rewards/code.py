"""Code rewards: the unit-test pass rate of a completion's code, run in the sandbox, and a code-block format check.

A completion's code is its last fenced block (```` ```python ```` , ```` ```py ```` or a bare ```` ``` ````; an
unclosed last block, e.g. a completion cut at ``max_new_tokens``, runs up to the end). The program is the task's
``test_setup`` column (e.g. HumanEval's prompt: imports and the signature) followed by that code, so a completion may
give the whole function or only its body. The task's tests (``tests`` column: a list of Python snippets, e.g.
``assert add(2, 3) == 5``) each run under their own timer; the reward is passed tests / tests.

Where the checks run: never in the interpreter the completion's code runs in, which that code can rewrite. Each
completion gets two sandboxed processes (:mod:`lightning_grpo.rewards.code_harness`): the program runs in one and
answers calls; the tests run in the other, a checker the completion's code never ran in, whose calls of the
program's functions (the task's ``entry_point`` and any name the tests use that the setup does not define) cross as
plain data (:mod:`lightning_grpo.rewards.plain_data`). Only the checker's output is read, and strictly: what a
completion prints, raises or writes cannot make a test pass or the scoring raise. docs/rewards.md ("Code reward")
lists what this does and does not guarantee.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from typing import Any, Optional, Sequence

from lightning_grpo.rewards.code_harness import CHECKER, SOLUTION
from lightning_grpo.rewards.pool import PooledReward, RewardChunk
from lightning_grpo.sandbox import Sandbox, SandboxLimits, SandboxResult

log = logging.getLogger(__name__)

#: The last fenced code block (its language tag python/py/Python or none); an unclosed one runs to the end. The
#: quantifiers before the newline are possessive and cannot trade characters, so a fence followed by a long run of
#: spaces costs linear time, not quadratic.
_FENCE = re.compile(r"```[ \t]*+(?:(?:python3?|py|Python)[ \t]*+)?\n(.*?)(?:```|\Z)", re.DOTALL)

#: Outcomes a completion's run is counted under (``rewards/<name>/<outcome>``), exactly one each: ``passed`` (every
#: test), ``failed`` (some test failed or raised), ``no_code`` (no code block: not run, reward 0), ``syntax_error``,
#: ``timeout`` (a test's timer or the sandbox's wall clock), ``cpu_limit``, ``memory`` (a ``MemoryError``: the
#: address-space limit), ``output_limit`` (printed too much: killed), ``crashed`` (the program's process ended or
#: stopped answering before the tests were done, e.g. ``os._exit`` or a signal; or the checker gave no whole report).
CODE_OUTCOMES = ("passed", "failed", "no_code", "syntax_error", "timeout", "cpu_limit", "memory", "output_limit",
                 "crashed")

#: The kinds the checker reports for the program and for each test.
_KINDS = ("pass", "fail", "timeout", "memory", "gone")


def extract_code(completion: str) -> Optional[str]:
    """The code of the last fenced block of ``completion`` (an unclosed last block: up to the end), or None."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else None


def code_block_format(prompts: list, completions: list[str], **kwargs) -> list[float]:
    """1.0 for a completion with a fenced code block, else 0.0 (a rule reward: nothing is run)."""
    return [1.0 if extract_code(c) is not None else 0.0 for c in completions]


class CodeReward(PooledReward):
    """The unit-test pass rate of each completion's code, run in the sandbox (see the module docstring).

    Args:
        sandbox: the sandbox both processes of a completion run in (default: ``Sandbox()``, its default limits and
            the strongest isolation available, :mod:`lightning_grpo.sandbox`); its ``output_bytes`` also caps one
            answer of the program's process.
        tests_column: the column holding each task's tests (a list of Python snippets).
        setup_column: the column holding code run before the completion's (None or a missing column: none); the
            tests see the setup's own definitions, never the completion's versions of them.
        entry_point_column: the column naming the function(s) under test (a name or a list of names; HumanEval's
            ``entry_point``), which the tests call in the program even where the setup defines a function of the
            same name (None or a missing column: the setup's stubs, functions whose body is only docstrings,
            ``pass``, ``...`` and imports, and the names the tests use that the setup does not define). A setup
            function with a body of its own that a completion defines again is the setup's for the tests (it may be
            a helper the tests rely on): a warning names it, once, asking for the entry point.
        test_timeout_s: seconds each test (and the program itself, and each call) may run before it counts as
            failed (a timer in each process; the sandbox's wall-clock limit bounds the whole run).
        name: the metric name.

    Rewards: passed tests / tests in [0, 1]; 0 for a completion without a code block, a syntax error, a crash, a
    timeout or a limit. Outcome metrics: ``rewards/<name>/<outcome>`` for :data:`CODE_OUTCOMES`.

    Raises:
        ValueError (when scoring): a task without tests, or whose ``tests`` is not a list of strings, or an entry
            point that is not a name or a list of names.
        RuntimeError (when scoring): no isolation mechanism works (:attr:`lightning_grpo.sandbox.Sandbox.mechanism`).
    """

    chunk_size = 1
    outcomes = CODE_OUTCOMES

    def __init__(self, sandbox: Optional[Sandbox] = None, tests_column: str = "tests",
                 setup_column: Optional[str] = "test_setup", entry_point_column: Optional[str] = "entry_point",
                 test_timeout_s: float = 3.0, name: str = "code_pass_rate") -> None:
        super().__init__(name)
        if not test_timeout_s > 0:
            raise ValueError(f"CodeReward test_timeout_s={test_timeout_s!r} must be > 0")
        self.sandbox = sandbox if sandbox is not None else Sandbox(SandboxLimits())
        self.tests_column, self.setup_column, self.test_timeout_s = tests_column, setup_column, test_timeout_s
        self.entry_point_column = entry_point_column
        self._warned: set[str] = set()  # the setup functions a warning named already
        self._warn_lock = threading.Lock()

    def score_chunk(self, prompts: list, completions: list[str], columns: dict[str, list]) -> RewardChunk:
        if self.tests_column not in columns:
            raise ValueError(f"CodeReward needs the column {self.tests_column!r} (the tests); got {sorted(columns)}")
        outcomes = dict.fromkeys(CODE_OUTCOMES, 0)
        values = []
        for i, completion in enumerate(completions):
            tests = columns[self.tests_column][i]
            setup = _column(columns, self.setup_column, i)
            value, outcome = self.run(completion, tests, setup, _column(columns, self.entry_point_column, i))
            values.append(value)
            outcomes[outcome] += 1
        return RewardChunk(values, outcomes)

    def run(self, completion: str, tests: Sequence[str], setup: Optional[str] = None,
            entry_point: str | Sequence[str] | None = None) -> tuple[float, str]:
        """The pass rate of ``completion``'s code on ``tests`` and its outcome (:data:`CODE_OUTCOMES`).

        Args:
            completion: the model's text.
            tests: the task's tests.
            setup: code run before the completion's (its definitions are the ones the tests see).
            entry_point: the name(s) of the function(s) under test, called in the program even where ``setup``
                defines a stub of that name.

        Raises:
            ValueError: ``tests`` is empty or not a list of strings; ``entry_point`` is not a name or names.
        """
        runs = self.run_processes(completion, tests, setup, entry_point)
        if runs is None:
            return 0.0, "no_code"
        self._warn_kept(kept_functions(runs[0], len(tests)))
        return read_report(*runs, len(tests))

    def _warn_kept(self, names: Sequence[str]) -> None:
        """Warn once per name of a setup function the tests called in the setup's version though the completion
        wrote it (the checker's ``kept`` report line)."""
        with self._warn_lock:
            new = [n for n in names if n not in self._warned]
            self._warned.update(new)
        for name in new:
            log.warning("%s: a completion defines %r again, but the task's setup defines %r with a body of its own "
                        "(not only a docstring, pass, ... and imports) and no entry point names it, so the tests "
                        "call the setup's %r, not the completion's; if %r is the function under test, name it in "
                        "the %r column (entry_point=%r)", self.__name__, name, name, name, name,
                        self.entry_point_column, name)

    def run_processes(self, completion: str, tests: Sequence[str], setup: Optional[str] = None,
                      entry_point: str | Sequence[str] | None = None
                      ) -> Optional[tuple[SandboxResult, SandboxResult]]:
        """What :meth:`run` scores: the checker's run and the program's run (their status, output, times), or None
        for a completion without a code block. The checker runs on this thread, the program's process on a helper
        thread, in two sandboxes connected by two pipes; the program's run is stopped when the checker's ends.

        Raises:
            ValueError: as :meth:`run`.
        """
        if isinstance(tests, str) or not tests or not all(isinstance(t, str) for t in tests):
            raise ValueError(f"a code task's tests must be a non-empty list of strings, got {tests!r:.200}")
        entry_points = [entry_point] if isinstance(entry_point, str) else list(entry_point or [])
        if not all(isinstance(e, str) and e.isidentifier() for e in entry_points):
            raise ValueError(f"a code task's entry_point must be a name or a list of names, got {entry_point!r:.200}")
        code = extract_code(completion)
        if code is None:
            return None
        program = f"{setup}\n{code}" if setup else code
        task = json.dumps({"program": program, "setup": setup or "", "tests": list(tests),
                           "entry_points": entry_points, "timeout": self.test_timeout_s,
                           "max_message_bytes": self.sandbox.limits.output_bytes,
                           "mechanism": self.sandbox.mechanism}).encode()
        python = self.sandbox.python
        requests_r, requests_w = os.pipe()
        answers_r, answers_w = os.pipe()
        stop = threading.Event()
        outcome: dict[str, Any] = {}

        def serve() -> None:
            try:
                outcome["result"] = self.sandbox.run([python, "-s", "-c", SOLUTION, str(requests_r), str(answers_w)],
                                                     pass_fds=(requests_r, answers_w), stop=stop)
            except BaseException as err:  # noqa: BLE001 - re-raised on the caller's thread
                outcome["error"] = err

        thread = threading.Thread(target=serve, name="lightning_grpo_code_solution", daemon=True)
        try:
            thread.start()
        except BaseException:
            for fd in (requests_r, requests_w, answers_r, answers_w):
                os.close(fd)
            raise
        try:
            checker = self.sandbox.run([python, "-s", "-c", CHECKER, str(answers_r), str(requests_w)], stdin=task,
                                       pass_fds=(answers_r, requests_w))
        finally:
            stop.set()
            thread.join()
        if "error" in outcome:
            raise outcome["error"]
        return checker, outcome["result"]


def _column(columns: dict[str, list], name: Optional[str], i: int) -> Any:
    return columns[name][i] if name is not None and name in columns else None


def read_report(checker: SandboxResult, solution: SandboxResult, n_tests: int) -> tuple[float, str]:
    """Pass rate and outcome (:data:`CODE_OUTCOMES`) from the checker's report and how both processes ended.

    Only the checker's standard output is read (the program's output never is), line by line, each a JSON object of
    :mod:`lightning_grpo.rewards.code_harness`'s report; a line that is not one of those makes the sample a failed
    one (``(0.0, "crashed")``): a malformed report never raises here. A last line without its newline (the checker
    was killed while writing it) is left out.
    """
    report = _parse_report(checker.stdout, n_tests)
    if report is None:
        return 0.0, "crashed"
    if report["syntax_error"]:
        return 0.0, "syntax_error"
    results = report["results"]
    passed = sum(1 for i in range(n_tests) if results.get(i) == "pass")
    rate = passed / n_tests
    for run in (solution, checker):
        if run.status in ("timeout", "cpu_limit", "output_limit"):
            return rate, run.status
    if not report["done"] or report["program"] in (None, "gone") or report["channel"] in ("closed", "garbled"):
        return rate, "crashed"
    kinds = {report["program"], *results.values()}
    for outcome in ("memory", "timeout"):
        if outcome in kinds:
            return rate, outcome
    return rate, "passed" if passed == n_tests else "failed"


def kept_functions(checker: SandboxResult, n_tests: int) -> list[str]:
    """The setup functions with a body of their own that the completion defined again and the tests called in the
    setup's version (the checker's ``kept`` line; none for a malformed report)."""
    report = _parse_report(checker.stdout, n_tests)
    return [] if report is None else report["kept"]


def _parse_report(stdout: str, n_tests: int) -> Optional[dict[str, Any]]:
    """The checker's report lines gathered (``syntax_error``, ``kept``, ``program``, ``results``, ``done``,
    ``channel``), or None when a whole line is not a report line."""
    report: dict[str, Any] = {"syntax_error": False, "kept": [], "program": None, "results": {}, "done": False,
                              "channel": None}
    for line in stdout.split("\n")[:-1]:
        entry = _entry(line, n_tests)
        if entry is None:
            return None
        if "syntax_error" in entry:
            report["syntax_error"] = True
        elif "kept" in entry:
            report["kept"] = entry["kept"]
        elif "program" in entry:
            report["program"] = entry["program"]
        elif "test" in entry:
            report["results"].setdefault(entry["test"], entry["result"])
        else:
            report["done"], report["channel"] = True, entry["channel"]
    return report


def _entry(line: str, n_tests: int) -> Optional[dict[str, Any]]:
    """One line of the checker's report as a dict of the known shapes, or None."""
    try:
        entry = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(entry, dict):
        return None
    if entry == {"syntax_error": True}:
        return entry
    if set(entry) == {"kept"} and type(entry["kept"]) is list and 0 < len(entry["kept"]) <= 64 \
            and all(type(n) is str and n.isidentifier() for n in entry["kept"]):
        return entry
    if set(entry) == {"program"} and entry["program"] in _KINDS:
        return entry
    if set(entry) == {"test", "result"} and type(entry["test"]) is int and 0 <= entry["test"] < n_tests \
            and entry["result"] in _KINDS:
        return entry
    if set(entry) == {"done", "channel"} and entry["done"] is True \
            and entry["channel"] in ("open", "closed", "garbled", "stuck"):
        return entry
    return None
