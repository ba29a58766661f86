"""One short GPU measurement (< 10 minutes on one H100/H200, offline): our GRPO step on a random Qwen2.5-0.5B-shaped
policy in bf16 and float32, under FSDP2 and FSDP1, against TRL's on the same GPU; tokens/s, peak CUDA memory and the
step's phases, as JSON and a table.

Rows (each a fresh subprocess through ``benchmarks/_harness.py``, the same prompts, P x G completions of at most
``--max-new-tokens`` tokens, one optimizer step per rollout, the first step a warm-up), in the order they run:

* ``hf``: ours, one device, ``precision="bf16-mixed"`` (float32 master weights, bf16 autocast), HF engine;
* ``trl``: TRL ``GRPOTrainer`` on the GPU, ``bf16=True`` (autocast), transformers ``generate`` (the same work);
* ``hf_fp32``: ours, one device, ``precision="32-true"``, HF engine (what bf16 buys);
* ``fsdp2``: ours under ``FSDP2Strategy(mixed_precision="bf16")`` (bf16 compute, float32 master weights and
  reductions), HF engine;
* ``fsdp1``: ours under Lightning's ``FSDPStrategy`` with ``precision="bf16-mixed"``, HF engine;
* ``vllm``: ours, ``bf16-mixed``, colocated vLLM on CUDA (``engine.gpu_memory_utilization``);
* ``vllm_moe_r3``: ours, ``bf16-mixed``, colocated vLLM on CUDA, on a random Qwen3-MoE built from code (4 layers,
  hidden 256, 8 experts of 256, top-2; the tokenizer of ``--model``) with routing replay "R3" and its diagnostics: the
  engine returns each token's experts (vLLM's own ``enable_return_routed_experts`` where Model Runner V2 runs, else
  recorded in its worker; docs/engines.md), the trainer replays them; reported beside the timings:
  ``sampling/router_disagreement``, ``sampling/k3_kl`` and the same without replay;
* ``hf_offload`` (not in the default set): ``hf`` with the layers' inputs offloaded to pinned CPU memory.

A row whose package is not installed is skipped with the reason (``vllm``: a vLLM CUDA build; ``trl``: TRL), and so
is a row that would start after ``--budget`` seconds; each row is abandoned after ``--timeout`` seconds (the vLLM row:
``TIMEOUTS``) and reported as failed.

Reported per row (medians over the measured steps): s/step, generated and trained tokens/s (one GPU), the step's
phases (``timing/*`` of GRPOModule: rollout, scoring, logprobs, sync, forward, backward, optimizer, other; ours only),
peak CUDA memory (``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` over the run and allocated over the
training phases; vLLM's own pool is in ``nvidia-smi``'s figure, not torch's), peak host RSS, and the ratios to TRL.

Model (``--model``): ``random-0.5b`` (default) is built from code by ``benchmarks/_random_model.py`` into the work
folder: nothing is downloaded or carried. Prompts (``--dataset``): the arithmetic task made in code (level 4), or
GSM8K from ``--data-dir``. ``--dry-run`` runs the same code on a CPU in about 40 s of CPU time (``random-tiny``,
the level-1 arithmetic task, 2 x 2 completions of 8 tokens, 2 steps, up to 300 s a row on a busy machine) with every
distribution that the GPU machine would lack hidden (``benchmarks/_packages.py``). Run it with ``benchmarks/gpu.sh``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (  # noqa: E402
    BREAKDOWN_KEYS,
    GIB,
    code_version,
    median,
    resolve_model,
    run_worker,
    write_report,
)

ROWS: dict[str, dict[str, Any]] = {
    "hf": {"trainer": "ours", "engine": "hf", "precision": "bf16-mixed"},
    "trl": {"trainer": "trl", "precision": "bf16-mixed"},
    "hf_fp32": {"trainer": "ours", "engine": "hf", "precision": "32-true"},
    "fsdp2": {"trainer": "ours", "engine": "hf", "precision": "32-true",
              "strategy": {"name": "grpo_fsdp2", "mixed_precision": "bf16"}},
    "fsdp1": {"trainer": "ours", "engine": "hf", "precision": "bf16-mixed", "strategy": {"name": "fsdp"}},
    "vllm": {"trainer": "ours", "engine": "vllm", "precision": "bf16-mixed"},
    "vllm_moe_r3": {"trainer": "ours", "engine": "vllm", "precision": "bf16-mixed", "moe": True,
                    "config": {"routing_replay": "R3", "routing_replay_diagnostics": True}},
    "hf_offload": {"trainer": "ours", "engine": "hf", "precision": "bf16-mixed", "gradient_checkpointing": "offload"},
}
DEFAULT_ROWS = ("hf", "trl", "hf_fp32", "fsdp2", "fsdp1", "vllm", "vllm_moe_r3")
#: The package each row needs beyond the package's own, and how the skip names it.
NEEDS = {"trl": ("trl", "trl"), "vllm": ("vllm", "a vLLM CUDA build"), "vllm_moe_r3": ("vllm", "a vLLM CUDA build")}
#: Rows that need CUDA, and why.
CUDA_ONLY = {"hf_offload": "pinned host memory for the offloaded activations",
             "fsdp1": "Lightning's FSDPStrategy runs on CUDA only"}
#: seconds per row before it is abandoned: vLLM compiles and captures CUDA graphs at start-up
TIMEOUTS = {"vllm": 200.0, "vllm_moe_r3": 200.0}
#: The mismatch metrics a routing-replay row reports (medians over its measured steps).
MISMATCH_KEYS = ("sampling/k3_kl", "sampling/router_disagreement", "sampling/without_replay/k3_kl",
                 "sampling/without_replay/router_disagreement")
#: A row is not started with less than this many seconds of the budget left.
MIN_ROW_S = 30.0
#: What ``--dry-run`` sets (a CPU, the tiny random model, a little work, the GPU machine's packages only).
DRY_RUN = {"accelerator": "cpu", "model": "random-tiny", "dataset": "arithmetic", "prompts_per_step": 2,
           "num_generations": 2, "max_new_tokens": 8, "micro_batch_size": 2, "steps": 2, "timeout": 300,
           "emulate_machine": True}


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma-separated subset of {','.join(ROWS)}")
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run; the first is a warm-up")
    parser.add_argument("--timeout", type=float, default=90,
                        help=f"seconds per row before it is abandoned (the vllm row: {TIMEOUTS['vllm']:g})")
    parser.add_argument("--budget", type=float, default=480,
                        help=f"seconds for the model's build and all rows: a row is not started with under "
                             f"{MIN_ROW_S:g} s of it left, and none runs past it")
    parser.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument("--dataset", default="arithmetic-4", help="'arithmetic-4' (made in code) or 'gsm8k'")
    parser.add_argument("--data-dir", default=None, help="folder holding gsm8k/train.jsonl (--dataset gsm8k)")
    parser.add_argument("--out", default="benchmarks/results/gpu.json")
    parser.add_argument("--model", default="random-0.5b",
                        help="'random-0.5b' or 'random-tiny' (built from code), 'embedded', 'tiny' or a folder")
    parser.add_argument("--accelerator", default="cuda", help="cuda; cpu only to smoke-test this script")
    parser.add_argument("--emulate-machine", action="store_true",
                        help="hide every distribution that the GPU machine lacks and no carried wheel brings")
    parser.add_argument("--dry-run", action="store_true",
                        help="the same code on a CPU (about 40 s of CPU time): " + json.dumps(DRY_RUN))
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args(argv)
    if args.dry_run:
        for key, value in DRY_RUN.items():
            setattr(args, key, value)
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = sorted(set(args.rows) - set(ROWS))
    if unknown:
        parser.error(f"--rows: unknown {unknown}; choose from {', '.join(ROWS)}")
    if args.steps < 2:
        parser.error(f"--steps={args.steps}: the first step is a warm-up, so at least 2")
    return args


def allowed_distributions() -> list[str]:
    """The GPU machine's distributions (and what they require), the carried wheels and this repository."""
    from _packages import allowed_distributions as allowed
    from _packages import carried_wheels, machine_packages

    machine = machine_packages()
    return sorted(allowed(machine, carried_wheels(machine=machine)))


