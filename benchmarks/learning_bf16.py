"""bf16 on the arithmetic recipe: does it learn as float32 does, and which rollout correction does its mismatch need?

    python benchmarks/learning_bf16.py            # bf16-mixed without a correction, with TIS, with IcePop (~22 min)
    python benchmarks/learning_bf16.py --variants bf16-mixed:none --max-steps 10   # one variant, shorter

Runs :mod:`benchmarks.learning` (the recorded arithmetic run: 30 steps, 100 held-out questions, seed 42) once per
variant ``<precision>:<correction>`` (``--variants``, comma-separated; corrections: ``none``, ``tis`` (the token
weight ``pi_old / pi_sampler`` truncated at 2), ``icepop`` (tokens whose weight is outside [0.5, 5] get no
policy-gradient loss): :data:`recipes.arithmetic_grpo.CORRECTIONS`), one after another, each written as
``benchmarks/results/learning_arithmetic_<precision>_<correction>.json`` with its ``vs_record`` against the float32
record ``learning_arithmetic.json``. Then ``benchmarks/results/learning_bf16.json`` puts them side by side: held-out
accuracy (greedy, pass@1) and its difference to float32 (issue 44: within 3 points), the reward and format gains, the
mismatch each run measured (``sampling/mismatch_ratio/*``, ``sampling/sampling_logp_difference/*``, the fraction each
correction dropped) and the wall time; and the recommendation: among the variants within 3 points of float32, the one
with the highest held-out greedy accuracy (the fewest tokens dropped on a tie), else none. Other options
(``--max-steps``, ``--val-size``, ``--engine``, ``--model``, ``--results DIR`` for a trial ...) go to every run;
``--results`` moves the JSON and plots only: each run's logs, checkpoints and exported model still go to
``outputs/learning_benchmark`` (about 2 GB; git-ignored). A trial with fewer steps or questions is compared with the
30-step record all the same, so its ``within_3_points`` and recommendation say nothing.

The variants run one after another on the same machine: run it alone on the machine; the float32 record was measured
on its own commit (its ``code``), which the JSON names beside this run's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import learning  # noqa: E402

DEFAULT_VARIANTS = "bf16-mixed:none,bf16-mixed:tis,bf16-mixed:icepop"


def variants(text: str) -> list[tuple[str, str]]:
    """``"bf16-mixed:none,bf16-mixed:tis"`` -> ``[("bf16-mixed", "none"), ("bf16-mixed", "tis")]``.

    Raises:
        ValueError: an entry without exactly one ``:``.
    """
    out = []
    for entry in (e.strip() for e in text.split(",") if e.strip()):
        precision, sep, correction = entry.partition(":")
        if not sep or not precision or not correction or ":" in correction:
            raise ValueError(f"--variants entry {entry!r}: write <precision>:<correction>, e.g. bf16-mixed:icepop")
        out.append((precision, correction))
    return out


def row(summary: dict[str, Any]) -> dict[str, Any]:
    """One variant's line of the comparison."""
    versus = summary.get("vs_record", {})
    mismatch = summary.get("mismatch", {})
    dropped = [v for k, v in mismatch.items() if k.startswith("sampling/masked_fraction/")]
    return {
        "heldout_accuracy": summary["heldout_accuracy"], "heldout_pass@1": summary["heldout_pass@1"],
        "vs_float32": versus, "within_3_points": versus.get("heldout_accuracy", {}).get("within_3_points"),
        "reward": summary["reward"], "format": summary["format"], "mismatch": mismatch,
        "dropped_fraction": max(dropped) if dropped else 0.0, "minutes": summary["seconds"] / 60,
        "engine_dtype": summary["settings"].get("engine_dtype"), "command": summary.get("command"),
    }


def recommend(rows: dict[str, dict[str, Any]]) -> Optional[str]:
    """The variant within 3 points of float32 with the highest held-out greedy accuracy (then the fewest tokens
    dropped); None when no variant is within 3 points."""
    ok = [(name, r) for name, r in rows.items() if r["within_3_points"]]
    if not ok:
        return None
    return max(ok, key=lambda item: (item[1]["heldout_accuracy"]["after"], -item[1]["dropped_fraction"]))[0]


def main(argv: list[str]) -> dict[str, Any]:
    chosen, argv = learning._option(argv, "--variants", DEFAULT_VARIANTS)
    rows: dict[str, dict[str, Any]] = {}
    for precision, correction in variants(chosen):
        name = f"arithmetic_{precision}_{correction}"
        summary = learning.run([*argv, "--precision", precision, "--correction", correction, "--name", name])
        rows[f"{precision}:{correction}"] = row(summary)
    result = {"variants": rows, "recommendation": recommend(rows), "record": "learning_arithmetic.json",
              "command": " ".join(["python benchmarks/learning_bf16.py",
                                   *(["--variants", chosen] if chosen != DEFAULT_VARIANTS else []), *argv])}
    out = Path(learning._option(argv, "--results", str(learning.RESULTS))[0]) / "learning_bf16.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: {"accuracy": v["heldout_accuracy"], "within_3_points": v["within_3_points"],
                          "dropped": v["dropped_fraction"], "minutes": v["minutes"]} for k, v in rows.items()},
                     indent=2))
    print(f"recommendation: {result['recommendation']}\nwrote {out}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
