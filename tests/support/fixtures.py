"""The plain functions behind the ``cpu_trainer``, ``metrics_rows`` and ``alternating_reward`` fixtures of
``conftest.py``, for code that cannot request a fixture (module-scoped fixtures, module-level ``_module`` helpers,
``support.algorithm.quiet_trainer``)."""

from __future__ import annotations

import csv
import glob
import os
from typing import Optional

import lightning as L
from lightning.pytorch.loggers import CSVLogger


def make_cpu_trainer(root, max_steps: int = -1, **kwargs) -> L.Trainer:
    """A one-process CPU ``L.Trainer`` for tests, files under ``root``: no progress bar, no model summary, logging
    every step into ``CSVLogger(root, name="logs")`` (what :func:`read_metrics_rows` reads); every default can be
    overridden (``logger=False`` for none)."""
    kwargs.setdefault("logger", CSVLogger(str(root), name="logs"))
    kwargs.setdefault("enable_progress_bar", False)
    kwargs.setdefault("enable_model_summary", False)
    kwargs.setdefault("log_every_n_steps", 1)
    return L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, default_root_dir=str(root), **kwargs)


def read_metrics_rows(root, where: Optional[str] = None) -> list[dict[str, str]]:
    """The rows of the one ``metrics.csv`` under ``root`` (any depth; a CSVLogger writes one per version), as
    strings; with ``where``, only the rows with a value in that column (e.g. "loss": the training steps)."""
    (path,) = glob.glob(os.path.join(str(root), "**", "metrics.csv"), recursive=True)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return rows if where is None else [r for r in rows if r.get(where)]


def alternating_reward(prompts, completions, **kwargs) -> list[float]:
    """1, 0, 1, 0, ... by position in the rollout: a reward that varies in every group (of an even G) whatever the
    model generates."""
    return [float(i % 2 == 0) for i in range(len(completions))]
