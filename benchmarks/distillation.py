"""On-policy distillation against RL on the arithmetic task, same student, task and budget: how many steps does
distillation need to reach RL's final held-out accuracy?

    python benchmarks/distillation.py                              # the recorded run (both stages, ~1.5 h on 1 core)
    python benchmarks/distillation.py --max-steps 4 --val-every 2 --val-size 8 --name pilot

1. **RL** (:func:`recipes.arithmetic_grpo.main` with the learning benchmark's settings: the untrained embedded
   SmolLM2-135M-Instruct, level-1 arithmetic, 8 prompts x 8 completions of <= 64 tokens at T 1.2, strict accuracy
   reward, lr 5e-6, 30 steps), validated every ``val_every`` steps. Its exported policy is the teacher.
2. **Distillation**: the same recipe and student, the same steps, prompts (same seed), completions, learning rate
   and validations, trained on the per-token reverse KL to the RL policy (``GRPOConfig.distillation``, alone: the
   reward is scored and logged, not trained on).

Recorded in ``benchmarks/results/distillation_<name>.json``: the settings, both runs' held-out curves (greedy
accuracy and the unbiased pass@1 of 4 samples at T 1.2, 100 questions disjoint from training) and train curves
(reward, reverse KL), and the comparison: RL's final held-out scores and the first validation at which distillation
reaches each (None if it never does within the budget). The plot goes to ``distillation_<name>.png``. The RL stage's
summary is kept under ``--root`` and reused by a rerun with the same settings (``--rerun-rl`` to redo it).
``--partial`` writes the record from what the runs under ``--root`` logged so far (``"complete": false``), for a run
that could not finish.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path
from typing import Any, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from recipes.arithmetic_grpo import main, summarize  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--name", default="arithmetic")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--val-every", type=int, default=5)
    parser.add_argument("--val-size", type=int, default=100)
    parser.add_argument("--learning-rate", type=float, default=5e-6)
    parser.add_argument("--distill-coef", type=float, default=1.0)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--root", default="outputs/distillation_benchmark")
    parser.add_argument("--rerun-rl", action="store_true")
    parser.add_argument("--partial", action="store_true")
    return parser.parse_args(argv)


def trained_steps(curve: list) -> list[tuple[int, float]]:
    """A validation curve as (optimizer steps trained, value): the first point is before training (logged at step
    0), each later one after ``logged step + 1`` steps."""
    return [(0 if i == 0 else int(step) + 1, float(value)) for i, (step, value) in enumerate(curve)]


def steps_to_reach(curve: list[tuple[int, float]], target: float) -> Optional[int]:
    """The first validation (in steps trained) whose value is >= ``target``, or None."""
    return next((steps for steps, value in curve if value >= target), None)


def _stage(name: str, args: argparse.Namespace, teacher: Optional[str]) -> dict[str, Any]:
    return main(max_steps=args.max_steps, learning_rate=args.learning_rate, val_size=args.val_size,
                prompts_per_step=args.prompts_per_step, num_generations=args.num_generations,
                val_every=args.val_every, teacher=teacher, distill_coef=args.distill_coef,
                root=str(Path(args.root) / args.name / name))


def compare(rl: dict[str, Any], distill: dict[str, Any]) -> dict[str, Any]:
    """Each held-out score: RL's final value, and the steps RL and distillation first reach it."""
    out = {}
    for key, curve in (("heldout_greedy_accuracy", "val_curve"), ("heldout_pass@1", "val_pass@1_curve")):
        rl_curve, distill_curve = trained_steps(rl[curve]), trained_steps(distill[curve])
        target = rl_curve[-1][1]
        out[key] = {"rl_final": target, "rl_steps_to_final": steps_to_reach(rl_curve, target),
                    "distillation_steps_to_rl_final": steps_to_reach(distill_curve, target),
                    "distillation_final": distill_curve[-1][1] if distill_curve else None, "before": rl_curve[0][1],
                    "rl_curve": rl_curve, "distillation_curve": distill_curve}
    return out