def skip_reason(row: str, args: argparse.Namespace) -> Optional[str]:
    """Why ``row`` cannot run here, or None."""
    module, what = NEEDS.get(row, (None, None))
    if module is not None and importlib.util.find_spec(module) is None:
        return f"skipped: needs {what}, not installed on this machine"
    if row in CUDA_ONLY and args.accelerator != "cuda":
        return f"skipped: needs CUDA ({CUDA_ONLY[row]})"
    return None


def build_model(args: argparse.Namespace, workdir: str) -> dict[str, Any]:
    """The policy's folder and what it is: a random model built from code, or :func:`_harness.resolve_model`'s."""
    from _random_model import SIZES, save_random_model

    if args.model in SIZES:
        started = time.perf_counter()
        info = save_random_model(os.path.join(workdir, args.model), args.model)
        return {**info, "build_s": time.perf_counter() - started}
    return {"path": resolve_model(args.model, workdir), "size": args.model}


def build_moe_model(tokenizer_path: str, workdir: str) -> dict[str, Any]:
    """The ``vllm_moe_r3`` row's policy: a random Qwen3-MoE (4 layers, hidden 256, 4 heads of 64, 2 KV heads, 8
    experts of 256, top-2, routers N(0, 1): :func:`lightning_grpo.demos.tiny_models.save_tiny_moe`) with the
    tokenizer at ``tokenizer_path``."""
    from lightning_grpo.demos.tiny_models import save_tiny_moe

    started = time.perf_counter()
    path = save_tiny_moe(os.path.join(workdir, "random-moe"), tokenizer_path, "qwen3_moe", hidden_size=256,
                         expert_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         num_experts=8, top_k=2)
    return {"path": path, "family": "qwen3_moe", "build_s": time.perf_counter() - started}


