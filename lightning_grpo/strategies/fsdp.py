"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for GRPO through Lightning's ``ModelParallelStrategy``.

Lightning runs FSDP2 as ``ModelParallelStrategy``: the strategy builds a device mesh and calls the module's
``configure_model`` hook, where the module applies ``fully_shard`` itself. :class:`FSDP2Strategy` is that
strategy with the FSDP2 settings as fields (mixed precision, activation checkpointing, CPU offload,
``reshard_after_forward``), and a 1-D data-parallel mesh over every process. It is registered as
``Trainer(strategy="grpo_fsdp2")`` (and ``"grpo_fsdp2_cpu_offload"``); it runs on GPUs (NCCL) and on CPUs
(gloo), unlike Lightning's FSDP1 ``strategy="fsdp"``, which needs CUDA.

What :class:`FSDP2Backend` (the backend of any ``ModelParallelStrategy``) does to ``GRPOModule``'s models:

* ``fully_shard`` on every decoder layer (the classes in the HF model's ``_no_split_modules``), then on the
  root (the rest: embeddings, final norm, LM head, which must stay in one group when embeddings are tied), for
  the policy and for the frozen reference policy (``beta > 0``); of a LoRA policy (:mod:`lightning_grpo.models.lora`),
  its transformers model is the root, and its reference policy is the same module (nothing more to shard). Every
  parameter becomes a ``DTensor`` shard (``Shard(0)`` on the data-parallel mesh); the reference policy is never
  held in full on any rank outside a forward.
* Rollouts: each rank generates for its own prompts (Lightning's ``DistributedSampler`` splits the prompt
  batches; the G completions of a prompt are sampled on the rank that holds the prompt, so groups are never
  split). With FSDP2 every forward of a sharded layer all-gathers it, so ``generate`` would all-gather every
  layer for every new token, and ranks whose completions stop early would leave the others waiting inside the
  collective. :func:`~lightning_grpo.strategies._gather.gathered_parameters` instead all-gathers each group
  once (``FSDPModule.unshard``), keeps the full parameters for the whole rollout
  (``set_reshard_after_forward(False)``), and frees them after (``FSDPModule.reshard``): one all-gather per
  group per rollout, and no collective inside ``generate``.
  :class:`~lightning_grpo.strategies._gather.GatheredGenerationEngine` wraps the HF engine with it.
* The engines with their own weights (vLLM, the rollout servers) read them from
  :class:`~lightning_grpo.strategies.module_weights.ModuleWeights` (one ``DTensor.full_tensor()`` per parameter, so
  never the whole model at once); :func:`~lightning_grpo.strategies._gather.full_state_dict` gathers the whole state
  dict (HF export).

Gradients under FSDP2 are reduce-scattered and averaged over the data-parallel ranks, like DDP; the GRPO loss
already multiplies by ``world_size`` and divides by the step's all-reduced normalizer
(:func:`lightning_grpo.training.experience.micro_batches`), so the update does not depend on how the batch is split.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_grpo.strategies._gather import RESHARD_ATTR, GatheredGenerationEngine, full_state_dict, is_fsdp2
from lightning_grpo.strategies.backend import ClipFallback, GRPOModels, clips_by_norm
from lightning_grpo.strategies.local import LocalBackend, clip_grad_norm_
from lightning_grpo.strategies.module_weights import ModuleWeights

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

_DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
    "fp32": torch.float32, "float32": torch.float32,
}

MixedPrecisionSpec = Union[None, str, "MixedPrecisionPolicy"]


