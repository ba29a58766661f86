"""An unmodified agent learns: GRPO of an OpenAI Agents SDK agent with a calculator tool through the agent gateway,
the embedded SmolLM2-135M-Instruct, on CPU (issue 31, item 7).

    python benchmarks/learning_agents.py         # the recorded run: recipes/agent_arithmetic.py's defaults
    python benchmarks/learning_agents.py --max-steps 1 --prompts-per-step 2 --num-generations 2 --val-size 4 \\
        --train-size 8 --name smoke                                # a check that it runs

Runs :func:`recipes.agent_arithmetic.main` (the agent's held-out greedy accuracy before training, ``max_steps`` GRPO
steps on the agent's episodes, the same validation after) and records in
``benchmarks/results/learning_agents_<name>.json``: the settings, the per-step curves (reward, tool calls per episode,
tool-call parse error rate, model calls per episode, step time), the before/after table, the wall time (model load,
both evaluations and training included) and what moved (reported whatever its sign: no threshold is asserted). The
plot is copied to ``benchmarks/results/learning_agents_<name>.png``.

Honesty: the agent's code is the recipe's, unchanged between the evaluations and training; the held-out questions
are disjoint from the training ones; the reward is the final answer's strict accuracy, never the tool use itself.
"""

from __future__ import annotations

import json
import platform
import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from recipes.agent_arithmetic import main, parse_args, table  # noqa: E402

RESULTS = REPO_ROOT / "benchmarks" / "results"


def changes(summary: dict) -> dict:
    """What moved between the start and the end of the run (first/last 5 steps; the two validations)."""
    out = {}
    for key in ("reward", "tool_calls_per_episode", "tool_error_rate", "turns"):
        out[f"{key}_last5_minus_first5"] = summary[key]["last"] - summary[key]["first"]
    out["heldout_accuracy_gain"] = summary["heldout_accuracy"]["after"] - summary["heldout_accuracy"]["before"]
    out["minutes"] = summary["seconds"] / 60
    return out


def run(argv: list[str]) -> dict:
    name = "arithmetic"
    if "--name" in argv:
        i = argv.index("--name")
        name, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    kwargs = parse_args(["--root", "outputs/learning_agents_benchmark", *argv])
    summary = main(**kwargs)
    summary["changes"] = changes(summary)
    summary["machine"] = {"platform": platform.platform(), "processor": platform.processor(),
                          "python": platform.python_version()}
    summary["command"] = "python benchmarks/learning_agents.py " + " ".join(argv)
    summary["table"] = table(summary)
    RESULTS.mkdir(parents=True, exist_ok=True)
    png = RESULTS / f"learning_agents_{name}.png"
    shutil.copyfile(summary["plot"], png)
    summary["plot_copy"] = str(png.relative_to(REPO_ROOT))
    out = RESULTS / f"learning_agents_{name}.json"
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary["changes"], indent=2))
    print(f"wrote {out} and {png}")
    return summary


if __name__ == "__main__":
    run(sys.argv[1:])
