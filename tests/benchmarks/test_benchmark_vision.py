"""``benchmarks/vision.py`` on a tiny setting: the recipe runs end to end (validation before, GRPO steps with images,
validation after) and the record holds the before/after accuracy, the curve, the acceptance checks and the plot.
The learning itself is the recorded run's (benchmarks/results/vision_shapes.json); timings are not asserted."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a whole recipe run in a subprocess

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vision.py"


def test_tiny_vision_benchmark_records_a_run(tmp_path, tiny_llava_path):
    results = tmp_path / "results"
    argv = ["--max-steps", "2", "--val-size", "6", "--prompts-per-step", "2", "--num-generations", "4",
            "--val-every", "0", "--time-limit-min", "0", "--model-dir", tiny_llava_path,
            "--root", str(tmp_path / "run"), "--name", "tiny", "--results", str(results)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((results / "vision_tiny.json").read_text())
    assert record["steps"] == 2 and len(record["curve"]["reward"]) == 2
    accuracy = record["heldout_accuracy"]
    assert 0 <= accuracy["before"] <= 1 and 0 <= accuracy["after"] <= 1 and accuracy["chance"] == pytest.approx(1 / 3)
    assert set(record["acceptance"]) >= {"heldout_accuracy_gain", "heldout_accuracy_gain_ok", "minutes", "time_ok"}
    assert (results / "vision_tiny.png").stat().st_size > 1000
    assert "held-out accuracy (greedy)" in proc.stdout
