"""The sampler-trainer mismatch of a mixture-of-experts policy with and without routing replay (issue 43, item 5): a
tiny random MoE trained by GRPO on the arithmetic task on this CPU, rollouts from the colocated vLLM engine.

    python benchmarks/moe.py --engine-dtype bfloat16 --name bf16     # the record: vLLM in bf16, the trainer in fp32
    python benchmarks/moe.py --toy                                    # 2 steps of everything (a check, not a record)

Runs, in one invocation, each a fresh subprocess from the same model, prompts and seed, their order alternating
between rounds (``--rounds``) so that a drift of the machine hits them alike:

* ``off``: ``routing_replay="off"``: the trainer routes every token itself;
* ``R3``: ``routing_replay="R3"`` with ``routing_replay_diagnostics``: the trainer replays the experts the vLLM engine
  recorded for each token, and one more no-grad pass per rollout measures what the mismatch would be without replay
  on the same rollout (``sampling/without_replay/*``);
* ``R3-plain`` (``--runs``): "R3" without the diagnostics' extra pass: what replay itself costs in step time.

Per step and run (side by side in the JSON and the plot): ``sampling/k3_kl`` and ``sampling/sampling_logp_difference/
mean`` (sampler vs trainer on the rollout's tokens, the trainer replaying under R3), the mismatch ratio's percentiles
(``sampling/mismatch_ratio/*``: ``pi_trainer / pi_sampler`` per token), ``sampling/router_disagreement`` (R3: the share
of (token, MoE layer) pairs whose trainer router would choose other experts than the sampler's) and the R3 run's
``sampling/without_replay/*``, the reward, and the step time (wall time between consecutive optimizer-step ends; the
first step is a warm-up). Summary: the medians over the measured steps, the paired ratio ``k3 with replay / k3
without replay`` on the R3 run's rollouts (the acceptance: at most 0.1), the off run's k3 beside it, and the step time
of each run against ``off``.

Why ``--engine-dtype bfloat16``: with the engine in float32 (the default on CPU) its routing is the trainer's up to
float32 rounding, which flips no router at the tiny model's logit gaps (``tests/rollout/engines/vllm/test_vllm_moe.py``:
0 flips, sampler logprobs equal to 1e-6): there is no mismatch for replay to remove. A bf16 engine (the trainer in
float32) moves the routers' logits by ~1e-2 and flips the near ties, as a GPU engine in bf16 does against an fp32
trainer; ``--router-std`` (the routers' initial scale; smaller: more near ties) sets how often.

Model: :func:`lightning_grpo.demos.tiny_models.save_tiny_moe` (``--family``, ``--hidden-size``, ``--layers``,
``--experts``, ``--top-k``; SmolLM2's tokenizer cut to 2,048 tokens), its routers redrawn N(0, ``--router-std``).
Reward: the share of digits in the completion (a signal a random model can climb; the task's accuracy is logged
beside it). Output: ``benchmarks/results/moe_<name>.json`` and ``.png``. Timings depend on the machine and its load;
nothing here asserts on them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import code_version, median, write_report  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results"
#: The runs: (routing_replay, routing_replay_diagnostics).
RUNS = {"off": ("off", False), "R3": ("R3", True), "R3-plain": ("R3", False)}
#: Per-step metrics recorded (what a run does not log is absent).
METRICS = ("reward", "rewards/digit_share/mean", "rewards/gsm8k_accuracy/mean", "sampling/k3_kl",
           "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
           "sampling/mismatch_ratio/p01", "sampling/mismatch_ratio/p50", "sampling/mismatch_ratio/p99",
           "sampling/router_disagreement", "sampling/without_replay/router_disagreement",
           "sampling/without_replay/k3_kl", "sampling/without_replay/sampling_logp_difference/mean",
           "timing/step_s", "timing/rollout_s", "timing/train_s")
#: ``--toy``: a check of the whole pipeline, not a record.
TOY = dict(steps=2, rounds=1, prompts_per_step=2, num_generations=4, max_new_tokens=8, runs="off,R3")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--name", default=None, help="results name: benchmarks/results/moe_<name>.json (default: "
                                                     "the engine dtype)")
    parser.add_argument("--toy", action="store_true",
                        help=f"a check of the pipeline: {TOY} unless given, no results written")
    parser.add_argument("--runs", default="off,R3,R3-plain", help=f"comma-separated, of {sorted(RUNS)}")
    parser.add_argument("--engine-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the vLLM engine's dtype (the trainer is float32)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run; the first is a warm-up")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each kind, the order alternating")
    parser.add_argument("--family", default="qwen3_moe", choices=["qwen3_moe", "olmoe", "mixtral"])
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--router-std", type=float, default=0.1,
                        help="the routers' weights are drawn N(0, std): smaller, more near ties between experts")
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--learning-rate", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", default=None, help="keep the model, specs and logs here (default: a temp dir)")
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.toy:  # its settings, but what the command line gives
        for name, value in TOY.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    unknown = set(args.runs.split(",")) - set(RUNS)
    if unknown:
        parser.error(f"--runs {args.runs}: unknown runs {sorted(unknown)}; choose from {sorted(RUNS)}")
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is a warm-up)")
    return args


# --------------------------------------------------------------------------- the model
def build_model(args: argparse.Namespace, dest: str) -> str:
    """The tiny MoE of ``args`` in ``dest``, its routers redrawn N(0, ``router_std``) (seed ``args.seed``)."""
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_grpo.demos.tiny_models import save_tiny_moe
    from lightning_grpo.models.embedded import default_model_path

    save_tiny_moe(dest, default_model_path(), args.family, hidden_size=args.hidden_size,
                  expert_size=args.hidden_size, num_hidden_layers=args.layers, num_experts=args.experts,
                  top_k=args.top_k, vocab_size=2048)
    model = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32)
    generator = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.copy_(torch.randn(param.shape, generator=generator) * args.router_std)
    model.save_pretrained(dest)
    return dest


# --------------------------------------------------------------------------- one run (a subprocess)
def digit_share(prompts: Sequence[Any], completions: Sequence[str], **kwargs: Any) -> list[float]:
    """The share of digits among a completion's characters (0 for an empty one)."""
    return [sum(ch.isdigit() for ch in c) / len(c) if c else 0.0 for c in completions]


