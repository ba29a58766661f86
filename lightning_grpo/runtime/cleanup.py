"""Releasing what a run holds when it fails: Lightning calls no ``LightningModule.teardown`` after an exception in
``fit``, ``validate`` or ``test`` (it tears down the strategy, the loops and the loggers, and calls the callbacks'
``on_exception``), so what the module releases there (a rollout engine it made, background threads) would stay.
:class:`ReleaseOnException` is the callback a module installs for it."""

from __future__ import annotations

import logging
from typing import Callable

import lightning as L
from lightning.pytorch.callbacks import Callback

log = logging.getLogger(__name__)


class ReleaseOnException(Callback):
    """Calls ``release()`` when the run fails (``on_exception``), once per failure; an error in it is logged, not
    raised over the run's own.

    Args:
        release: what the module releases (e.g. ``ExperienceMaker.release``).
    """

    def __init__(self, release: Callable[[], None]) -> None:
        self.release = release

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        try:
            self.release()
        except Exception:  # noqa: BLE001 - the run's own exception is the one to see
            log.exception("releasing the module's resources after %s failed", type(exception).__name__)


def install(trainer: L.Trainer, callback: Callback) -> None:
    """Append ``callback`` to ``trainer.callbacks`` unless it is there already (a module's setup runs per stage)."""
    if not any(c is callback for c in trainer.callbacks):
        trainer.callbacks.append(callback)
