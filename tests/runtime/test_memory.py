"""The memory a process may still use and the peak a piece of work reaches (:mod:`lightning_grpo.runtime.memory`,
what ``max_tokens_per_microbatch="auto"`` measures with): the peak meter sees a known allocation."""

import os
import subprocess
import sys

from lightning_grpo.runtime import memory

# a fresh interpreter with torch and runtime/memory.py only (the package's imports take seconds)
PEAK_PROBE = """
import importlib.util, sys
import torch
spec = importlib.util.spec_from_file_location("memory", sys.argv[1])
memory = sys.modules["memory"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(memory)
PeakMeter, available_memory = memory.PeakMeter, memory.available_memory
meter = PeakMeter(torch.device("cpu"))
assert available_memory(torch.device("cpu")).bytes > 0
meter.reset()
block = torch.ones(300 * 2**20 // 4)  # 300 MiB, written
del block
print(meter.peak())
"""


def test_peak_meter_sees_a_known_allocation():
    # In a fresh process of one thread: in the test session, other threads (engines, pools of earlier tests) may free
    # resident memory between reset and peak, which would lower the peak above the reset's baseline.
    proc = subprocess.run([sys.executable, "-c", PEAK_PROBE, memory.__file__], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr
    peak = int(proc.stdout.split()[-1])
    assert 300 * 2**20 <= peak < 400 * 2**20, peak
