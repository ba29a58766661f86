"""The rollout events (:mod:`lightning_grpo.events`) as typed Lightning callback hooks: :class:`GRPOCallback`.

A callback that reacts to rollouts subclasses :class:`GRPOCallback` and overrides ``on_weights_synced``,
``on_rollout_end`` or ``on_experience``; an :class:`EventRoute` (the module makes one at each setup, picking the
trainer's ``GRPOCallback`` s once) calls them on every such callback of the trainer, in the order of
``trainer.callbacks``. A subclass method that starts with ``on_`` but is neither one of these nor a
Lightning hook (``on_rolout_end``) is reported when the class is defined, so a misspelled hook does not silently
never fire.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Optional, Sequence

import lightning as L
from lightning.pytorch.callbacks import Callback

from lightning_grpo.events import ON_EXPERIENCE, ON_ROLLOUT_END, ON_WEIGHTS_SYNCED, ExperienceReady, RolloutEnd


class GRPOCallback(Callback):
    """A Lightning ``Callback`` with the rollout events as hooks (each a no-op here)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        known = set(dir(Callback)) | set(_DISPATCH)
        unknown = sorted(name for name in vars(cls) if name.startswith("on_") and name not in known)
        if unknown:
            warnings.warn(f"{cls.__name__} defines {', '.join(unknown)}, which is neither a Lightning callback hook "
                          f"nor a rollout event ({', '.join(_DISPATCH)}): it is never called (a typo?)",
                          UserWarning, stacklevel=2)

    def on_weights_synced(self, trainer: L.Trainer, pl_module: L.LightningModule, version: int) -> None:
        """The engine now generates with the weights after ``version`` optimizer steps."""

    def on_rollout_end(self, trainer: L.Trainer, pl_module: L.LightningModule, rollout: RolloutEnd) -> None:
        """A rollout was generated and scored (before shaping and advantages)."""

    def on_experience(self, trainer: L.Trainer, pl_module: L.LightningModule, experience: ExperienceReady) -> None:
        """A rollout's experience (advantages, old/ref logprobs) is ready; training on it follows."""


#: event name -> how a GRPOCallback receives it.
_DISPATCH: dict[str, Callable[[GRPOCallback, L.Trainer, L.LightningModule, Any], None]] = {
    ON_WEIGHTS_SYNCED: lambda cb, trainer, module, payload: cb.on_weights_synced(trainer, module, payload),
    ON_ROLLOUT_END: lambda cb, trainer, module, payload: cb.on_rollout_end(trainer, module, payload),
    ON_EXPERIENCE: lambda cb, trainer, module, payload: cb.on_experience(trainer, module, payload),
}


class EventRoute:
    """The trainer's :class:`GRPOCallback` s, picked once (:meth:`of`, at the module's setup), that each rollout
    event goes to (``route(pl_module, name, payload)``); a route without a trainer delivers nothing.

    Args:
        trainer: the trainer the callbacks belong to, or None.
        callbacks: its ``GRPOCallback`` s, in the order of ``trainer.callbacks``.
    """

    def __init__(self, trainer: Optional[L.Trainer] = None, callbacks: Sequence[GRPOCallback] = ()) -> None:
        self.trainer = trainer
        self.callbacks = list(callbacks)

    @classmethod
    def of(cls, trainer: L.Trainer) -> "EventRoute":
        """Pick ``trainer.callbacks``' ``GRPOCallback`` s; warn about a plain ``Callback`` that defines a
        rollout-event method (it would never be called)."""
        typed = []
        for callback in trainer.callbacks:
            if isinstance(callback, GRPOCallback):  # the one probe: Lightning hands a list of Callbacks
                typed.append(callback)
            elif names := [name for name in _DISPATCH if name in vars(type(callback))]:
                warnings.warn(f"{type(callback).__name__} defines {', '.join(names)} but is not a "
                              "lightning_grpo.callbacks.GRPOCallback: rollout events reach GRPOCallback subclasses "
                              "only", UserWarning, stacklevel=2)
        return cls(trainer, typed)

    def __call__(self, pl_module: L.LightningModule, name: str, payload: Any) -> None:
        """Call the hook ``name`` on every picked callback, in order.

        Raises:
            KeyError: ``name`` is not a rollout event.
        """
        hook = _DISPATCH[name]
        if self.trainer is None:
            return
        for callback in self.callbacks:
            hook(callback, self.trainer, pl_module, payload)
