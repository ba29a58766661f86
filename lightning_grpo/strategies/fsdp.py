"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for GRPO through Lightning's ``ModelParallelStrategy``.

Lightning runs FSDP2 as ``ModelParallelStrategy``: the strategy builds a device mesh and calls the module's
``configure_model`` hook, where the module applies ``fully_shard`` itself. :class:`FSDP2Strategy` is that
strategy with the FSDP2 settings as fields (mixed precision, activation checkpointing, CPU offload,
``reshard_after_forward``), and a 1-D data-parallel mesh over every process. It is registered as
``Trainer(strategy="grpo_fsdp2")`` (and ``"grpo_fsdp2_cpu_offload"``); it runs on GPUs (NCCL) and on CPUs
(gloo), unlike Lightning's FSDP1 ``strategy="fsdp"``, which needs CUDA.

What :func:`configure_fsdp2` does to a :class:`~lightning_grpo.module.GRPOModule`:

* ``fully_shard`` on every decoder layer (the classes in the HF model's ``_no_split_modules``), then on the
  root (the rest: embeddings, final norm, LM head, which must stay in one group when embeddings are tied), for
  the policy and for the frozen reference policy (``beta > 0``). Every parameter becomes a ``DTensor`` shard
  (``Shard(0)`` on the data-parallel mesh); the reference policy is never held in full on any rank outside a
  forward.
* Rollouts: each rank generates for its own prompts (Lightning's ``DistributedSampler`` splits the prompt
  batches; the G completions of a prompt are sampled on the rank that holds the prompt, so groups are never
  split). With FSDP2 every forward of a sharded layer all-gathers it, so ``generate`` would all-gather every
  layer for every new token, and ranks whose completions stop early would leave the others waiting inside the
  collective. :func:`gathered_parameters` instead all-gathers each group once (``FSDPModule.unshard``), keeps
  the full parameters for the whole rollout (``set_reshard_after_forward(False)``), and frees them after
  (``FSDPModule.reshard``): one all-gather per group per rollout, and no collective inside ``generate``.
  :class:`GatheredGenerationEngine` wraps the HF engine with it.
* The vLLM engine gets full weights from :func:`lightning_grpo.rollout.weights.hf_weights` (one
  ``DTensor.full_tensor()`` per parameter, so never the whole model at once); :func:`full_state_dict` gathers
  the whole state dict (HF export).

Gradients under FSDP2 are reduce-scattered and averaged over the data-parallel ranks, like DDP; the GRPO loss
already multiplies by ``world_size`` and divides by the step's all-reduced normalizer
(:func:`lightning_grpo.experience.micro_batches`), so the update does not depend on how the batch is split.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Literal, Optional, Sequence, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import Tensor, nn

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lightning_grpo.module import GRPOModule

log = logging.getLogger(__name__)

#: Attribute set on every module this file shards: its ``reshard_after_forward`` (restored after a rollout).
_RESHARD_ATTR = "_lightning_grpo_reshard_after_forward"
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
    processes, sharded with ``fully_shard`` by :class:`~lightning_grpo.module.GRPOModule.configure_model`.

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
def is_fsdp2(model: nn.Module) -> bool:
    """Whether ``model`` (or one of its submodules) was sharded with ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


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
        setattr(layer, _RESHARD_ATTR, reshard_after_forward)
    fully_shard(model, reshard_after_forward=root_reshard_after_forward, **kwargs)
    setattr(model, _RESHARD_ATTR, root_reshard_after_forward)
    return model


def configure_fsdp2(module: "GRPOModule", strategy: ModelParallelStrategy) -> None:
    """Shard ``module.policy`` and ``module.ref_model`` with FSDP2 over the strategy's data-parallel mesh and make
    the HF rollout engine gather the policy once per rollout. Idempotent (``configure_model`` may run again).

    Settings come from the strategy when it is an :class:`FSDP2Strategy`, else FSDP2's defaults.

    Raises:
        ValueError: a plain ``ModelParallelStrategy`` with a tensor-parallel mesh dimension larger than 1 (its
            default on one node): the prompts would not be split over those ranks.
    """
    from lightning_grpo.rollout.hf import HFRolloutEngine

    mesh = strategy.device_mesh
    if mesh.ndim > 1 and "tensor_parallel" in (mesh.mesh_dim_names or ()) and mesh["tensor_parallel"].size() > 1:
        raise ValueError(
            f"ModelParallelStrategy with tensor_parallel_size={mesh['tensor_parallel'].size()}: GRPOModule shards "
            "with FSDP2 over the data-parallel dimension only; use strategy='grpo_fsdp2' (lightning_grpo.strategies."
            "FSDP2Strategy) or ModelParallelStrategy(data_parallel_size=<world size>, tensor_parallel_size=1)"
        )
    dp_mesh = mesh["data_parallel"] if mesh.mesh_dim_names and "data_parallel" in mesh.mesh_dim_names else mesh
    settings = strategy if isinstance(strategy, FSDP2Strategy) else FSDP2Strategy()
    kwargs = dict(mp_policy=settings.mp_policy, offload_policy=settings.offload_policy())
    if not is_fsdp2(module.policy):
        if settings.activation_checkpointing:
            if not getattr(module.policy, "supports_gradient_checkpointing", False):
                raise ValueError(
                    f"activation_checkpointing=True but {type(module.policy).__name__} does not support "
                    "gradient checkpointing (transformers' supports_gradient_checkpointing)"
                )
            module.policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        shard_model(module.policy, dp_mesh, reshard_after_forward=settings.reshard_after_forward, **kwargs)
    ref = module.ref_model
    if ref is not None and not is_fsdp2(ref):
        shard_model(ref, dp_mesh, reshard_after_forward=True, root_reshard_after_forward=True, **kwargs)
    engine = module.rollout_engine
    if isinstance(engine, HFRolloutEngine):
        module.rollout_engine = GatheredGenerationEngine(engine, module.policy)


# --------------------------------------------------------------------------------------------------- rollouts
@contextlib.contextmanager
def gathered_parameters(model: nn.Module) -> Iterator[nn.Module]:
    """Hold the full (unsharded) parameters of a sharded ``model`` for the duration of the block.

    FSDP2: each ``fully_shard`` group of ``model`` is all-gathered once on entry (``FSDPModule.unshard``, in the
    ``MixedPrecisionPolicy``'s ``param_dtype``) and kept through every forward inside the block
    (``set_reshard_after_forward(False)``); on exit every group is resharded (``FSDPModule.reshard``, freeing the
    full parameters) and its ``reshard_after_forward`` restored. Inside, forwards run no collective, so ranks may
    run different numbers of forwards (different completion lengths).
    FSDP1: ``summon_full_params(writeback=False)`` (:func:`lightning_grpo.strategies.fsdp1.summoned_parameters`).
    Otherwise a no-op.

    A collective: every rank must enter the block. Memory: the full parameters of ``model`` on every rank while
    inside. Meant for no-grad use (generation, weight export).

    Yields:
        ``model``.
    """
    from torch.distributed.fsdp import FSDPModule

    from lightning_grpo.strategies.fsdp1 import is_fsdp1, summoned_parameters

    groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not groups:
        if is_fsdp1(model):
            with summoned_parameters(model):
                yield model
        else:
            yield model
        return
    for group in groups:
        group.set_reshard_after_forward(False, recurse=False)
    try:
        handles = [group.unshard(async_op=True) for group in groups]
        for handle in handles:
            if handle is not None:
                handle.wait()
        yield model
    finally:
        for group in groups:
            group.reshard()
            group.set_reshard_after_forward(bool(getattr(group, _RESHARD_ATTR, True)), recurse=False)


class GatheredGenerationEngine:
    """A rollout engine that runs another engine's ``generate`` inside :func:`gathered_parameters` of the
    sharded policy (FSDP2: one all-gather per group per rollout instead of one per generated token).

    Args:
        engine: the wrapped engine (:class:`~lightning_grpo.rollout.hf.HFRolloutEngine`, which generates with the
            unwrapped policy module itself, or an engine with its own weights such as vLLM's).
        model: the sharded policy.
        gather_for_sync: also run ``engine.sync_weights`` inside :func:`gathered_parameters` (FSDP1, whose
            parameters outside it are flat local shards; FSDP2 ``DTensor`` parameters gather themselves).

    Other attributes are those of ``engine``.
    """

    def __init__(self, engine: Any, model: nn.Module, gather_for_sync: bool = False) -> None:
        self.engine = engine
        self.model = model
        self.gather_for_sync = gather_for_sync

    def generate(self, prompt_ids: Sequence[Sequence[int]], num_generations: int, sampling: Any) -> Any:
        """``engine.generate`` with the policy's full parameters gathered once (a collective: every rank calls)."""
        from lightning_grpo.rollout.hf import HFRolloutEngine

        if not isinstance(self.engine, HFRolloutEngine):  # the engine holds its own full weights
            return self.engine.generate(prompt_ids, num_generations, sampling)
        with gathered_parameters(self.model):
            return self.engine.generate(prompt_ids, num_generations, sampling)

    def sync_weights(self, model: nn.Module) -> None:
        """``engine.sync_weights(model)`` (inside :func:`gathered_parameters` when ``gather_for_sync``)."""
        if not self.gather_for_sync:
            self.engine.sync_weights(model)
            return
        with gathered_parameters(model):
            self.engine.sync_weights(model)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["engine"], name)


# ------------------------------------------------------------------------------------------------- state dicts
def full_state_dict(model: nn.Module, rank0_only: bool = False) -> dict[str, Tensor]:
    """The full (unsharded) state dict of ``model``, with the module's own names, on CPU.

    For an FSDP2 model every ``DTensor`` is all-gathered, for an FSDP1 root its flat shards
    (``torch.distributed.checkpoint.state_dict.get_model_state_dict`` with ``full_state_dict=True``; wrapper name
    parts such as ``_fsdp_wrapped_module`` are dropped): a collective, every rank must call it. A plain model
    returns ``model.state_dict()`` (detached, on its device).

    Args:
        model: the model (FSDP2-sharded or not).
        rank0_only: FSDP only: gather onto rank 0 only (the other ranks get ``{}``), offloaded to CPU as each
            tensor arrives, so peak memory is one model on rank 0 and one parameter elsewhere.

    Returns:
        ``{name: tensor}``.
    """
    from lightning_grpo.strategies.fsdp1 import is_fsdp1

    if not is_fsdp2(model) and not is_fsdp1(model):
        return {k: v.detach() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    state = get_model_state_dict(model, options=options)
    if rank0_only:
        return state
    return {k: v.detach().cpu() for k, v in state.items()}


# ------------------------------------------------------------------------------------------------ grad norms
def _to_local_total(norm: Tensor) -> Tensor:
    full = getattr(norm, "full_tensor", None)
    return full() if callable(full) else norm


def grad_norm(parameters: Iterable[Tensor], norm_type: float = 2.0) -> Optional[Tensor]:
    """The ``norm_type``-norm of all gradients of ``parameters`` as one vector (0-dim float32 tensor), or None
    when none has a gradient.

    For FSDP2 ``DTensor`` gradients it is the norm of the *full* gradient: each rank takes the norm of its
    shard and the partial norms are all-reduced (a collective: every rank must call it), never gathering a
    gradient in full.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return None
    total = torch.nn.utils.get_total_norm(grads, norm_type=norm_type)
    return _to_local_total(total).float()


def clip_grad_norm_(parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0) -> Optional[Tensor]:
    """Scale the gradients of ``parameters`` in place so their total norm is at most ``max_norm``
    (``torch.nn.utils.clip_grad_norm_`` semantics: factor ``min(1, max_norm / (norm + 1e-6))``), with the total
    norm of the full gradient also for FSDP2 ``DTensor`` gradients (see :func:`grad_norm`).

    Returns:
        the total norm before clipping (0-dim float32 tensor), or None when no parameter has a gradient.

    Raises:
        ValueError: ``max_norm <= 0``.
    """
    if max_norm <= 0:
        raise ValueError(f"gradient_clip_val={max_norm} must be > 0 to clip by norm")
    parameters = [p for p in parameters if p.grad is not None]
    total = grad_norm(parameters, norm_type)
    if total is None:
        return None
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total
