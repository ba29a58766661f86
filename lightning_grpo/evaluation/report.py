"""The before/after report of a run: what a run's ``metrics.csv`` (CSVLogger) says improved.

Rows: the training reward and each reward function's mean (``rewards/<name>/mean``) over the first and the last
``window`` optimizer steps, and every held-out score the validation logged (``val/accuracy``, the greedy accuracy,
and ``val/pass@k``, ``val/maj@k``, ``val/mean@k``; per-dataset ``val/<dataset>/...`` too) at its first and its last
validation. A run that validates before training (``trainer.validate`` first, or ``lightning-grpo fit
--validate_before_fit true``) so has a true "before". Used by ``lightning-grpo fit`` (printed at the end), the
recipes and ``benchmarks/learning.py``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Union

from lightning_grpo.evaluation.plot import find_metrics_csv, plot_metrics, read_curves

#: Held-out columns reported (validation logs them under ``val/``); lengths and token counts are left out.
_VAL_SKIP = ("length", "tokens", "loss")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def before_after(path: Union[str, Path], window: int = 5) -> dict[str, dict[str, float]]:
    """``{row: {"before": x, "after": y}}`` of a run (see the module docstring); ``nan`` where a value is missing
    (e.g. "after" of a held-out score validated once).

    Args:
        path: a ``metrics.csv`` or a folder holding one (the newest under it).
        window: optimizer steps averaged at each end of the training curves (>= 1).

    Raises:
        ValueError: ``window < 1``.
        FileNotFoundError: no ``metrics.csv`` at or under ``path``.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    curves = read_curves(find_metrics_csv(path))
    rows: dict[str, dict[str, float]] = {}
    train = ["reward"] + sorted(k for k in curves if k.startswith("rewards/") and k.endswith("/mean"))
    for name in train:
        values = [v for _, v in sorted(curves.get(name, []))]
        if values:
            rows[f"train {name} (first/last {window} steps)"] = {
                "before": _mean(values[:window]), "after": _mean(values[-window:])}
    for name in sorted(k for k in curves if k.startswith("val/") and not any(s in k for s in _VAL_SKIP)):
        values = [v for _, v in curves[name]]
        rows[f"held-out {name}"] = {"before": values[0], "after": values[-1] if len(values) > 1 else math.nan}
    return rows


def format_table(rows: dict[str, dict[str, float]]) -> str:
    """The rows of :func:`before_after` as a fixed-width text table (``before``, ``after``, ``change``)."""
    width = max([len(name) for name in rows] + [10]) + 2
    lines = [f"{'':{width}s}{'before':>10s}{'after':>10s}{'change':>10s}"]
    for name, row in rows.items():
        change = row["after"] - row["before"]
        lines.append(f"{name:{width}s}{row['before']:>10.3f}{row['after']:>10.3f}{change:>+10.3f}")
    return "\n".join(lines)


def fit_report(trainer: Any) -> str:
    """The end-of-fit text: the before/after table of the run's ``metrics.csv`` and the paths of its plot, its
    completion table and its last checkpoint; ``""`` off global rank 0 or without a ``metrics.csv`` in
    ``trainer.log_dir``."""
    folder = trainer.log_dir
    if not trainer.is_global_zero or folder is None or not os.path.exists(os.path.join(folder, "metrics.csv")):
        return ""
    lines = [format_table(before_after(folder)), f"plot:        {plot_metrics(folder)}"]
    completions = os.path.join(folder, "completions.csv")
    if os.path.exists(completions):
        lines.append(f"completions: {completions}")
    callback = trainer.checkpoint_callback
    if callback is not None and (callback.last_model_path or callback.best_model_path):
        lines.append(f"checkpoint:  {callback.last_model_path or callback.best_model_path}")
    return "\n".join(lines)

