"""How lightning_grpo's step time grows with G, max_new_tokens and prompts per step.

From a base point (default P=2 prompts, G=4 generations, 64 new tokens) one setting is varied at a time
(G in ``--g-values``, max_new_tokens in ``--token-values``, P in ``--prompt-values``); every distinct point is
one training run of ``--steps`` optimizer steps in its own subprocess (the first step is a warm-up). The
table shows, per point, the median step time (wall time between consecutive optimizer-step ends), the
generated tokens per step (completion tokens up to and including EOS, as counted, not assumed), the trained
tokens per step (prompt + completion, no padding) and the seconds per 1,000 generated tokens. If cost is
linear in generated tokens, that last column stays roughly flat across the table, and the least-squares line
``step_s = a + b * generated_tokens`` (printed below the table) fits with R^2 close to 1.

The default model is a tiny random Llama (SmolLM2 tokenizer): it almost never samples EOS, so every
completion runs to max_new_tokens and the generated-token count is set by the grid, not by the model.
With ``--model embedded`` (SmolLM2-135M-Instruct) lengths vary with what the model writes.

Run::

    python benchmarks/scaling.py [--engine hf|vllm] [--model tiny|embedded|DIR] [--steps 4] [--out scaling.json]

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


def int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="tiny",
                        help="'tiny' (random 2-layer Llama), 'embedded' (SmolLM2-135M-Instruct) or a model folder")
    parser.add_argument("--engine", default="hf", choices=("hf", "vllm"), help="rollout engine")
    parser.add_argument("--base-prompts", type=int, default=2, help="P of the base point")
    parser.add_argument("--base-g", type=int, default=4, help="G of the base point")
    parser.add_argument("--base-tokens", type=int, default=64, help="max_new_tokens of the base point")
    parser.add_argument("--g-values", type=int_list, default=[2, 4, 8], help="G values (P, tokens at base)")
    parser.add_argument("--token-values", type=int_list, default=[32, 64, 128], help="max_new_tokens values")
    parser.add_argument("--prompt-values", type=int_list, default=[1, 2, 4], help="prompts-per-step values")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run; the first is a warm-up")
    parser.add_argument("--rounds", type=int, default=1, help="runs per point (the grid is walked once per round)")
    parser.add_argument("--micro-batch-size", type=int, default=8,
                        help="sequences per forward/backward (capped at P*G, lowered to a divisor of P*G)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (top-p 1, top-k off)")
    parser.add_argument("--learning-rate", type=float, default=1e-6, help="AdamW learning rate (constant)")
    parser.add_argument("--loss-type", default="grpo", help="GRPOConfig.loss_type")
    parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient (> 0 loads a reference model)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompt order and each trainer")
    parser.add_argument("--padding-free", action=argparse.BooleanOptionalAction, default=None,
                        help="GRPOConfig.padding_free (when the field exists; default: its default)")
    parser.add_argument("--max-tokens-per-microbatch", type=int, default=None,
                        help="GRPOConfig.max_tokens_per_microbatch (when the field exists)")
    parser.add_argument("--kv-cache-gib", type=int, default=2, help="vLLM CPU KV cache")
    parser.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads per run (default: torch's)")
    parser.add_argument("--data-dir", default=None, help="folder holding gsm8k/train.jsonl")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--workdir", default=None, help="keep worker specs/logs/results here (default: a temp dir)")
    parser.add_argument("--verbose", action="store_true", help="stream the workers' output")
    args = parser.parse_args(argv)
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is a warm-up)")
    return args


def grid(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The points (P, G, T) to run, base first, each tagged with the setting(s) it varies."""
    base = (args.base_prompts, args.base_g, args.base_tokens)
    points: dict[tuple[int, int, int], list[str]] = {base: ["base"]}
    for name, values, index in (("G", args.g_values, 1), ("max_new_tokens", args.token_values, 2),
                                ("P", args.prompt_values, 0)):
        for value in values:
            point = list(base)
            point[index] = value
            points.setdefault(tuple(point), []).append(name)
    return [{"P": p, "G": g, "T": t, "varies": tags} for (p, g, t), tags in points.items()]


def spec_for(args: argparse.Namespace, point: dict, model_path: str, workdir: str) -> dict:
    n = point["P"] * point["G"]
    micro = min(args.micro_batch_size, n)
    while n % micro:  # the largest micro-batch size <= the requested one that divides P*G
        micro -= 1
    return {
        "trainer": "ours", "engine": args.engine, "model_path": model_path, "data_dir": args.data_dir,
        "prompts_per_step": point["P"], "num_generations": point["G"], "max_new_tokens": point["T"],
        "temperature": args.temperature, "learning_rate": args.learning_rate, "loss_type": args.loss_type,
        "beta": args.beta, "seed": args.seed, "steps": args.steps, "micro_batch_size": micro,
        "padding_free": args.padding_free, "max_tokens_per_microbatch": args.max_tokens_per_microbatch,
        "kv_cache_gib": args.kv_cache_gib, "threads": args.threads, "workdir": workdir,
    }