def plot(rl: dict[str, Any], distill: dict[str, Any], comparison: dict[str, Any], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, label in ((axes[0], "heldout_greedy_accuracy", "held-out accuracy (greedy)"),
                           (axes[1], "heldout_pass@1", "held-out pass@1 (4 samples, T 1.2)")):
        for run in ("rl", "distillation"):
            if not comparison[key][f"{run}_curve"]:  # a partial record: not run
                continue
            steps, values = zip(*comparison[key][f"{run}_curve"], strict=True)
            ax.plot(steps, values, marker="o", label="RL (GRPO)" if run == "rl" else "on-policy distillation")
        ax.axhline(comparison[key]["rl_final"], color="gray", linestyle=":", label="RL's final")
        ax.set_xlabel("optimizer steps")
        ax.set_title(label)
        ax.legend()
    for summary, label in ((rl, "RL: train reward"), (distill, "distillation: train reward")):
        axes[2].plot([s + 1 for s in summary["curve"]["step"]], summary["curve"]["reward"], label=label)
    kl = distill["reverse_kl"]
    if kl:
        axes[2].plot([s + 1 for s, _ in kl], [v for _, v in kl], label="distillation: reverse KL to the teacher")
    axes[2].set_xlabel("optimizer steps")
    axes[2].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _logged(root: Path, stage: str) -> Optional[dict[str, Any]]:
    """:func:`recipes.arithmetic_grpo.summarize` of the newest ``metrics.csv`` a stage logged under ``root``, with
    ``seconds`` None (unknown) and ``settings`` {}; None when there is none."""
    logs = sorted((root / stage / "lightning_logs").glob("version_*/metrics.csv"))
    if not logs:
        return None
    summary = summarize(logs[-1])
    summary.update(seconds=None, settings={}, export=str(logs[-1].parent / "hf_model"))
    return summary


#: The distillation stage of a partial record that never started.
_NOT_RUN: dict[str, Any] = {"val_curve": [], "val_pass@1_curve": [], "curve": {"step": [], "reward": []},
                            "reverse_kl": [], "settings": {}, "seconds": None}


def _rl_stage(args: argparse.Namespace, path: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The RL stage: reused from ``path`` when it was run with the same settings (unless ``--rerun-rl``)."""
    if path.exists() and not args.rerun_rl:
        saved = json.loads(path.read_text())
        if saved.get("benchmark_settings") == settings:
            print(f"reusing the RL stage of {path}")
            return saved
    rl = _stage("rl", args, teacher=None)
    rl["benchmark_settings"] = settings
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rl, indent=2) + "\n")
    return rl


def run(argv: list[str]) -> dict[str, Any]:
    args = parse(argv)
    root = Path(args.root) / args.name
    rl_path = root / "rl_summary.json"
    settings = {k: v for k, v in vars(args).items() if k not in ("name", "root", "rerun_rl", "distill_coef", "partial")}
    complete = not args.partial
    if complete:
        rl = _rl_stage(args, rl_path, settings)
        distill = _stage("distillation", args, teacher=rl["export"])
    else:  # what the stages logged so far
        logged = json.loads(rl_path.read_text()) if rl_path.exists() else _logged(root, "rl")
        if logged is None or not logged["val_curve"]:
            raise SystemExit(f"--partial: the RL stage under {root} has not validated yet")
        rl, distill = logged, _logged(root, "distillation") or _NOT_RUN
    comparison = compare(rl, distill)
    record = {
        "complete": complete,
        "question": "steps of on-policy distillation (the RL policy as the teacher) to reach RL's final held-out "
                    "accuracy, same student, task, prompts, samples, learning rate and steps",
        "comparison": {k: {kk: vv for kk, vv in v.items() if not kk.endswith("_curve")} for k, v in comparison.items()},
        "curves": {k: {"rl": v["rl_curve"], "distillation": v["distillation_curve"]} for k, v in comparison.items()},
        "train_reward": {"rl": rl["curve"]["reward"], "distillation": distill["curve"]["reward"]},
        "reverse_kl": distill["reverse_kl"],
        "settings": {"rl": rl["settings"], "distillation": distill["settings"], "benchmark": settings,
                     "distill_coef": args.distill_coef},
        "seconds": {"rl": rl["seconds"], "distillation": distill["seconds"]},
        "teacher": rl["export"],
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "command": "python benchmarks/distillation.py " + " ".join(argv),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    png = RESULTS / f"distillation_{args.name}.png"
    plot(rl, distill, comparison, "On-policy distillation vs RL, arithmetic-1, SmolLM2-135M", png)
    record["plot"] = str(png.relative_to(REPO_ROOT))
    out = RESULTS / f"distillation_{args.name}.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record["comparison"], indent=2))
    print(f"wrote {out} and {png}")
    return record


if __name__ == "__main__":
    run(sys.argv[1:])
