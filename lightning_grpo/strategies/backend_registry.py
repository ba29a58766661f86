"""Which :class:`~lightning_grpo.strategies.backend.ParallelBackend` a Lightning strategy gets: :func:`backend_for`,
dispatched on the strategy's class (``functools.singledispatch``), so that no caller asks a strategy what it is."""

from __future__ import annotations

import functools
from typing import Any

from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from lightning_grpo.strategies.backend import ParallelBackend
from lightning_grpo.strategies.fsdp import FSDP2Backend, FSDP2Strategy
from lightning_grpo.strategies.fsdp1 import FSDP1Backend
from lightning_grpo.strategies.local import LocalBackend


@functools.singledispatch
def backend_for(strategy: Any) -> ParallelBackend:
    """The backend of a Lightning strategy, by its class (``functools.singledispatch``: the most specific registered
    class wins): :class:`FSDP2Backend` with the strategy's settings for :class:`FSDP2Strategy`, with FSDP2's defaults
    for another ``ModelParallelStrategy``, :class:`FSDP1Backend` for ``FSDPStrategy``, the strategy itself for
    ``MegatronStrategy`` (registered by its module), else :class:`LocalBackend` (single device, DDP). A strategy of
    your own registers its backend with ``@backend_for.register``."""
    return LocalBackend(strategy)


@backend_for.register
def _model_parallel(strategy: ModelParallelStrategy) -> ParallelBackend:
    return FSDP2Backend(strategy)


@backend_for.register
def _fsdp2(strategy: FSDP2Strategy) -> ParallelBackend:
    return FSDP2Backend(strategy, settings=strategy)


@backend_for.register
def _fsdp1(strategy: FSDPStrategy) -> ParallelBackend:
    return FSDP1Backend(strategy)