def run(spec: dict) -> dict:
    """Train ``spec["steps"]`` GRPO steps with the colocated vLLM engine (``spec["engine_dtype"]``, recording the
    routing under R3); return each step's end time and metrics."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import Callback

    from lightning_grpo import GRPOConfig, GRPOModule
    from lightning_grpo.config import EngineConfig
    from lightning_grpo.data import PromptDataModule
    from lightning_grpo.rollout.engines.vllm.colocated import VLLMRolloutEngine

    replay, diagnostics = RUNS[spec["run"]]
    config = GRPOConfig(num_generations=spec["num_generations"], max_new_tokens=spec["max_new_tokens"],
                        temperature=spec["temperature"], routing_replay=replay,
                        routing_replay_diagnostics=diagnostics, max_prompt_length=256,
                        engine=EngineConfig(name="vllm"))
    module = GRPOModule(spec["model"], reward_funcs=[digit_share, "gsm8k_accuracy"], config=config,
                        learning_rate=spec["learning_rate"], export_dir="")
    engine = VLLMRolloutEngine(spec["model"], dtype=spec["engine_dtype"], kv_cache_space_gib=0.5,
                               max_model_len=256 + spec["max_new_tokens"], seed=spec["seed"],
                               record_routing=replay == "R3")
    module.rollout_engine = engine  # a given engine: synced before the first rollout, kept (closed below)

    class Steps(Callback):
        def __init__(self) -> None:
            self.rows: list[dict] = []

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch.step_end:
                logged = trainer.logged_metrics
                self.rows.append({"end": time.perf_counter(),
                                  **{k: float(logged[k]) for k in METRICS if k in logged}})

    steps = Steps()
    trainer = L.Trainer(max_steps=spec["steps"], accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                        num_sanity_val_steps=0, callbacks=[steps], default_root_dir=spec["workdir"])
    L.seed_everything(spec["seed"])
    try:
        trainer.fit(module, datamodule=PromptDataModule(dataset="arithmetic", prompts_per_step=spec["prompts_per_step"],
                                                        val_size=0, seed=spec["seed"]))
    finally:
        engine.close()
    rows = steps.rows
    for previous, row in zip([None, *rows[:-1]], rows, strict=True):
        row["interval_s"] = None if previous is None else row["end"] - previous["end"]
    return {"run": spec["run"], "steps": rows, "torch": torch.__version__}


def run_subprocess(spec: dict, workdir: str, label: str) -> dict:
    """:func:`run` in a fresh Python process (its log in ``<workdir>/<label>.log``).

    Raises:
        RuntimeError: the run failed (the end of its log is in the message).
    """
    spec_path, out_path, log_path = (os.path.join(workdir, f"{label}.{x}") for x in ("spec.json", "json", "log"))
    with open(spec_path, "w") as handle:
        json.dump(spec, handle)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    with open(log_path, "w") as log:
        code = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", spec_path, out_path],
                              env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0 or not os.path.exists(out_path):
        raise RuntimeError(f"run {label} failed (exit code {code}); log {log_path}:\n"
                           + "".join(open(log_path).readlines()[-40:]))
    with open(out_path) as handle:
        return json.load(handle)


# --------------------------------------------------------------------------- summary, plot
def summarize(runs: dict[str, list[dict]]) -> dict[str, Any]:
    """Medians over the measured steps (all rounds) of each run; the R3 run's paired ratio of its mismatch with
    replay to the mismatch without replay on the same rollouts; step times against ``off``."""
    summary: dict[str, Any] = {}
    for name, results in runs.items():
        rows = [row for r in results for row in r["steps"]]
        measured = [row for row in rows if row["interval_s"] is not None]
        summary[name] = {key: median([row.get(key) for row in rows]) for key in METRICS}
        summary[name]["step_s"] = median([row["interval_s"] for row in measured])
    if "R3" in runs:
        rows = [row for r in runs["R3"] for row in r["steps"]]
        pairs = [(row["sampling/k3_kl"], row["sampling/without_replay/k3_kl"]) for row in rows
                 if "sampling/k3_kl" in row and "sampling/without_replay/k3_kl" in row]
        ratio = median([a / b for a, b in pairs if b > 0])
        mean_ratio = (sum(a for a, _ in pairs) / sum(b for _, b in pairs)) if pairs and sum(b for _, b in pairs) \
            else None
        flips = sum(row.get("sampling/without_replay/router_disagreement", 0.0) for row in rows)
        summary["replay"] = {"k3_with_over_without_median": ratio, "k3_with_over_without_of_sums": mean_ratio,
                             "steps": len(pairs), "routers_flipped_without_replay": flips > 0,
                             # no router flipped without replay: there was no routing mismatch to remove
                             "acceptance_at_most_0.1": None if mean_ratio is None or flips == 0
                             else mean_ratio <= 0.1}
    off = summary.get("off", {}).get("step_s")
    for name in runs:
        s = summary[name]["step_s"]
        summary[name]["step_s_over_off"] = None if not off or s is None else s / off
    return summary


def plot(runs: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("k3 KL, sampler vs trainer", [("sampling/k3_kl", "{run}"),
                                              ("sampling/without_replay/k3_kl", "{run}, without replay")], True),
              ("|logp sampler - logp trainer|, mean", [("sampling/sampling_logp_difference/mean", "{run}"),
                                                        ("sampling/without_replay/sampling_logp_difference/mean",
                                                         "{run}, without replay")], True),
              ("router disagreement (share of token-layer pairs)",
               [("sampling/router_disagreement", "{run}"),
                ("sampling/without_replay/router_disagreement", "{run}, without replay")], False),
              ("step time (s)", [("interval_s", "{run}")], False)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    for ax, (label, series, log) in zip(axes, panels, strict=True):
        for name, results in runs.items():
            for key, legend in series:
                for i, result in enumerate(results):
                    points = [(s + 1, row[key]) for s, row in enumerate(result["steps"])
                              if row.get(key) is not None and (not log or row[key] > 0)]  # a log axis drops zeros
                    if points:
                        xs, ys = [x for x, _ in points], [y for _, y in points]
                        ax.plot(xs, ys, marker=".", label=legend.format(run=name) if i == 0 else None)
        if log:
            ax.set_yscale("log")
            label += " (zeros not drawn)"
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> dict:
    args = parse_args(argv)
    if args.worker:
        with open(args.worker[0]) as handle:
            result = run(json.load(handle))
        with open(args.worker[1], "w") as handle:
            json.dump(result, handle)
        return result
    started = time.time()
    workdir = args.workdir or tempfile.mkdtemp(prefix="moe_bench_")
    os.makedirs(workdir, exist_ok=True)
    model = build_model(args, os.path.join(workdir, "model"))
    names = args.runs.split(",")
    print(f"model {model}; runs {names} x {args.rounds} round(s), engine {args.engine_dtype}", flush=True)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for round_index in range(args.rounds):
        for name in names if round_index % 2 == 0 else list(reversed(names)):
            label = f"{name}_round{round_index + 1}"
            print(f"running {label} ...", flush=True)
            spec = {"run": name, "model": model, "engine_dtype": args.engine_dtype, "steps": args.steps,
                    "prompts_per_step": args.prompts_per_step, "num_generations": args.num_generations,
                    "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                    "learning_rate": args.learning_rate, "seed": args.seed, "workdir": workdir}
            runs[name].append(run_subprocess(spec, workdir, label))
    summary = summarize(runs)
    for name in names:
        s = summary[name]
        cells = [f"k3 {s['sampling/k3_kl']}", f"without replay {s['sampling/without_replay/k3_kl']}",
                 f"router disagreement {s['sampling/router_disagreement']}", f"step {s['step_s']} s",
                 f"x{s['step_s_over_off']} of off"]
        print(f"{name:9s} " + " | ".join(cells))
    if "replay" in summary:
        print(f"replay: k3 with / without on the R3 run's rollouts: {summary['replay']}")
    name = args.name or args.engine_dtype
    report = {"settings": {k: v for k, v in vars(args).items() if k not in ("worker", "workdir")},
              "command": "python benchmarks/moe.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "code": code_version(),
              "seconds": time.time() - started, "summary": summary, "runs": runs}
    if not args.toy:
        RESULTS.mkdir(parents=True, exist_ok=True)
        write_report(report, str(RESULTS / f"moe_{name}.json"))
        plot(runs, RESULTS / f"moe_{name}.png", f"tiny {args.family}, vLLM engine in {args.engine_dtype}, trainer "
                                                f"in float32: routing replay off vs R3")
    else:
        plot(runs, Path(workdir) / "moe_toy.png", "toy run")
        print(f"toy run: results and plot in {workdir} (nothing written to benchmarks/results)")
    return report


if __name__ == "__main__":
    main()
