"""Preemption: on SIGTERM, stop within seconds at an optimizer-step boundary, with Lightning's SIGTERM behaviour.

Lightning's signal connector turns SIGTERM into ``trainer.received_sigterm`` and raises ``SIGTERMException`` (a
``SystemExit``) after the current training micro-batch; callbacks then see it in ``on_exception``
(``ModelCheckpoint(save_on_exception=True)`` saves a checkpoint there) and the process exits. A GRPO step starts
with a rollout that can take minutes, during which Lightning would not look at the flag. :class:`Preemption` adds:

* the rollout worker's stop flag watches ``trainer.received_sigterm``: the HF engine stops within one generated
  token, vLLM within one engine step, scoring after the reward function in progress, and the partial rollout is
  discarded; :meth:`Preemption.exit_on_stop` turns the interrupted rollout into Lightning's ``SIGTERMException``.
  The loop has then taken no step of that rollout, so a checkpoint saved now is the state after the last finished
  optimizer step and the resumed run regenerates the rollout. No random generator is consumed or reseeded here.
* a SIGTERM that arrives between two micro-batches of one optimizer step is held until the step's last
  micro-batch (:meth:`Preemption.on_micro_batch_end`), so the checkpoint is never taken in the middle of a step.

Every process must receive the signal (SLURM and Lightning's launchers deliver it to all); the processes agree
before they stop a rollout (:class:`lightning_grpo.experience.maker.ExperienceMaker`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Optional

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_grpo.protocols.rollout import RolloutInterrupted, StopFlag

log = logging.getLogger(__name__)


class Preemption:
    """SIGTERM handling of one fit (see the module docstring).

    Args:
        stop: the rollout worker's stop flag; it is set while a SIGTERM is pending.
    """

    def __init__(self, stop: StopFlag) -> None:
        self.stop = stop
        self.trainer: Any = None
        self.held = False  # a SIGTERM held until the end of the optimizer step
        self._warned = False

    def attach(self, trainer: Any) -> None:
        """Watch ``trainer``'s SIGTERM flag (``GRPOModule.setup``)."""
        self.trainer = trainer
        self.held = False
        self.stop.watch(self.requested)

    def requested(self) -> bool:
        """A SIGTERM arrived (Lightning's flag, or one held until the step's end)."""
        return self.held or (self.trainer is not None and bool(self.trainer.received_sigterm))

    @contextlib.contextmanager
    def exit_on_stop(self) -> Iterator[None]:
        """Turn a rollout interrupted by SIGTERM into Lightning's ``SIGTERMException`` (other interruptions
        propagate unchanged)."""
        try:
            yield
        except RolloutInterrupted as error:
            if not self.requested():
                raise
            self._note()
            raise SIGTERMException() from error

    def on_micro_batch_end(self, step_end: bool) -> None:
        """After each training micro-batch (before Lightning's SIGTERM check): hold a SIGTERM that arrived inside an
        optimizer step until its last micro-batch, then hand it back to Lightning, which stops after it."""
        if self.trainer is None:
            return
        connector = self.trainer._signal_connector  # Lightning 2.6 (tests/test_lightning_private_api.py)
        if not step_end and connector.received_sigterm:
            self._note()
            connector.received_sigterm = False
            self.held = True
        elif step_end and self.held:
            connector.received_sigterm = True
            self.held = False

    def _note(self) -> None:
        if self._warned or self.trainer is None:
            return
        self._warned = True
        if not _saves_on_exception(self.trainer):
            log.warning("SIGTERM: no callback saves a checkpoint on it (ModelCheckpoint(save_on_exception=True), "
                        "OnExceptionCheckpoint or SLURM auto-requeue): a resume starts from the last periodic one")
        else:
            log.info("SIGTERM: stopping at the end of the last finished optimizer step")


def _saves_on_exception(trainer: Any) -> bool:
    if any(isinstance(c, OnExceptionCheckpoint) or (isinstance(c, ModelCheckpoint) and c.save_on_exception)
           for c in trainer.callbacks):
        return True
    environment: Optional[Any] = trainer._accelerator_connector.cluster_environment  # Lightning 2.6 (canary test)
    return isinstance(environment, SLURMEnvironment) and environment.auto_requeue
