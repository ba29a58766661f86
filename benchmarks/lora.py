"""LoRA vs full fine-tuning: peak memory and step time of lightning_grpo on the same rollout settings.

Both trainers are ``GRPOModule`` with the HF engine on the same model, the same prompt batches (GSM8K train, the
datamodule's seeded order), the same sampling, seed, micro-batches, KL coefficient and learning rate; they differ
only in ``lora``: None (every weight trained, AdamW state for all of them, a deep-copied reference policy when
``--beta > 0``) or a ``peft.LoraConfig`` (adapters trained, the reference is the base with the adapters off).
Each run is a fresh subprocess (``benchmarks/_harness.py``) doing ``--steps`` optimizer steps, the first a
warm-up; runs alternate full, LoRA, LoRA, full, ... over ``--rounds`` rounds (each round swaps the order), so a
drift of the machine hits both alike.

Printed per trainer: trainable parameters, median s/step (wall time between consecutive optimizer-step ends:
rollout, scoring, logprob passes, forward, backward, optimizer), median generated tokens per step (sampling
differs once the weights differ, so compare s per 1k generated tokens too), the medians of the forward / backward
/ optimizer / logprob timings, and the peak RSS of the process (``ru_maxrss``; the maximum over rounds); then the
ratios LoRA / full.

Run::

    python benchmarks/lora.py --out benchmarks/results/lora_smollm2.json      # SmolLM2-135M-Instruct (minutes)
    python benchmarks/lora.py --tiny                                            # smoke test, tiny random Llama

Timings depend on the machine and its load; run it on a quiet machine. Nothing here asserts on them.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import GIB, describe_run, median, resolve_model, run_worker, write_report  # noqa: E402

#: Every linear layer of a Llama block (the usual "all-linear" LoRA targets).
ALL_LINEAR = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
#: ``timing/*`` metrics shown (medians over the measured steps).
TIMINGS = ("timing/rollout_s", "timing/logprobs_s", "timing/forward_s", "timing/backward_s", "timing/optimizer_s")
#: ``--tiny``: the smoke-test settings (tiny random Llama, 1 prompt x 2 completions x 8 tokens, 2 steps, 1 round).
TINY = dict(model="tiny", steps=2, rounds=1, prompts_per_step=1, num_generations=2, max_new_tokens=8,
            micro_batch_size=2, lora_r=4, lora_alpha=8)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="embedded",
                        help="'embedded' (SmolLM2-135M-Instruct), 'tiny' (random 2-layer Llama) or a model folder")
    parser.add_argument("--tiny", action="store_true", help=f"smoke test: {TINY}")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run; the first is a warm-up")
    parser.add_argument("--rounds", type=int, default=2, help="runs per trainer (alternating full / LoRA)")
    parser.add_argument("--prompts-per-step", type=int, default=4, help="prompts per rollout (P)")
    parser.add_argument("--num-generations", type=int, default=4, help="completions per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="completion length limit")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="sequences per forward/backward")
    parser.add_argument("--lora-r", type=int, default=16, help="LoRA rank r")
    parser.add_argument("--lora-alpha", type=int, default=32, help="LoRA alpha (scaling alpha / r)")
    parser.add_argument("--target-modules", default=ALL_LINEAR, help="comma-separated LoRA target module names")
    parser.add_argument("--beta", type=float, default=0.04,
                        help="KL coefficient; > 0: full fine-tuning holds a reference copy, LoRA does not")
    parser.add_argument("--learning-rate", type=float, default=1e-6, help="AdamW learning rate (both trainers)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (top-p 1, top-k off)")
    parser.add_argument("--loss-type", default="grpo", help="GRPOConfig.loss_type")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompt order and each trainer")
    parser.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads per run (default: torch's)")
    parser.add_argument("--data-dir", default=None, help="folder holding gsm8k/train.jsonl")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--workdir", default=None, help="keep worker specs/logs/results here (default: a temp dir)")
    parser.add_argument("--verbose", action="store_true", help="stream the workers' output")
    args = parser.parse_args(argv)
    if args.tiny:
        for name, value in TINY.items():
            setattr(args, name, value)
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is a warm-up)")
    n = args.prompts_per_step * args.num_generations
    if n % args.micro_batch_size:
        parser.error(f"--micro-batch-size {args.micro_batch_size} must divide P x G = {n}")
    return args


def spec_for(args: argparse.Namespace, model_path: str, workdir: str, lora: Optional[dict]) -> dict:
    return {
        "trainer": "ours", "engine": "hf", "model_path": model_path, "data_dir": args.data_dir,
        "prompts_per_step": args.prompts_per_step, "num_generations": args.num_generations,
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "learning_rate": args.learning_rate,
        "loss_type": args.loss_type, "beta": args.beta, "seed": args.seed, "steps": args.steps,
        "micro_batch_size": args.micro_batch_size, "kv_cache_gib": 1, "threads": args.threads, "workdir": workdir,
        "lora": lora,
    }


def summarize(results: list[dict]) -> dict[str, Any]:
    """Medians over the measured steps of a trainer's runs; peak RSS: the maximum over its runs."""
    rows = [row for r in results for row in r["steps"] if row["interval_s"] is not None]
    summary = {
        "trainable_params": results[0]["trainable_params"],
        "measured_steps": len(rows),
        "step_s": median([row["interval_s"] for row in rows]),
        "generated_tokens": median([row["generated_tokens"] for row in rows]),
        "s_per_1k_generated": median([1000.0 * row["interval_s"] / row["generated_tokens"] for row in rows
                                      if row["generated_tokens"]]),
        "peak_rss_gib": max(r["peak_rss_bytes"] for r in results) / GIB,
    }
    for key in TIMINGS:
        summary[key] = median([row["metrics"].get(key) for row in rows])
    return summary


