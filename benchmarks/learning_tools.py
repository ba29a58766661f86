"""A tool that pays: GRPO with the calculator tool on 3- and 4-digit arithmetic, the embedded SmolLM2-135M-Instruct,
on CPU (issue 21, item 8).

    python benchmarks/learning_tools.py                        # the recorded run: 10 steps
    python benchmarks/learning_tools.py --max-steps 2 --prompts-per-step 2 --num-generations 2 --val-size 4 \\
        --train-size 8 --name smoke                              # a check that it runs

Runs :func:`recipes.arithmetic_tools.main` (held-out accuracy before training, ``max_steps`` GRPO steps on
multi-turn episodes with the calculator, the same validation after) and records in
``benchmarks/results/learning_tools_<name>.json``: the settings, the per-step curves (reward, tool calls per
episode, tool error rate, model turns per episode, step time), the before/after table, the wall time (model load,
both evaluations and training included) and what moved (the differences below, reported whatever their sign: no
threshold is asserted, the run is recorded as it went). The plot is copied to
``benchmarks/results/learning_tools_<name>.png``.

Honesty: the held-out questions are drawn from the same seeded generator as, and disjoint from, the training
questions; evaluation is greedy (and ``eval_samples`` seeded samples) both times with the same prompts, tool and
limits; the reward is the final answer's strict accuracy, never the tool use itself.
"""

from __future__ import annotations

import json
import platform
import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from recipes.arithmetic_tools import main, parse_args, table  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results"
#: The recorded run's settings: recipes/arithmetic_tools.py's defaults (8 prompts x 8 episodes, <= 3 model turns of
#: <= 48 tokens in <= 160 tokens per episode, lr 1e-5, T 1.0, 100 held-out questions, 2 samples each) but 10 steps
#: instead of 30: a step took about 170 s on one core of this CPU, and 30 did not fit the time there was.
BENCHMARK_ARGS: list[str] = ["--max-steps", "10"]


def changes(summary: dict) -> dict:
    """What moved between the start and the end of the run (first/last 5 steps; the two validations)."""
    out = {}
    for key in ("reward", "tool_calls_per_episode", "tool_error_rate", "turns"):
        out[f"{key}_last5_minus_first5"] = summary[key]["last"] - summary[key]["first"]
    for key in ("heldout_accuracy", "heldout_pass@1"):
        out[f"{key}_gain"] = summary[key]["after"] - summary[key]["before"]
    out["minutes"] = summary["seconds"] / 60
    return out


def run(argv: list[str]) -> dict:
    name = "arithmetic"
    if "--name" in argv:
        i = argv.index("--name")
        name, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    kwargs = parse_args([*BENCHMARK_ARGS, "--root", "outputs/learning_tools_benchmark", *argv])
    summary = main(**kwargs)
    summary["changes"] = changes(summary)
    summary["machine"] = {"platform": platform.platform(), "processor": platform.processor(),
                          "python": platform.python_version()}
    summary["command"] = "python benchmarks/learning_tools.py " + " ".join(argv)
    summary["table"] = table(summary)
    RESULTS.mkdir(parents=True, exist_ok=True)
    png = RESULTS / f"learning_tools_{name}.png"
    shutil.copyfile(summary["plot"], png)
    summary["plot_copy"] = str(png.relative_to(REPO_ROOT))
    out = RESULTS / f"learning_tools_{name}.json"
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary["changes"], indent=2))
    print(f"wrote {out} and {png}")
    return summary


if __name__ == "__main__":
    run(sys.argv[1:])
