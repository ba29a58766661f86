"""``benchmarks/lora.py --tiny``: the LoRA vs full fine-tuning benchmark runs end to end and reports both trainers.

Timings are not asserted (they depend on the machine); the trainable-parameter counts are, worked by hand.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a whole benchmark run in a subprocess

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "lora.py"
#: The harness's tiny Llama (hidden 128, 2 heads and 2 KV heads of 64, MLP 256, 2 layers, tied embeddings, vocabulary
#: 49152): embeddings 49152 * 128 = 6291456; per layer q, k, v, o 4 * 128 * 128 = 65536, gate, up, down
#: 3 * 128 * 256 = 98304, 2 norms 256; final norm 128.
FULL = 49152 * 128 + 2 * (4 * 128 * 128 + 3 * 128 * 256 + 2 * 128) + 128
#: --tiny's LoRA (r = 4 on the 7 linear layers of each block): r * (in + out) per layer.
LORA = 2 * 4 * (4 * (128 + 128) + 3 * (128 + 256))


def test_tiny_lora_benchmark_reports_both_trainers(tmp_path):
    out = tmp_path / "lora.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--tiny", "--threads", "1", "--out", str(out),
                           "--workdir", str(tmp_path / "work")], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    full, lora = report["trainers"]["full"], report["trainers"]["lora"]
    assert (full["trainable_params"], lora["trainable_params"]) == (FULL, LORA) == (6619776, 17408)
    for summary in (full, lora):
        assert summary["measured_steps"] == 1 and summary["step_s"] > 0 and summary["peak_rss_gib"] > 0.1
        assert summary["timing/optimizer_s"] is not None and summary["generated_tokens"] > 0
    assert [len(runs) for runs in report["runs"].values()] == [1, 1]
    assert "LoRA / full: peak RSS x" in proc.stdout
