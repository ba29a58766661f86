"""``lightning-grpo plot``: a PNG of a run's curves from its ``metrics.csv`` (CSVLogger).

Panels (those with data): reward and each reward function's mean; validation accuracy, pass@k, maj@k, mean@k;
KL; entropy; completion length (mean, max); step time (``timing/step_s`` and its rollout part), all over
optimizer steps (the CSV's ``step`` column).
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path
from typing import Optional, Union

#: (title, column prefixes or names) of each panel, in order.
PANELS = (
    ("reward", ("reward", "rewards/")),
    ("validation", ("val/",)),
    ("KL", ("kl",)),
    ("entropy", ("entropy",)),
    ("completion length (tokens)", ("completions/mean_length", "completions/max_length")),
    ("step time (s)", ("timing/step_s", "timing/rollout_s", "timing/train_s")),
)
_SKIP = ("reward_std", "val/mean_length", "rewards/overlong_penalty", "rewards/kl_penalty", "reward_shaped")


def find_metrics_csv(path: Union[str, Path]) -> Path:
    """``path`` itself when a file, else the most recently modified ``metrics.csv`` under the folder ``path``.

    Raises:
        FileNotFoundError: no such file, or no ``metrics.csv`` under the folder (the path is named).
    """
    path = Path(path)
    if path.is_file():
        return path
    found = sorted(path.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime) if path.is_dir() else []
    if not found:
        raise FileNotFoundError(f"no metrics.csv at or under {str(path)!r}")
    return found[-1]


def read_curves(csv_path: Union[str, Path]) -> dict[str, list[tuple[float, float]]]:
    """``{column: [(step, value), ...]}`` of every numeric column of a CSVLogger ``metrics.csv`` (empty cells and
    non-numbers skipped; rows without ``step`` skipped)."""
    curves: dict[str, list[tuple[float, float]]] = {}
    with open(csv_path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            try:
                step = float(row.get("step") or "nan")
            except ValueError:
                continue
            if math.isnan(step):
                continue
            for key, text in row.items():
                if key in ("step", "epoch") or not text:
                    continue
                try:
                    value = float(text)
                except ValueError:
                    continue
                if math.isfinite(value):
                    curves.setdefault(key, []).append((step, value))
    return curves


def _panel_columns(curves: dict, patterns: tuple[str, ...]) -> list[str]:
    names = []
    for pattern in patterns:
        for key in sorted(curves):
            matches = key == pattern or (pattern.endswith("/") and key.startswith(pattern))
            if matches and not key.startswith(_SKIP) and key not in names:
                names.append(key)
    return names


def plot_metrics(path: Union[str, Path], out: Optional[Union[str, Path]] = None, title: Optional[str] = None) -> Path:
    """Write the PNG of the run at ``path`` (a ``metrics.csv`` or a log folder, :func:`find_metrics_csv`) to ``out``
    (default: ``metrics.png`` next to the CSV); returns its path.

    Raises:
        FileNotFoundError: see :func:`find_metrics_csv`. ValueError: the CSV has none of the plotted metrics.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    csv_path = find_metrics_csv(path)
    curves = read_curves(csv_path)
    panels = [(name, cols) for name, patterns in PANELS if (cols := _panel_columns(curves, patterns))]
    if not panels:
        raise ValueError(f"{csv_path} has none of the plotted metrics ({[p for _, ps in PANELS for p in ps]})")
    columns = 3 if len(panels) > 4 else 2
    rows = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 3.6 * rows), squeeze=False)
    for ax, (name, cols) in zip(axes.flat, panels, strict=False):
        for col in cols:
            steps, values = zip(*curves[col], strict=True)
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, markersize=3, label=col)
        ax.set_title(name)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title or str(csv_path))
    fig.tight_layout()
    target = Path(out) if out is not None else csv_path.with_name("metrics.png")
    os.makedirs(target.parent, exist_ok=True)
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target
