"""Forwarding of rollout events (:mod:`lightning_grpo.events`) to Lightning callbacks."""

from __future__ import annotations

from typing import Any, Optional

import lightning as L


def forward_event(trainer: Optional["L.Trainer"], pl_module: "L.LightningModule", name: str, payload: Any) -> None:
    """Call ``callback.<name>(trainer, pl_module, payload)`` on every callback in ``trainer.callbacks`` that defines
    ``name`` (in the order of ``trainer.callbacks``); nothing without a trainer."""
    if trainer is None:
        return
    for callback in trainer.callbacks:
        hook = getattr(callback, name, None)
        if callable(hook):
            hook(trainer, pl_module, payload)