def mixed_precision_policy(spec: MixedPrecisionSpec) -> "MixedPrecisionPolicy":
    """FSDP2's ``MixedPrecisionPolicy`` from a dtype name.

    Args:
        spec: None (parameters compute in their stored dtype), a dtype name ("bf16"/"bfloat16",
            "fp16"/"float16", "fp32"/"float32": parameters are all-gathered and computed in it, gradients are
            reduce-scattered in float32), or a ready ``MixedPrecisionPolicy``.

    Raises:
        ValueError: an unknown dtype name (named in the message).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if spec is None:
        return MixedPrecisionPolicy()
    if isinstance(spec, MixedPrecisionPolicy):
        return spec
    if not isinstance(spec, str) or spec.lower() not in _DTYPES:
        raise ValueError(f"mixed_precision={spec!r}: choose None, one of {sorted(_DTYPES)}, or a MixedPrecisionPolicy")
    return MixedPrecisionPolicy(param_dtype=_DTYPES[spec.lower()], reduce_dtype=torch.float32)


class FSDP2Strategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` as pure FSDP2 for GRPO: one data-parallel mesh dimension over all
    processes; ``GRPOModule.configure_model`` shards with ``fully_shard`` through :class:`FSDP2Backend`.

    Use ``Trainer(strategy=FSDP2Strategy(...))`` or ``Trainer(strategy="grpo_fsdp2")`` (after
    ``import lightning_grpo.strategies``); devices/accelerator as usual (``accelerator="cpu"`` uses gloo).

    Args:
        mixed_precision: FSDP2 parameter dtype, see :func:`mixed_precision_policy` (e.g. "bf16": all-gather and
            compute in bfloat16, reduce gradients in float32, keep float32 sharded master weights).
        activation_checkpointing: recompute each decoder layer's activations in backward (the HF model's
            non-reentrant gradient checkpointing), for the policy only.
        cpu_offload: keep sharded parameters, gradients and optimizer state in CPU memory
            (``CPUOffloadPolicy``); the optimizer step then runs on CPU.
        reshard_after_forward: free each decoder layer's full parameters after its forward and all-gather them
            again in backward (True, ZeRO-3 memory) or keep them until backward (False, ZeRO-2-like, less
            communication). The root group always keeps them (it is needed first in backward).
        data_parallel_size: "auto" or the world size (GRPOModule shards over every process; tensor parallelism
            is not supported).
        save_distributed_checkpoint: True (default): checkpoints are folders with one shard file per rank
            (``torch.distributed.checkpoint``); False: rank 0 writes one full ``.ckpt`` file.
        process_group_backend: None picks NCCL on GPUs, gloo on CPUs.
        timeout: collective timeout.

    Raises:
        ValueError: a bad ``mixed_precision``, or ``data_parallel_size`` different from the world size (at setup).
    """

    def __init__(
        self,
        mixed_precision: MixedPrecisionSpec = None,
        activation_checkpointing: bool = False,
        cpu_offload: bool = False,
        reshard_after_forward: bool = True,
        data_parallel_size: Union[Literal["auto"], int] = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.mp_policy = mixed_precision_policy(mixed_precision)
        self.activation_checkpointing = bool(activation_checkpointing)
        self.cpu_offload = bool(cpu_offload)
        self.reshard_after_forward = bool(reshard_after_forward)

    @override
    def setup_environment(self) -> None:
        world_size = self.num_nodes * self.num_processes
        if self._data_parallel_size == "auto":
            self._data_parallel_size = world_size
        if self._data_parallel_size != world_size:
            raise ValueError(
                f"FSDP2Strategy(data_parallel_size={self._data_parallel_size}) must be 'auto' or the world size "
                f"({world_size}): GRPOModule shards over every process (no tensor parallelism)"
            )
        super().setup_environment()

    def offload_policy(self) -> Any:
        """``CPUOffloadPolicy`` when ``cpu_offload`` else the no-offload ``OffloadPolicy``."""
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        if self.cpu_offload:
            return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
        return OffloadPolicy()


# --------------------------------------------------------------------------------------------------- sharding
def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP2 shards one by one: instances of the classes named in the HF model's
    ``_no_split_modules`` (e.g. ``LlamaDecoderLayer``); for other models, the items of every ``nn.ModuleList``.
    Returns an empty list when neither exists (then only the root is sharded)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if layers:
        return layers
    return [item for m in model.modules() if isinstance(m, nn.ModuleList) for item in m]


def shard_model(
    model: nn.Module,
    mesh: "DeviceMesh",
    *,
    mp_policy: Optional["MixedPrecisionPolicy"] = None,
    offload_policy: Any = None,
    reshard_after_forward: bool = True,
    root_reshard_after_forward: bool = False,
) -> nn.Module:
    """Apply ``fully_shard`` to each decoder layer (:func:`decoder_layers`) and then to ``model`` (the root group
    holds the remaining parameters; tied input/output embeddings stay together there). In place; idempotent.

    Args:
        model: an ``nn.Module`` (an HF causal LM).
        mesh: the 1-D data-parallel ``DeviceMesh`` to shard over.
        mp_policy: FSDP2 mixed precision (None: compute in the parameters' dtype).
        offload_policy: FSDP2 offload policy (None: none).
        reshard_after_forward: for the decoder layers, see :class:`FSDP2Strategy`.
        root_reshard_after_forward: for the root group. False for a trained model (its parameters are needed
            first in backward); True for a frozen one (no backward would ever free them).

    Returns:
        ``model``, now an ``FSDPModule``.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if isinstance(model, FSDPModule):
        return model
    kwargs = dict(
        mesh=mesh, mp_policy=mp_policy or MixedPrecisionPolicy(), offload_policy=offload_policy or OffloadPolicy()
    )
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kwargs)
        setattr(layer, RESHARD_ATTR, reshard_after_forward)
    fully_shard(model, reshard_after_forward=root_reshard_after_forward, **kwargs)
    setattr(model, RESHARD_ATTR, root_reshard_after_forward)
    return model


# ---------------------------------------------------------------------------------------------------- backend
class FSDP2Backend(LocalBackend):
    """:class:`~lightning_grpo.strategies.backend.ParallelBackend` of a ``ModelParallelStrategy`` (and of
    :class:`FSDP2Strategy`): FSDP2 over its data-parallel mesh (see the module docstring). Reductions are
    :class:`~lightning_grpo.strategies.local.LocalBackend`'s (``strategy.reduce`` over every process).

    Args:
        strategy: the ``ModelParallelStrategy``.
        settings: its FSDP2 settings (the strategy itself when it is an :class:`FSDP2Strategy`); None: FSDP2's
            defaults.
    """

    def __init__(self, strategy: Any, settings: Optional[FSDP2Strategy] = None) -> None:
        super().__init__(strategy)
        self.settings = settings if settings is not None else FSDP2Strategy()

    def configure(self, models: GRPOModels) -> GRPOModels:
        """Shard the policy, the reference policy and the distillation teacher with FSDP2 over the strategy's
        data-parallel mesh and make the HF rollout engine gather the policy once per rollout; the engines that hold
        their own weights read them gathered one ``DTensor`` at a time (a collective). Idempotent
        (``configure_model`` may run again).

        Raises:
            ValueError: a plain ``ModelParallelStrategy`` with a tensor-parallel mesh dimension larger than 1 (its
                default on one node): the prompts would not be split over those ranks; activation checkpointing
                for a model that does not support it.
        """
        mesh = self.strategy.device_mesh
        if mesh.ndim > 1 and "tensor_parallel" in (mesh.mesh_dim_names or ()) and mesh["tensor_parallel"].size() > 1:
            raise ValueError(
                f"ModelParallelStrategy with tensor_parallel_size={mesh['tensor_parallel'].size()}: GRPOModule "
                "shards with FSDP2 over the data-parallel dimension only; use strategy='grpo_fsdp2' (lightning_grpo."
                "strategies.FSDP2Strategy) or ModelParallelStrategy(data_parallel_size=<world size>, "
                "tensor_parallel_size=1)"
            )
        dp_mesh = mesh["data_parallel"] if mesh.mesh_dim_names and "data_parallel" in mesh.mesh_dim_names else mesh
        settings = self.settings
        kwargs = dict(mp_policy=settings.mp_policy, offload_policy=settings.offload_policy())
        policy, ref, engine = models.policy, models.ref, models.engine
        if not is_fsdp2(policy):
            if settings.activation_checkpointing and not getattr(policy, "is_gradient_checkpointing", False):
                if not getattr(policy, "supports_gradient_checkpointing", False):
                    raise ValueError(
                        f"activation_checkpointing=True but {type(policy).__name__} does not support "
                        "gradient checkpointing (transformers' supports_gradient_checkpointing)"
                    )
                policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            # a PEFT (LoRA) policy: its transformers model is the root, which the HF engine generates with
            root = policy.get_base_model() if models.lora else policy
            shard_model(root, dp_mesh, reshard_after_forward=settings.reshard_after_forward, **kwargs)
        for frozen in (ref, models.teacher):  # the reference and the distillation teacher
            if frozen is not None and not is_fsdp2(frozen):
                shard_model(frozen, dp_mesh, reshard_after_forward=True, root_reshard_after_forward=True, **kwargs)
        if engine is not None and engine.capabilities.uses_policy_parameters:
            engine = GatheredGenerationEngine(engine, policy)
        weights = ModuleWeights(policy, collective=True, forward_context=self.forward_context)
        return GRPOModels(policy, ref, engine, lora=models.lora, weights=weights, sharded=True, teacher=models.teacher)

    def clip_gradients(
        self,
        policy: nn.Module,
        optimizer: Optimizer,
        gradient_clip_val: Optional[Union[int, float]],
        gradient_clip_algorithm: Optional[str],
        fallback: ClipFallback,
    ) -> Optional[Tensor]:
        """By norm: :func:`~lightning_grpo.strategies.local.clip_grad_norm_` over the optimizer's ``DTensor``
        parameters (the norm of the full gradient, a collective); by value: Lightning's ``fallback``."""
        if not clips_by_norm(gradient_clip_val, gradient_clip_algorithm):
            fallback(optimizer, gradient_clip_val, gradient_clip_algorithm)
            return None
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return clip_grad_norm_(params, float(gradient_clip_val))

    def export_state_dict(self, policy: nn.Module) -> Optional[dict[str, Any]]:
        """The full state dict gathered onto rank 0 (on CPU; ``{}`` elsewhere). A collective."""
        return full_state_dict(policy, rank0_only=True) if is_fsdp2(policy) else None
