"""Which :class:`~lightning_grpo.strategies.backend.ParallelBackend` a Lightning strategy gets: :func:`backend_for`, and
the dtype the policy computes in under it: :func:`compute_dtype`; both dispatched on the strategy's class
(``functools.singledispatch``), so that no caller asks a strategy what it is."""

from __future__ import annotations

import functools
from typing import Any

import torch
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


#: Lightning precision names (``Trainer(precision=...)``, the precision plugin's ``precision``) by their prefix -> the
#: dtype the forward pass computes in ("bf16-mixed": autocast; "bf16-true": bfloat16 parameters).
PRECISION_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16, "64": torch.float64}


def precision_dtype(precision: str, parameter_dtype: torch.dtype) -> torch.dtype:
    """The dtype a forward pass computes in under the Lightning ``precision`` ("bf16-mixed", "bf16-true" ->
    bfloat16; "16-mixed", "16-true" -> float16; "64-true" -> float64; else ``parameter_dtype``: "32-true" computes in
    the parameters' dtype, e.g. a policy loaded with ``GRPOModule(dtype="bfloat16")``)."""
    for prefix, dtype in PRECISION_DTYPES.items():
        if str(precision).startswith(prefix + "-") or str(precision) == prefix:
            return dtype
    return parameter_dtype


@functools.singledispatch
def compute_dtype(strategy: Any, parameter_dtype: torch.dtype) -> torch.dtype:
    """The dtype the policy's forward pass computes in under ``strategy`` (what ``engine.dtype="auto"`` resolves
    to): its precision plugin's (:func:`precision_dtype`); a strategy of your own registers its rule with
    ``@compute_dtype.register``."""
    return precision_dtype(strategy.precision_plugin.precision, parameter_dtype)


@compute_dtype.register
def _fsdp2_dtype(strategy: FSDP2Strategy, parameter_dtype: torch.dtype) -> torch.dtype:
    """FSDP2's ``mixed_precision`` (``MixedPrecisionPolicy.param_dtype``: the dtype its all-gathered parameters
    compute in) when set, else the precision plugin's."""
    param_dtype = strategy.mp_policy.param_dtype
    return param_dtype if param_dtype is not None else precision_dtype(strategy.precision_plugin.precision,
                                                                       parameter_dtype)
