"""Lightning strategies for GRPO: FSDP2 (``ModelParallelStrategy``), FSDP1 (``FSDPStrategy``) and DDP support.

``GRPOModule`` runs unchanged under ``strategy="ddp"``, ``strategy="fsdp"`` (Lightning's FSDP1, CUDA only) and
FSDP2: ``strategy="grpo_fsdp2"`` (registered here; :class:`FSDP2Strategy`) or a
``ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)``. Importing this package registers
the names ``"grpo_fsdp2"`` and ``"grpo_fsdp2_cpu_offload"`` in Lightning's ``StrategyRegistry``.

The seams the module calls:

* :func:`configure_sharding` (from ``GRPOModule.configure_model``) shards the policy and the reference policy;
* :func:`policy_grad_norm` (from ``GRPOModule.on_before_optimizer_step``) is the norm of the full gradient;
* :func:`clip_gradients` (from ``GRPOModule.configure_gradient_clipping``) clips by the norm of the full
  gradient under FSDP1/FSDP2 (Lightning's FSDP1 precision plugin refuses ``gradient_clip_algorithm="norm"``);
* :func:`policy_state_dict_for_export` (from ``GRPOModule.on_fit_end``) gathers the full policy weights for
  ``save_pretrained`` on rank 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Union

from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, StrategyRegistry
import torch
from torch import Tensor

from lightning_grpo.strategies.fsdp1 import configure_fsdp1, is_fsdp1
from lightning_grpo.strategies.fsdp import (
    FSDP2Strategy,
    GatheredGenerationEngine,
    clip_grad_norm_,
    configure_fsdp2,
    decoder_layers,
    full_state_dict,
    gathered_parameters,
    grad_norm,
    is_fsdp2,
    mixed_precision_policy,
    shard_model,
)

if TYPE_CHECKING:
    from torch.optim import Optimizer

    from lightning_grpo.module import GRPOModule

__all__ = [
    "FSDP2Strategy",
    "GatheredGenerationEngine",
    "clip_grad_norm_",
    "clip_gradients",
    "configure_sharding",
    "decoder_layers",
    "full_state_dict",
    "gathered_parameters",
    "grad_norm",
    "is_fsdp1",
    "is_fsdp2",
    "mixed_precision_policy",
    "policy_grad_norm",
    "policy_state_dict_for_export",
    "shard_model",
    "MegatronStrategy",
]


def __getattr__(name: str) -> Any:
    """``MegatronStrategy`` is imported on first use: megatron-core is optional and slow to import (~5 s)."""
    if name == "MegatronStrategy":
        from lightning_grpo.strategies.megatron import MegatronStrategy

        return MegatronStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

#: Registered strategy names -> FSDP2Strategy keyword arguments.
STRATEGY_NAMES = {"grpo_fsdp2": {}, "grpo_fsdp2_cpu_offload": {"cpu_offload": True}}
for _name, _kwargs in STRATEGY_NAMES.items():
    if _name not in StrategyRegistry:
        StrategyRegistry.register(_name, FSDP2Strategy, description=f"GRPO FSDP2 (fully_shard) {_kwargs}", **_kwargs)


def configure_sharding(module: "GRPOModule") -> None:
    """Shard ``module.policy`` (and its reference policy) for the trainer's strategy.

    * A strategy with its own ``configure_grpo_module(module)`` method (e.g. a Megatron strategy) does it itself.
    * ``ModelParallelStrategy`` / :class:`FSDP2Strategy`: :func:`lightning_grpo.strategies.fsdp.configure_fsdp2`.
    * Lightning's ``FSDPStrategy`` (FSDP1): :func:`lightning_grpo.strategies.fsdp1.configure_fsdp1`.
    * Single device and DDP: nothing to do (DDP replicates both models).
    """
    strategy = module.trainer.strategy
    own = getattr(strategy, "configure_grpo_module", None)
    if callable(own):
        own(module)
    elif isinstance(strategy, ModelParallelStrategy):
        configure_fsdp2(module, strategy)
    elif isinstance(strategy, FSDPStrategy):
        configure_fsdp1(module, strategy)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` is sharded by FSDP2 (``fully_shard``) or wrapped by FSDP1: each forward call then
    all-gathers the parameters, so callers should make few, large forward calls."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch < 2.6
        FSDPModule = ()  # type: ignore[assignment,misc]
    return isinstance(model, FullyShardedDataParallel) or (bool(FSDPModule) and isinstance(model, FSDPModule))


def policy_grad_norm(module: "GRPOModule") -> Optional[Tensor]:
    """The 2-norm of the policy's whole gradient (0-dim float32), or None before any gradient exists.

    FSDP2: the norms of the local ``DTensor`` shards, all-reduced (:func:`grad_norm`); FSDP1: the root's
    ``clip_grad_norm_(inf)`` (computes the norm over all shards, scales nothing). Collectives under FSDP.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel

    own = getattr(module.trainer.strategy, "policy_grad_norm", None)
    if callable(own):  # e.g. MegatronStrategy: the norm over tensor-parallel shards
        return own(module)
    policy = module.policy
    if isinstance(policy, FullyShardedDataParallel):
        if all(p.grad is None for p in policy.parameters()):
            return None
        return policy.clip_grad_norm_(float("inf")).float()
    return grad_norm(policy.parameters())


