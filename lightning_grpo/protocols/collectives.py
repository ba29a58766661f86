"""The data-parallel collectives that the rollout, training and loop components share: one :class:`Collectives` record,
made by the parallel backend (:meth:`lightning_grpo.strategies.backend.ParallelBackend.collectives`), and
:func:`gather_per_process` for the checkpointed per-process state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor


def _identity(tensor: Tensor) -> Tensor:
    return tensor


@dataclass(frozen=True)
class Collectives:
    """Reductions over the processes that hold different data (every process must call each one together; on one
    process they are identities).

    Attributes:
        reduce_sum: ``tensor -> tensor``, the elementwise sum over the processes (same shape and device).
        reduce_max: ``tensor -> tensor``, the elementwise maximum over the processes.
        device: where the flags of :meth:`any_process` are reduced (the backend's communication device).
    """

    reduce_sum: Callable[[Tensor], Tensor] = _identity
    reduce_max: Callable[[Tensor], Tensor] = _identity
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def any_process(self, flag: bool) -> bool:
        """True when ``flag`` is True on any process (a collective)."""
        return bool(self.reduce_sum(torch.tensor([float(flag)], device=self.device)).item() > 0)


def gather_per_process(value: Any) -> list[Any]:
    """``value`` of every process, indexed by global rank (a collective when a process group exists: every
    process must call it)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values