def spec_for(args: argparse.Namespace, row: str, model_path: str, workdir: str,
             allowed: Optional[list[str]]) -> dict:
    n = args.prompts_per_step * args.num_generations
    return {
        **ROWS[row],
        "accelerator": args.accelerator,
        "dtype": "float32",  # master weights; compute in bf16 (autocast / FSDP mixed precision) or float32
        "model_path": model_path,
        "dataset": args.dataset,
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
        "config": {**ROWS[row].get("config", {}), "engine.gpu_memory_utilization": args.vllm_gpu_memory_utilization},
        "workdir": workdir,
        "allowed_distributions": allowed,
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
        "generated_tokens_per_s": rate("generated_tokens"),
        "train_tokens_per_s": rate("train_tokens"),
        "phases_s": {key.removeprefix("timing/"): median([r["metrics"].get(key) for r in rows])
                     for key in BREAKDOWN_KEYS},
        "cuda_peak_allocated_gib": gib(result.get("cuda_max_allocated_bytes")),
        "cuda_peak_reserved_gib": gib(result.get("cuda_max_reserved_bytes")),
        "cuda_train_peak_allocated_gib": gib(result.get("cuda_train_peak_bytes")),
        "host_peak_rss_gib": gib(result.get("peak_rss_bytes")),
        "startup_s": result["steps"][0]["end_s"] if result["steps"] else None,
        **({"mismatch": {key: median([r["metrics"].get(key) for r in rows]) for key in MISMATCH_KEYS}}
           if any("sampling/router_disagreement" in r["metrics"] for r in rows) else {}),
    }


