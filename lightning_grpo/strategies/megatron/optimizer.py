"""megatron-core's distributed optimizer behind Lightning's optimizer interface.

``MegatronStrategy(use_distributed_optimizer=True)`` wraps the policy in megatron-core's
``DistributedDataParallel`` (contiguous gradient buffers, reduce-scattered over the data-parallel group after the
step's last backward) and replaces the module's optimizer with megatron-core's ``DistributedOptimizer``: each
data-parallel rank keeps the Adam moments (and, for 16-bit weights, the fp32 master weights) of its 1/DP slice of
the gradient buffer only, steps that slice and all-gathers the updated weights (ZeRO stage 1, Rajbhandari et al.
2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", sec. 5.1).

:func:`megatron_optimizer_config` translates the module's ``configure_optimizers`` optimizer (torch ``AdamW``
or ``Adam``, one param group) into megatron-core's ``OptimizerConfig``;
:class:`DistributedOptimizerAdapter` is what Lightning steps: the module's own optimizer stays as the holder of the
hyper-parameters (its LR scheduler keeps updating its ``lr``, copied into megatron-core's groups before each step),
``grad_norm``/clipping use megatron-core's norm over the sharded gradients, and :class:`DistParamStates` reads and
writes the per-parameter states for the layout-independent checkpoints
(:mod:`lightning_grpo.strategies.megatron.checkpoint`). A mixture of experts split over ranks gets two of them,
chained (megatron-core's ``ChainedOptimizer``): one for the dense parameters over the data-parallel group, one for
the experts' over the expert-data-parallel group; the gradient norm combines both.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_grpo.strategies.megatron import cpu_shims


def megatron_optimizer_config(optimizer: torch.optim.Optimizer, params_dtype: torch.dtype) -> Any:
    """megatron-core's ``OptimizerConfig`` (``use_distributed_optimizer=True``, no clipping of its own) with the
    hyper-parameters of ``optimizer`` (the module's).

    Raises:
        ValueError: an optimizer other than torch ``AdamW``/``Adam`` (megatron-core's distributed optimizer is Adam
            only), options megatron-core does not have (``amsgrad``, ``maximize``), or more than one param group.
    """
    from megatron.core.optimizer import OptimizerConfig

    if len(optimizer.param_groups) != 1:
        raise ValueError(f"MegatronStrategy(use_distributed_optimizer=True) takes an optimizer with one param group, "
                         f"got {len(optimizer.param_groups)}")
    group = optimizer.param_groups[0]
    common = dict(lr=float(group["lr"]), weight_decay=float(group.get("weight_decay", 0.0)),
                  use_distributed_optimizer=True, clip_grad=0.0, bf16=params_dtype == torch.bfloat16,
                  fp16=params_dtype == torch.float16, params_dtype=params_dtype)
    kind = type(optimizer)
    if kind not in (torch.optim.AdamW, torch.optim.Adam):  # megatron-core 0.16's DistributedOptimizer: Adam only
        raise ValueError(f"MegatronStrategy(use_distributed_optimizer=True) builds megatron-core's distributed Adam "
                         f"from the module's optimizer; {kind.__name__} is neither torch.optim.AdamW nor Adam")
    for flag in ("amsgrad", "maximize"):
        if group.get(flag):
            raise ValueError(f"{kind.__name__}({flag}=True) has no megatron-core equivalent")
    beta1, beta2 = group["betas"]
    return OptimizerConfig(optimizer="adam", adam_beta1=float(beta1), adam_beta2=float(beta2),
                           adam_eps=float(group["eps"]), decoupled_weight_decay=kind is torch.optim.AdamW, **common)


def wrap_ddp(model: nn.Module) -> nn.Module:
    """``model`` (a ``GPTModel``) in megatron-core's ``DistributedDataParallel`` for the distributed optimizer (no
    overlap of communication, gradients averaged over the data-parallel group), with its config's
    ``no_sync_func`` and ``finalize_model_grads_func`` set, so the schedules reduce the gradients (and sum the two
    copies of a tied embedding across the first and last pipeline stages). Parameters become views into its
    contiguous buffer."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    config = model.config
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=False,
                                               overlap_param_gather=False, average_in_collective=False)
    wrapper = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.no_sync_func = wrapper.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return wrapper