def summarize_point(point: dict, results: list[dict]) -> dict:
    """Medians over the measured steps of a point's runs."""
    rows = [row for r in results for row in r["steps"] if row["interval_s"] is not None]
    step_s = median([row["interval_s"] for row in rows])
    generated = median([row["generated_tokens"] for row in rows])
    return {
        **point,
        "sequences": point["P"] * point["G"],
        "micro_batch_size": results[0]["spec_micro_batch_size"],
        "measured_steps": len(rows),
        "step_s": step_s,
        "generated_tokens": generated,
        "train_tokens": median([row["train_tokens"] for row in rows]),
        "s_per_1k_generated": median([1000.0 * row["interval_s"] / row["generated_tokens"] for row in rows
                                      if row["generated_tokens"]]),
        "rollout_s": median([row["metrics"].get("timing/rollout_s") for row in rows]),
        "peak_rss_gib": max(r["peak_rss_bytes"] for r in results) / GIB,
    }


def linear_fit(points: list[dict]) -> Optional[dict]:
    """Least-squares ``step_s = a + b * generated_tokens`` over the points, with R^2 (None for < 2 points)."""
    xs = [p["generated_tokens"] for p in points if p["step_s"] is not None and p["generated_tokens"] is not None]
    ys = [p["step_s"] for p in points if p["step_s"] is not None and p["generated_tokens"] is not None]
    if len(xs) < 2 or len(set(xs)) < 2:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - b * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys, strict=True))
    return {"intercept_s": a, "s_per_1k_generated": 1000.0 * b, "r2": 1.0 - ss_res / ss_tot if ss_tot else 1.0}


def fmt(value: Optional[float], spec: str) -> str:
    return "n/a" if value is None else f"{value:{spec}}"


def print_table(rows: list[dict], fit: Optional[dict]) -> None:
    header = (f"{'varies':22s} {'P':>3s} {'G':>3s} {'max_new':>7s} {'seqs':>4s} {'micro':>5s} {'s/step':>8s} "
              f"{'gen tok':>8s} {'train tok':>9s} {'s/1k gen':>8s} {'rollout s':>9s} {'peak RSS':>9s}")
    print()
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{','.join(r['varies']):22s} {r['P']:3d} {r['G']:3d} {r['T']:7d} {r['sequences']:4d} "
              f"{r['micro_batch_size']:5d} {fmt(r['step_s'], '.3f'):>8s} {fmt(r['generated_tokens'], '.0f'):>8s} "
              f"{fmt(r['train_tokens'], '.0f'):>9s} {fmt(r['s_per_1k_generated'], '.3f'):>8s} "
              f"{fmt(r['rollout_s'], '.3f'):>9s} {fmt(r['peak_rss_gib'], '.2f'):>5s} GiB")
    if fit:
        print(f"\nleast squares over the points: step_s = {fit['intercept_s']:.3f} + "
              f"{fit['s_per_1k_generated']:.3f} * generated_tokens / 1000   (R^2 = {fit['r2']:.3f})")


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="scaling_")
    os.makedirs(workdir, exist_ok=True)
    model_path = resolve_model(args.model, workdir)
    points = grid(args)
    print(f"model {model_path}; engine {args.engine}; {len(points)} points x {args.rounds} round(s); "
          f"workdir {workdir}", flush=True)
    results: list[list[dict]] = [[] for _ in points]
    for round_index in range(args.rounds):
        for i, point in enumerate(points):
            label = f"P{point['P']}_G{point['G']}_T{point['T']}_round{round_index + 1}"
            print(f"running {label} ...", flush=True)
            spec = spec_for(args, point, model_path, workdir)
            result = run_worker(spec, workdir, label, verbose=args.verbose)
            result["spec_micro_batch_size"] = spec["micro_batch_size"]
            print(f"  {describe_run(result)}", flush=True)
            results[i].append(result)
    rows = [summarize_point(point, runs) for point, runs in zip(points, results, strict=True)]
    fit = linear_fit(rows)
    print(f"\nmodel {args.model}, engine {args.engine}, {args.steps} steps per run (first = warm-up), "
          f"medians over {args.rounds} round(s)")
    print_table(rows, fit)
    report = {"settings": {k: v for k, v in vars(args).items() if k not in ("out", "workdir", "verbose")},
              "cpus": os.cpu_count(), "points": rows, "fit": fit,
              "versions": results[0][0].get("versions", {}), "runs": results}
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
