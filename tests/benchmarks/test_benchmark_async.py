"""``benchmarks/async.py``'s own arithmetic (its runs need a rollout server and minutes: ``--toy`` checks them by
hand): the means over rounds, the ratios to streaming and issue 42's targets on the long-tailed workload, worked by
hand; the CPU seconds of a process tree; the options."""

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load():
    spec = importlib.util.spec_from_file_location("async_bench", BENCHMARKS / "async.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _load()
KEYS = ("mean_step_s", "steps_per_s", "train_tokens_per_s", "trainer_idle", "server_idle", "staleness_mean",
        "staleness_max", "partial_ratio", "max_partial_span", "clipped_ratio", "stale_groups", "heldout_accuracy")


def _run(workload, mode, steps_per_s, trainer_idle=0.1, **figures):
    run = dict.fromkeys(KEYS)
    run.update(workload=workload, mode=mode, steps_per_s=steps_per_s, mean_step_s=1 / steps_per_s,
               trainer_idle=trainer_idle, server_idle=0.5, train_tokens_per_s=100 * steps_per_s, **figures)
    return run


def test_means_ratios_and_targets_worked_by_hand():
    runs = [_run("longtail", "sync", 0.11), _run("longtail", "sync", 0.09),  # mean 0.10
            _run("longtail", "fixed1", 0.20), _run("longtail", "fixed1", 0.16),  # mean 0.18
            _run("longtail", "streaming", 0.25, 0.10, partial_ratio=0.5),
            _run("longtail", "streaming", 0.23, 0.14, partial_ratio=None),  # mean 0.24, idle 0.12
            _run("arithmetic", "sync", 0.5), _run("arithmetic", "streaming", 0.6)]
    summary = bench.summarize(runs)
    streaming = summary["means"]["longtail"]["streaming"]
    assert streaming["steps_per_s"] == pytest.approx(0.24) and streaming["trainer_idle"] == pytest.approx(0.12)
    assert streaming["partial_ratio"] == 0.5 and streaming["rounds"] == 2  # None is no figure, not a zero
    assert summary["ratios"]["longtail"] == {"streaming_over_sync": pytest.approx(2.4),
                                             "streaming_over_fixed1": pytest.approx(0.24 / 0.18)}
    assert summary["ratios"]["arithmetic"] == {"streaming_over_sync": pytest.approx(1.2)}
    assert summary["targets"]["ok"]  # 2.4 >= 2.0, 1.33 >= 1.25, idle 0.12 <= 0.15
    faster_fixed = bench.summarize([{**r, "steps_per_s": 0.2} if r["mode"] == "fixed1" else r for r in runs])
    assert faster_fixed["targets"]["streaming_over_fixed1"] == pytest.approx(1.2)
    assert not faster_fixed["targets"]["ok"]  # 1.2 < 1.25
    idler = bench.summarize([{**r, "trainer_idle": 0.2} if r["mode"] == "streaming" else r for r in runs])
    assert not idler["targets"]["ok"] and idler["targets"]["trainer_idle"] == pytest.approx(0.2)


def test_the_cpu_seconds_of_a_process_tree_count_its_children():
    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.5: pass\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 60
        while bench.tree_cpu_seconds(child.pid) < 0.5:
            assert time.monotonic() < deadline, "the child used no CPU"
            time.sleep(0.1)
        mine = bench.tree_cpu_seconds(os.getpid())
        assert mine >= 0.5 + time.process_time() - 0.1  # this process's own and its child's
        assert bench.tree_cpu_seconds(child.pid) < 1.0
    finally:
        child.kill()
        child.wait()


def test_options():
    args = bench.parse_args(["--toy"])
    assert (args.model, args.steps, args.toy_max_new_tokens, args.modes) == ("tiny", 3, 16, list(bench.MODES))
    with pytest.raises(SystemExit):
        bench.parse_args(["--modes", "sync,fast"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--steps", "1"])
