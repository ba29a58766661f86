"""Code rewards: the unit-test pass rate of a completion's code, run in the sandbox, and a code-block format check.

A completion's code is its last fenced block (```` ```python ```` , ```` ```py ```` or a bare ```` ``` ````; an
unclosed last block, e.g. a completion cut at ``max_new_tokens``, runs up to the end). The program run is the
task's ``test_setup`` column (e.g. HumanEval's prompt: imports and the signature) followed by that code, so a
completion may give the whole function or only its body. Each of the task's tests (``tests`` column: a list of
Python snippets, e.g. ``assert add(2, 3) == 5``) then runs in the program's namespace under its own timer, in one
sandboxed process per completion (:class:`lightning_grpo.sandbox.Sandbox`); the reward is passed tests / tests.

Reporting: the harness (trusted code, run before the completion's code in the same interpreter) prints one line per
test, prefixed by a random token it read from standard input, and a final line when it is done; only lines with
the token count, so a completion that exits early (``sys.exit(0)``, ``os._exit(0)``) or prints fake results passes
nothing. This is a guard against the known early-exit hacks, not a proof: code in the same interpreter could find
the token in memory, and a completion that, e.g., returns an object equal to everything passes ``==`` asserts (the
"always equal" hack of code RL); docs/rewards.md says so.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Optional, Sequence

from lightning_grpo.rewards.pool import PooledReward, RewardChunk
from lightning_grpo.sandbox import Sandbox, SandboxLimits, SandboxResult

#: The last fenced code block (its language tag python/py/Python or none); an unclosed one runs to the end.
_FENCE = re.compile(r"```[ \t]*(?:python3?|py|Python)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)

#: Outcomes a completion's run is counted under (``rewards/<name>/<outcome>``), exactly one each: ``passed`` (every
#: test), ``failed`` (some test failed or raised), ``no_code`` (no code block: not run, reward 0), ``syntax_error``,
#: ``timeout`` (a test's timer or the sandbox's wall clock), ``cpu_limit``, ``memory`` (a ``MemoryError``: the
#: address-space limit), ``output_limit`` (printed too much: killed), ``crashed`` (ended before the harness finished,
#: e.g. ``os._exit`` or a signal).
CODE_OUTCOMES = ("passed", "failed", "no_code", "syntax_error", "timeout", "cpu_limit", "memory", "output_limit",
                 "crashed")

#: The harness: reads the token (first line of stdin) and the task (``task.json``: program, tests, per-test timeout;
#: then deletes the file), compiles and runs the program, then each test, printing ``<token> <kind> <index>`` lines
#: through its own reference to ``os.write`` (fd 1).
HARNESS = r'''
import json, os, signal, sys


class _TestTimeout(BaseException):
    pass


def _alarm(signum, frame):
    raise _TestTimeout()


def _run(code, namespace, timeout):
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        exec(code, namespace)
        return "pass"
    except _TestTimeout:
        return "timeout"
    except MemoryError:
        return "memory"
    except BaseException:
        return "fail"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _main(write=os.write):
    token = sys.stdin.readline().strip()
    with open("task.json") as f:
        task = json.load(f)
    os.remove("task.json")  # the completion's code cannot read the tests from the file

    def report(kind, index=-1):
        write(1, ("\n%s %s %d\n" % (token, kind, index)).encode())

    try:
        program = compile(task["program"], "solution.py", "exec")
    except (SyntaxError, ValueError, OverflowError, RecursionError, MemoryError):
        report("syntax_error")
        return
    tests, timeout = task["tests"], task["timeout"]
    del task
    namespace = {"__name__": "solution"}
    kind = _run(program, namespace, timeout)
    report("program_" + kind)
    for index, test in enumerate(tests):
        result = "fail"
        if kind == "pass":
            try:
                code = compile(test, "test_%d.py" % index, "exec")
            except (SyntaxError, ValueError, OverflowError, RecursionError, MemoryError):
                code = None
            if code is not None:
                result = _run(code, namespace, timeout)
        report(result, index)
    report("done")


_main()
'''


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
        sandbox: the sandbox the code runs in (default: ``Sandbox()``, its default limits and the strongest
            isolation available, :mod:`lightning_grpo.sandbox`).
        tests_column: the column holding each task's tests (a list of Python snippets).
        setup_column: the column holding code run before the completion's (None or a missing column: none).
        test_timeout_s: seconds each test (and the program itself) may run before it counts as failed (a timer in
            the harness; the sandbox's wall-clock limit bounds the whole run).
        name: the metric name.

    Rewards: passed tests / tests in [0, 1]; 0 for a completion without a code block, a syntax error, a crash, a
    timeout or a limit. Outcome metrics: ``rewards/<name>/<outcome>`` for :data:`CODE_OUTCOMES`.

    Raises:
        ValueError (when scoring): a task without tests, or whose ``tests`` is not a list of strings.
        RuntimeError (when scoring): no isolation mechanism works (:attr:`lightning_grpo.sandbox.Sandbox.mechanism`).
    """

    chunk_size = 1
    outcomes = CODE_OUTCOMES

    def __init__(self, sandbox: Optional[Sandbox] = None, tests_column: str = "tests",
                 setup_column: Optional[str] = "test_setup", test_timeout_s: float = 3.0,
                 name: str = "code_pass_rate") -> None:
        super().__init__(name)
        if not test_timeout_s > 0:
            raise ValueError(f"CodeReward test_timeout_s={test_timeout_s!r} must be > 0")
        self.sandbox = sandbox if sandbox is not None else Sandbox(SandboxLimits())
        self.tests_column, self.setup_column, self.test_timeout_s = tests_column, setup_column, test_timeout_s

    def score_chunk(self, prompts: list, completions: list[str], columns: dict[str, list]) -> RewardChunk:
        if self.tests_column not in columns:
            raise ValueError(f"CodeReward needs the column {self.tests_column!r} (the tests); got {sorted(columns)}")
        outcomes = dict.fromkeys(CODE_OUTCOMES, 0)
        values = []
        for i, completion in enumerate(completions):
            tests = columns[self.tests_column][i]
            setup = columns.get(self.setup_column, [None] * len(completions))[i] if self.setup_column else None
            value, outcome = self.run(completion, tests, setup)
            values.append(value)
            outcomes[outcome] += 1
        return RewardChunk(values, outcomes)

    def run(self, completion: str, tests: Sequence[str], setup: Optional[str] = None) -> tuple[float, str]:
        """The pass rate of ``completion``'s code on ``tests`` and its outcome (:data:`CODE_OUTCOMES`).

        Raises:
            ValueError: ``tests`` is empty or not a list of strings.
        """
        if isinstance(tests, str) or not tests or not all(isinstance(t, str) for t in tests):
            raise ValueError(f"a code task's tests must be a non-empty list of strings, got {tests!r:.200}")
        code = extract_code(completion)
        if code is None:
            return 0.0, "no_code"
        program = f"{setup}\n{code}" if setup else code
        token = secrets.token_hex(16)
        task = {"program": program, "tests": list(tests), "timeout": self.test_timeout_s}
        result = self.sandbox.run_python(HARNESS, stdin=f"{token}\n".encode(), files={"task.json": json.dumps(task)})
        return _read_report(result, token, len(tests))


def _read_report(result: SandboxResult, token: str, n_tests: int) -> tuple[float, str]:
    """Pass rate and outcome from the harness's token lines and how the sandboxed run ended."""
    kinds: dict[int, str] = {}
    events: set[str] = set()
    for line in result.stdout.splitlines():
        parts = line.split(" ")
        if len(parts) == 3 and parts[0] == token:
            kind, index = parts[1], int(parts[2])
            if index >= 0:
                kinds.setdefault(index, kind)
            else:
                events.add(kind)
    passed = sum(1 for i in range(n_tests) if kinds.get(i) == "pass")
    rate = passed / n_tests
    if "syntax_error" in events:
        return 0.0, "syntax_error"
    if result.status in ("timeout", "cpu_limit", "output_limit"):
        return rate, result.status
    if "done" not in events:
        return rate, "crashed"
    results = set(kinds.values()) | {e[len("program_"):] for e in events if e.startswith("program_")}
    for outcome in ("memory", "timeout"):
        if outcome in results:
            return rate, outcome
    return rate, "passed" if passed == n_tests else "failed"