def build_distributed_optimizer(hyper: torch.optim.Optimizer, ddp: nn.Module, params_dtype: torch.dtype) -> Any:
    """megatron-core's ``DistributedOptimizer`` over ``ddp``'s buffers, configured from ``hyper`` (a
    ``ChainedOptimizer`` of the dense and the expert one for a mixture of experts split over ranks)."""
    from megatron.core.optimizer import get_megatron_optimizer

    config = megatron_optimizer_config(hyper, params_dtype)
    with cpu_shims.cuda_type_names(list(ddp.parameters())):
        optimizer = get_megatron_optimizer(config, [ddp], config_overrides={})  # {}: weight decay on every param
    parts = optimizer_parts(optimizer)
    return parts[0] if len(parts) == 1 else optimizer  # one chained optimizer for dense models


def optimizer_parts(optimizer: Any) -> list[Any]:
    """The ``DistributedOptimizer`` s of a megatron-core optimizer: the chained ones of a ``ChainedOptimizer``, else
    the optimizer itself."""
    from megatron.core.optimizer import ChainedOptimizer

    return list(optimizer.chained_optimizers) if isinstance(optimizer, ChainedOptimizer) else [optimizer]


class DistributedOptimizerAdapter(torch.optim.Optimizer):
    """megatron-core's distributed optimizer as Lightning steps a torch optimizer.

    ``step(closure)`` runs the closure (the module's ``training_step``, ``on_before_optimizer_step`` and gradient
    clipping), then, if gradients were computed since the last :meth:`zero_grad` (:meth:`gradients_ready`),
    megatron-core's ``prepare_grads`` (copy the reduced gradient shard to the main parameters) and
    ``step_with_ready_grads`` (Adam on the shard, all-gather of the weights). :meth:`prepare` gives the norm of the
    full gradient (megatron-core's ``get_grad_norm``: sums of squares over the shards, tensor- and pipeline-parallel
    ranks, duplicates counted once) and :meth:`clip` scales the main gradients by ``min(1, clip / (norm + 1e-6))``,
    as ``torch.nn.utils.clip_grad_norm_`` does.

    Args:
        hyper: the module's optimizer: its param groups hold the hyper-parameters (``lr`` set by the LR scheduler)
            and it is never stepped.
        megatron: megatron-core's ``DistributedOptimizer`` (or ``ChainedOptimizer`` of them).
        ddp: the ``DistributedDataParallel`` wrapper whose buffers it steps.
    """

    def __init__(self, hyper: torch.optim.Optimizer, megatron: Any, ddp: nn.Module) -> None:
        # torch.optim.Optimizer.__init__ is not called: the parameters belong to megatron-core's optimizer
        self.hyper = hyper
        self.megatron = megatron
        self.ddp = ddp
        self.defaults = hyper.defaults
        self._ready = False
        self._norm: Optional[Tensor] = None

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The hyper-parameter groups (the module's optimizer's)."""
        return self.hyper.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The inner torch optimizers' states (this rank's shards)."""
        parts = optimizer_parts(self.megatron)
        return {param: state for part in parts for param, state in part.optimizer.state.items()}

    def gradients_ready(self) -> None:
        """The step's backward passes are done (the schedules reduced the gradients)."""
        self._ready = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffers and the main gradients; the next :meth:`step` is skipped unless
        :meth:`gradients_ready` is called again (a step whose gradients were dropped, e.g. non-finite)."""
        self.ddp.zero_grad_buffer()
        self.megatron.zero_grad(set_to_none)
        self._ready = False
        self._norm = None

    def prepare(self) -> Tensor:
        """Copy the reduced gradients into the main parameters (once per step) and return the full gradient's norm
        (0-dim float32). A collective over every rank."""
        if self._norm is None:
            self.megatron.prepare_grads()
            self._norm = torch.tensor(float(self.megatron.get_grad_norm()), dtype=torch.float32)
        return self._norm

    @torch.no_grad()
    def clip(self, max_norm: float) -> Tensor:
        """Clip the main gradients to ``max_norm`` by the full norm; returns the norm before clipping."""
        norm = self.prepare()
        coefficient = float(max_norm) / (float(norm) + 1e-6)
        if coefficient < 1.0:
            for part in optimizer_parts(self.megatron):
                for param in part.get_parameters():
                    if param.grad is not None:
                        param.grad.mul_(coefficient)
        return norm

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:  # type: ignore[override]
        loss = closure() if closure is not None else None
        if self._ready:
            self.prepare()
            source = self.hyper.param_groups[0]
            for group in self.megatron.param_groups:
                group.update({k: source[k] for k in ("lr", "weight_decay", "betas", "eps") if k in source})
            self.megatron.step_with_ready_grads()
        self._ready = False
        self._norm = None
        return loss

    def state_dict(self) -> dict[str, Any]:  # pragma: no cover - MegatronStrategy.optimizer_state is used
        raise RuntimeError("DistributedOptimizerAdapter.state_dict: use MegatronStrategy.optimizer_state (a "
                           "collective that gathers the sharded states into HF names)")

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # pragma: no cover
        raise RuntimeError("DistributedOptimizerAdapter.load_state_dict: use "
                           "MegatronStrategy.load_optimizer_state_dict")


class DistParamStates:
    """:class:`~lightning_grpo.strategies.megatron.checkpoint.ParamStates` of megatron-core's ``DistributedOptimizer``
    (or of the ``DistributedOptimizer`` s a ``ChainedOptimizer`` holds): each data-parallel rank holds the states of one
    contiguous range of every parameter's flat view (its range in the gradient buffer, possibly empty); :meth:`get`
    all-gathers the ranges over the parameter's data-parallel group (the expert-data-parallel one for an expert
    split over ranks, megatron-core's ``allreduce = False``) into tensors of the parameter's shape, :meth:`set` keeps
    this rank's range. ``"param"`` (the fp32 main weights) is included for 16-bit weights only (for fp32 weights the
    main parameter is a view of the weight itself). Reads megatron-core 0.16's ``model_param_group_index_map`` and
    ``_get_model_param_range_map``."""

    def __init__(self, optimizer: Any) -> None:
        self.parts = optimizer_parts(optimizer)

    def _owner(self, param: Tensor) -> Optional[Any]:
        """The ``DistributedOptimizer`` that steps ``param``, or None."""
        return next((part for part in self.parts if param in part.model_param_group_index_map), None)

    def _main(self, param: Tensor) -> Optional[Tensor]:
        owner = self._owner(param)
        if owner is None:
            return None
        group, order = owner.model_param_group_index_map[param]
        return owner.optimizer.param_groups[group]["params"][order]

    def _range(self, param: Tensor) -> Optional[tuple[int, int]]:
        owner = self._owner(param)
        if owner is None:
            return None
        try:
            r = owner._get_model_param_range_map(param)["param"]
        except KeyError:
            return None
        return (r.start, r.end) if r.end > r.start else None

    def get(self, param: Tensor) -> Optional[dict[str, Any]]:
        from megatron.core import parallel_state

        main, span = self._main(param), self._range(param)
        local: Optional[dict[str, Any]] = None
        owner = self._owner(param)
        if owner is not None and main is not None and span is not None:
            state = owner.optimizer.state.get(main)
            if state:
                local = {k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in state.items()}
                if param.dtype != torch.float32:
                    local["param"] = main.detach().cpu()
        expert = not getattr(param, "allreduce", True)
        group = parallel_state.get_expert_data_parallel_group() if expert else parallel_state.get_data_parallel_group()
        parts: list[Any] = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(parts, (span, local), group=group)
        found = [(s, v) for s, v in parts if s is not None and v is not None]
        if not found:
            return None
        values: dict[str, Any] = {}
        for key, first in found[0][1].items():
            if torch.is_tensor(first) and first.dim() > 0:
                flat = torch.zeros(param.numel(), dtype=first.dtype)
                for (start, end), part in found:
                    flat[start:end] = part[key]
                values[key] = flat.view(param.shape).to(param.device)
            else:
                values[key] = first
        return values

    def set(self, param: Tensor, values: dict[str, Any]) -> None:
        main, span, owner = self._main(param), self._range(param), self._owner(param)
        if main is None or span is None or owner is None:
            return
        start, end = span
        state: dict[str, Any] = {}
        for key, value in values.items():
            if torch.is_tensor(value) and value.dim() > 0:
                piece = value.reshape(-1)[start:end].to(device=main.device)
                if key == "param":
                    main.data.copy_(piece)
                    continue
                state[key] = piece.to(dtype=main.dtype if piece.is_floating_point() else piece.dtype).clone()
            else:
                state[key] = value.clone() if torch.is_tensor(value) else value
        owner.optimizer.state[main] = state
