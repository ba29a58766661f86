"""Parallel backends for GRPO: single device and DDP (:mod:`~lightning_grpo.strategies.local`), FSDP2
(:mod:`~lightning_grpo.strategies.fsdp`), FSDP1 (:mod:`~lightning_grpo.strategies.fsdp1`) and Megatron
(:mod:`~lightning_grpo.strategies.megatron.strategy`, imported on first use: megatron-core is optional and slow to
import), behind one interface, :class:`~lightning_grpo.strategies.backend.ParallelBackend`.

Importing this package registers ``Trainer(strategy="grpo_fsdp2")`` and ``"grpo_fsdp2_cpu_offload"``.
"""

from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_grpo.strategies._gather import (
    GatheredGenerationEngine,
    full_state_dict,
    gathered_parameters,
    is_fsdp1,
    is_fsdp2,
    is_sharded,
)
from lightning_grpo.strategies.backend import GRPOModels, ParallelBackend
from lightning_grpo.strategies.backend_registry import backend_for, compute_dtype, precision_dtype
from lightning_grpo.strategies.fsdp import (
    FSDP2Backend,
    FSDP2Strategy,
    decoder_layers,
    mixed_precision_policy,
    shard_model,
)
from lightning_grpo.strategies.fsdp1 import FSDP1Backend
from lightning_grpo.strategies.local import LocalBackend, clip_grad_norm_, grad_norm

__all__ = [
    "FSDP1Backend", "FSDP2Backend", "FSDP2Strategy", "GRPOModels", "GatheredGenerationEngine", "LocalBackend",
    "MegatronStrategy", "ParallelBackend", "backend_for", "clip_grad_norm_", "compute_dtype", "decoder_layers",
    "full_state_dict", "gathered_parameters", "grad_norm", "is_fsdp1", "is_fsdp2", "is_sharded",
    "mixed_precision_policy", "precision_dtype", "shard_model",
]


def __getattr__(name: str) -> Any:
    if name == "MegatronStrategy":  # lazily: megatron-core is optional and slow to import
        from lightning_grpo.strategies.megatron.strategy import MegatronStrategy

        return MegatronStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: Registered strategy names -> FSDP2Strategy keyword arguments.
STRATEGY_NAMES = {"grpo_fsdp2": {}, "grpo_fsdp2_cpu_offload": {"cpu_offload": True}}
for _name, _kwargs in STRATEGY_NAMES.items():
    if _name not in StrategyRegistry:
        StrategyRegistry.register(_name, FSDP2Strategy, description=f"GRPO FSDP2 (fully_shard) {_kwargs}", **_kwargs)