def _fmt(value: Optional[float], spec: str) -> str:
    return "n/a" if value is None else f"{value:{spec}}"


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or not b else a / b


def print_table(summaries: dict[str, dict]) -> None:
    names = ("trainable", "s/step", "gen tok", "s/1k gen") + tuple(k.split("/")[1] for k in TIMINGS) + ("peak RSS",)
    print("\n" + f"{'trainer':8s}" + "".join(f"{n:>13s}" for n in names))
    for name, s in summaries.items():
        cells = [f"{s['trainable_params']:,}", _fmt(s["step_s"], ".3f"), _fmt(s["generated_tokens"], ".0f"),
                 _fmt(s["s_per_1k_generated"], ".3f")] + [_fmt(s[k], ".3f") for k in TIMINGS]
        cells.append(f"{s['peak_rss_gib']:.2f} GiB")
        print(f"{name:8s}" + "".join(f"{c:>13s}" for c in cells))
    full, lora = summaries["full"], summaries["lora"]
    print(f"\nLoRA / full: peak RSS x{_fmt(_ratio(lora['peak_rss_gib'], full['peak_rss_gib']), '.2f')}, "
          f"s/step x{_fmt(_ratio(lora['step_s'], full['step_s']), '.2f')}, "
          f"s per 1k generated tokens x{_fmt(_ratio(lora['s_per_1k_generated'], full['s_per_1k_generated']), '.2f')}, "
          f"trainable parameters x{lora['trainable_params'] / full['trainable_params']:.4f}")


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="lora_bench_")
    os.makedirs(workdir, exist_ok=True)
    model_path = resolve_model(args.model, workdir)
    lora = {"r": args.lora_r, "lora_alpha": args.lora_alpha, "lora_dropout": 0.0,
            "target_modules": [m.strip() for m in args.target_modules.split(",") if m.strip()]}
    trainers = {"full": None, "lora": lora}
    print(f"model {model_path}; {args.rounds} round(s) x 2 trainers; workdir {workdir}", flush=True)
    results: dict[str, list[dict]] = {name: [] for name in trainers}
    for round_index in range(args.rounds):
        order = list(trainers) if round_index % 2 == 0 else list(reversed(trainers))
        for name in order:
            label = f"{name}_round{round_index + 1}"
            print(f"running {label} ...", flush=True)
            result = run_worker(spec_for(args, model_path, workdir, trainers[name]), workdir, label,
                                verbose=args.verbose)
            print(f"  {describe_run(result)}", flush=True)
            results[name].append(result)
    summaries = {name: summarize(runs) for name, runs in results.items()}
    print(f"\nmodel {args.model}, P={args.prompts_per_step} G={args.num_generations} "
          f"max_new_tokens={args.max_new_tokens}, beta={args.beta}, {args.steps} steps per run (first = warm-up), "
          f"LoRA r={args.lora_r} alpha={args.lora_alpha} on {','.join(lora['target_modules'])}")
    print_table(summaries)
    report = {"settings": {k: v for k, v in vars(args).items() if k not in ("out", "workdir", "verbose")},
              "cpus": os.cpu_count(), "trainers": summaries, "lora": lora,
              "versions": results["full"][0].get("versions", {}), "runs": results}
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