def clip_gradients(
    module: "GRPOModule",
    optimizer: "Optimizer",
    gradient_clip_val: Optional[Union[int, float]] = None,
    gradient_clip_algorithm: Optional[str] = None,
) -> Optional[Tensor]:
    """Gradient clipping that also works by norm under FSDP.

    By norm (``gradient_clip_algorithm`` "norm" or None, Lightning's default) under FSDP2 this is
    :func:`clip_grad_norm_` over the optimizer's ``DTensor`` parameters; under FSDP1 it is the root
    ``FullyShardedDataParallel.clip_grad_norm_``; otherwise (and for clipping by value) Lightning's own
    ``LightningModule.clip_gradients``.

    Args:
        module: the LightningModule being trained.
        optimizer: the optimizer about to step.
        gradient_clip_val: ``Trainer(gradient_clip_val=...)``; None or 0 disables clipping.
        gradient_clip_algorithm: "norm" (default) or "value".

    Returns:
        the total gradient norm before clipping when clipping by norm under FSDP, else None.
    """
    algorithm = str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm) or "norm").lower()
    if not gradient_clip_val or algorithm != "norm":
        module.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        return None
    strategy = module.trainer.strategy
    if isinstance(strategy, ModelParallelStrategy):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return clip_grad_norm_(params, float(gradient_clip_val))
    if isinstance(strategy, FSDPStrategy):
        from torch.distributed.fsdp import FullyShardedDataParallel

        for root in (module.policy, strategy.model):  # the policy is its own root after configure_fsdp1
            if isinstance(root, FullyShardedDataParallel):
                return root.clip_grad_norm_(float(gradient_clip_val))
    module.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
    return None


def policy_state_dict_for_export(module: "GRPOModule") -> Optional[dict[str, Any]]:
    """The policy's full state dict for ``save_pretrained(state_dict=...)`` on rank 0, or None when
    ``module.policy`` holds its full weights already (single device, DDP).

    A collective under FSDP: every rank must call it; rank 0 gets the tensors (on CPU), the others ``{}``.
    """
    strategy = module.trainer.strategy
    if is_fsdp2(module.policy):
        return full_state_dict(module.policy, rank0_only=True)
    if is_fsdp1(module.policy):
        # torch's FSDP1 rank-0-only gather with CPU offload crashes (segfault) when the parameters are on CPU
        # already: there, gather on every rank instead
        return full_state_dict(module.policy, rank0_only=module.device.type != "cpu")
    return None
