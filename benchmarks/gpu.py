"""One short GPU measurement (< 10 minutes on one H100/H200, offline, the embedded SmolLM2-135M-Instruct): our GRPO
step in its GPU configurations against TRL's on the same GPU, tokens/s per GPU and peak memory, as JSON.

Rows (each a fresh subprocess through ``benchmarks/_harness.py``, the same GSM8K prompts, P x G completions of at
most ``--max-new-tokens`` tokens, one optimizer step per rollout, the first step a warm-up):

* ``trl``: TRL ``GRPOTrainer`` on the GPU, ``bf16=True`` (autocast), transformers ``generate``;
* ``hf``: ours, one device, ``precision="bf16-mixed"``, HF engine (the same work as ``trl``);
* ``vllm``: ours, one device, ``bf16-mixed``, colocated vLLM on CUDA (``engine.gpu_memory_utilization``);
* ``fsdp2``: ours under ``FSDP2Strategy(mixed_precision="bf16")`` (bf16 compute, float32 master weights and
  reductions), HF engine;
* ``fsdp1``: ours under Lightning's ``FSDPStrategy`` with ``precision="bf16-mixed"``, HF engine.

Reported per row (medians over the measured steps): s/step, generated and trained tokens/s (per GPU: one GPU),
peak CUDA memory (``torch.cuda.max_memory_allocated`` over the run and over the training phases; vLLM's own pool
is in ``nvidia-smi``'s figure, not torch's, and is reported as its configured share), peak host RSS, and the
ratios to TRL. Run with ``benchmarks/gpu.sh``; nothing is downloaded (the machine needs torch with CUDA, vLLM built
for CUDA, ``trl==1.16.0`` and the embedded model in the package cache: ``lightning-grpo-model`` prints it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import GIB, code_version, median, resolve_model, run_worker, write_report  # noqa: E402

ROWS: dict[str, dict[str, Any]] = {
    "trl": {"trainer": "trl", "precision": "bf16-mixed"},
    "hf": {"trainer": "ours", "engine": "hf", "precision": "bf16-mixed"},
    "vllm": {"trainer": "ours", "engine": "vllm", "precision": "bf16-mixed"},
    "fsdp2": {"trainer": "ours", "engine": "hf", "precision": "32-true",
              "strategy": {"name": "grpo_fsdp2", "mixed_precision": "bf16"}},
    "fsdp1": {"trainer": "ours", "engine": "hf", "precision": "bf16-mixed", "strategy": {"name": "fsdp"}},
    # not in the default set: checkpointing with the layers' inputs offloaded to pinned CPU memory
    "hf_offload": {"trainer": "ours", "engine": "hf", "precision": "bf16-mixed", "gradient_checkpointing": "offload"},
}
DEFAULT_ROWS = ("trl", "hf", "vllm", "fsdp2", "fsdp1")
#: seconds per row before it is abandoned: vLLM compiles and captures CUDA graphs at start-up
TIMEOUTS = {"vllm": 200.0}


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma-separated subset of {','.join(ROWS)}")
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run; the first is a warm-up")
    parser.add_argument("--timeout", type=float, default=90,
                        help=f"seconds per run before it is abandoned (the vllm row: {TIMEOUTS['vllm']:g})")
    parser.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--data-dir", default=None, help="folder holding gsm8k/train.jsonl")
    parser.add_argument("--out", default="benchmarks/results/gpu.json")
    parser.add_argument("--model", default="embedded", help="'embedded', 'tiny' or a folder (smoke tests: tiny)")
    parser.add_argument("--accelerator", default="cuda", help="cuda; cpu only to smoke-test this script")
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(args.rows) - set(ROWS))
    if unknown:
        parser.error(f"--rows: unknown {unknown}; choose from {', '.join(ROWS)}")
    return args


def spec_for(args: argparse.Namespace, row: str, model_path: str, workdir: str) -> dict:
    n = args.prompts_per_step * args.num_generations
    return {
        **ROWS[row],
        "accelerator": args.accelerator,
        "dtype": "float32",  # master weights; compute in bf16 (autocast / FSDP mixed precision)
        "model_path": model_path,
        "data_dir": args.data_dir,
        "prompts_per_step": args.prompts_per_step,
        "num_generations": args.num_generations,
        "max_new_tokens": args.max_new_tokens,
        "temperature": 1.0,
        "learning_rate": 1e-6,
        "loss_type": "grpo",
        "beta": 0.0,
        "seed": 0,
        "steps": args.steps,
        "micro_batch_size": min(args.micro_batch_size, n),
        "config": {"engine.gpu_memory_utilization": args.vllm_gpu_memory_utilization},
        "workdir": workdir,
    }


def summarize(result: dict) -> dict[str, Any]:
    rows = [r for r in result["steps"] if r["interval_s"] is not None]

    def rate(key: str) -> Optional[float]:
        return median([r[key] / r["interval_s"] for r in rows if r[key] is not None])

    def gib(value: Any) -> Optional[float]:
        return None if not value else value / GIB

    return {
        "measured_steps": len(rows),
        "step_s": median([r["interval_s"] for r in rows]),
        "generated_tokens_per_s_per_gpu": rate("generated_tokens"),
        "train_tokens_per_s_per_gpu": rate("train_tokens"),
        "cuda_peak_allocated_gib": gib(result.get("cuda_max_allocated_bytes")),
        "cuda_peak_reserved_gib": gib(result.get("cuda_max_reserved_bytes")),
        "cuda_train_peak_allocated_gib": gib(result.get("cuda_train_peak_bytes")),
        "host_peak_rss_gib": gib(result.get("peak_rss_bytes")),
        "startup_s": result["steps"][0]["end_s"] if result["steps"] else None,
    }


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="gpu_bench_")
    os.makedirs(workdir, exist_ok=True)
    model_path = resolve_model(args.model, workdir)
    started = time.perf_counter()
    summaries: dict[str, dict] = {}
    failures: dict[str, str] = {}
    raw: dict[str, dict] = {}
    for row in args.rows:
        print(f"running {row} ...", flush=True)
        try:
            timeout = max(args.timeout, TIMEOUTS.get(row, 0.0))
            result = run_worker(spec_for(args, row, model_path, workdir), workdir, row, timeout=timeout)
        except Exception as error:  # noqa: BLE001 - a failed row is reported, the others still run
            failures[row] = f"{type(error).__name__}: {str(error)[-2000:]}"
            print(f"  failed: {failures[row][:300]}", flush=True)
            continue
        raw[row] = result
        summaries[row] = summarize(result)
        print(f"  {json.dumps(summaries[row])}", flush=True)
    trl = summaries.get("trl")
    ratios = {}
    if trl:
        for row, s in summaries.items():
            if row != "trl" and s["step_s"] and trl["step_s"]:
                ratios[row] = {
                    "speedup_steps_per_s": trl["step_s"] / s["step_s"],
                    "cuda_peak": (s["cuda_peak_allocated_gib"] / trl["cuda_peak_allocated_gib"]
                                  if s["cuda_peak_allocated_gib"] and trl["cuda_peak_allocated_gib"] else None),
                }
    import torch

    report = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("workdir",)},
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "code": code_version(),
        "summary": summaries,
        "ours_vs_trl": ratios,
        "failures": failures,
        "wall_s": time.perf_counter() - started,
        "runs": raw,
    }
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