def table(summaries: dict[str, dict], outcomes: dict[str, str]) -> str:
    """The report's rows as a fixed-width text table (figures, or the row's outcome)."""

    def cell(value: Optional[float], digits: int = 2) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    header = (f"{'row':<11}{'s/step':>8}{'gen tok/s':>11}{'train tok/s':>13}{'CUDA GiB':>10}{'train GiB':>11}"
              f"{'rollout s':>11}{'fwd+bwd s':>11}")
    lines = [header]
    for row, outcome in outcomes.items():
        s = summaries.get(row)
        if s is None:
            lines.append(f"{row:<11}{outcome}")
            continue
        phases = s["phases_s"]
        fwd_bwd = None if phases["forward_s"] is None else phases["forward_s"] + (phases["backward_s"] or 0.0)
        lines.append(f"{row:<11}{cell(s['step_s']):>8}{cell(s['generated_tokens_per_s'], 0):>11}"
                     f"{cell(s['train_tokens_per_s'], 0):>13}{cell(s['cuda_peak_allocated_gib']):>10}"
                     f"{cell(s['cuda_train_peak_allocated_gib']):>11}{cell(phases['rollout_s']):>11}"
                     f"{cell(fwd_bwd):>11}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    allowed = allowed_distributions()
    hidden: list[str] = []
    if args.emulate_machine:
        from _packages import hide_others

        hidden = hide_others(set(allowed))
        print(f"emulating the GPU machine's packages: {len(hidden)} installed modules hidden", flush=True)
    workdir = args.workdir or tempfile.mkdtemp(prefix="gpu_bench_")
    os.makedirs(workdir, exist_ok=True)
    model = build_model(args, workdir)
    print(f"model: {json.dumps(model)}", flush=True)
    deadline = started + args.budget  # the model's build counts
    summaries: dict[str, dict] = {}
    outcomes: dict[str, str] = {}
    failures: dict[str, str] = {}
    raw: dict[str, dict] = {}
    for row in args.rows:
        remaining = deadline - time.perf_counter()
        reason = skip_reason(row, args)
        if reason is None and remaining < MIN_ROW_S:
            reason = f"skipped: the {args.budget:g} s budget is spent ({remaining:.0f} s left)"
        if reason is not None:
            outcomes[row] = reason
            print(f"{row}: {reason}", flush=True)
            continue
        print(f"running {row} ...", flush=True)
        try:
            timeout = min(max(args.timeout, TIMEOUTS.get(row, 0.0)), remaining)
            if ROWS[row].get("moe") and "moe" not in model:
                model["moe"] = build_moe_model(model["path"], workdir)
            path = model["moe"]["path"] if ROWS[row].get("moe") else model["path"]
            spec = spec_for(args, row, path, workdir, allowed if args.emulate_machine else None)
            result = run_worker(spec, workdir, row, timeout=timeout)
        except Exception as error:  # noqa: BLE001 - a failed row is reported, the others still run
            failures[row] = f"{type(error).__name__}: {str(error)[-2000:]}"
            last = [line for line in str(error).splitlines() if line.strip()][-1:] or [type(error).__name__]
            outcomes[row] = f"failed: {last[0][:200]}"
            print(f"  failed: {failures[row][:300]}", flush=True)
            continue
        raw[row] = result
        summaries[row] = summarize(result)
        outcomes[row] = "ok"
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
    from _packages import carried_wheels, imported_modules, missing_here, outside

    wheels = carried_wheels()
    imported = imported_modules()  # this process's (the model's build), then every row's
    for result in raw.values():
        imported.update(result["imported_modules"])
    import torch

    report = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("workdir",)},
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "code": code_version(),
        "model": model,
        "outcomes": outcomes,
        "summary": summaries,
        "ours_vs_trl": ratios,
        "failures": failures,
        "distributions_imported": sorted({name for names in imported.values() for name in names}),
        # the rows' imports that the GPU machine and the carried wheels cannot satisfy (none, or the run fails there)
        "imports_outside_the_gpu_machine": outside(imported, set(allowed)),
        "hidden_modules": len(hidden),
        # the carried distributions installed here in another version than benchmarks/gpu_wheels.txt's (None: absent)
        "carried_versions_differ": missing_here(wheels),
        "wall_s": time.perf_counter() - started,
        "runs": raw,
    }
    print("\n" + table(summaries, outcomes), flush=True)
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
