"""``benchmarks/moe.py``'s summary on hand-made runs (the runs themselves need a vLLM engine and minutes: the
benchmark's ``--toy`` checks them, outside the suite): the medians, the R3 run's paired ratio of its mismatch with
replay to the mismatch without, worked by hand, the acceptance only where a router flipped, and the options."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import moe  # noqa: E402


def _run(rows):
    return {"steps": [dict(row, interval_s=None if i == 0 else row["interval_s"]) for i, row in enumerate(rows)]}


def test_the_summary_pairs_the_mismatch_with_and_without_replay_on_the_same_rollouts():
    off = _run([{"sampling/k3_kl": 4e-6, "interval_s": 0.0}, {"sampling/k3_kl": 6e-6, "interval_s": 2.0},
                {"sampling/k3_kl": 5e-6, "interval_s": 4.0}])
    r3 = _run([{"sampling/k3_kl": 1e-7, "sampling/without_replay/k3_kl": 2e-6,
                "sampling/without_replay/router_disagreement": 0.01, "interval_s": 0.0},
               {"sampling/k3_kl": 3e-7, "sampling/without_replay/k3_kl": 2e-6,
                "sampling/without_replay/router_disagreement": 0.02, "interval_s": 3.0},
               {"sampling/k3_kl": 2e-7, "sampling/without_replay/k3_kl": 4e-6,
                "sampling/without_replay/router_disagreement": 0.0, "interval_s": 5.0}])
    summary = moe.summarize({"off": [off], "R3": [r3]})
    assert summary["off"]["sampling/k3_kl"] == pytest.approx(5e-6)
    assert summary["off"]["step_s"] == pytest.approx(3.0) and summary["R3"]["step_s"] == pytest.approx(4.0)
    assert summary["R3"]["step_s_over_off"] == pytest.approx(4 / 3)
    replay = summary["replay"]
    assert replay["k3_with_over_without_median"] == pytest.approx(0.05)  # median of 0.05, 0.15, 0.05
    assert replay["k3_with_over_without_of_sums"] == pytest.approx(6e-7 / 8e-6)  # 0.075
    assert replay["steps"] == 3 and replay["acceptance_at_most_0.1"] is True


def test_without_a_flipped_router_there_is_nothing_to_accept():
    r3 = _run([{"sampling/k3_kl": 0.0, "sampling/without_replay/k3_kl": 4e-14,
                "sampling/without_replay/router_disagreement": 0.0, "interval_s": 0.0}] * 2)
    replay = moe.summarize({"R3": [r3]})["replay"]
    assert replay["routers_flipped_without_replay"] is False and replay["acceptance_at_most_0.1"] is None


def test_options():
    args = moe.parse_args(["--toy", "--runs", "R3", "--engine-dtype", "bfloat16"])
    assert (args.steps, args.runs, args.engine_dtype, args.router_std) == (2, "R3", "bfloat16", 0.1)
    with pytest.raises(SystemExit):
        moe.parse_args(["--runs", "off,R4"])
    with pytest.raises(SystemExit):
        moe.parse_args(["--steps", "1"])
