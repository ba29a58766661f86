"""``benchmarks/vision.py`` on a tiny setting: the recipe runs end to end (validation of the new model, the projector
alignment, validation, GRPO steps with images, validation after) and the record holds each stage's accuracy, the
curve, the acceptance checks and the plot; a model folder given on the command line is used, never rebuilt.
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
            "--val-every", "0", "--time-limit-min", "0", "--model-dir", tiny_llava_path, "--align-steps", "2",
            "--align-batch-size", "2",
            "--root", str(tmp_path / "run"), "--name", "tiny", "--results", str(results)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads((results / "vision_tiny.json").read_text())
    assert record["steps"] == 2 and len(record["curve"]["reward"]) == 2
    accuracy = record["heldout_accuracy"]
    assert all(0 <= accuracy[k] <= 1 for k in ("new_model", "before", "after"))
    assert accuracy["chance"] == pytest.approx(1 / 3)
    checks = record["acceptance"]
    assert checks["heldout_accuracy_gain"] == pytest.approx(accuracy["after"] - accuracy["new_model"])
    assert checks["alignment_gain"] + checks["grpo_gain"] == pytest.approx(checks["heldout_accuracy_gain"])
    assert set(checks) >= {"heldout_accuracy_gain_ok", "minutes", "time_ok"}
    assert set(record["stage_seconds"]) == {"load_and_validate_new_model", "alignment", "grpo"}
    assert (tmp_path / "run" / "aligned" / "config.json").is_file()  # stage 1's checkpoint, GRPO's model
    assert (Path(tiny_llava_path) / "config.json").is_file()  # the given model folder is kept
    assert (results / "vision_tiny.png").stat().st_size > 1000
    assert "held-out accuracy (greedy)" in proc.stdout
