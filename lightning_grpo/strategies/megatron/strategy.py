"""``MegatronStrategy``: GRPO on megatron-core with tensor (TP) and data (DP) parallelism, as a Lightning strategy.

``L.Trainer(strategy=MegatronStrategy(tensor_model_parallel_size=2), devices=4)`` trains a
:class:`lightning_grpo.GRPOModule` whose HF Llama/Qwen2 policy is converted into a megatron-core ``GPTModel``
split over TP ranks; the ``world_size / TP`` groups of TP ranks are data-parallel replicas. What it does:

- process groups: Lightning's DDP setup (NCCL on GPU, gloo on CPU), then
  ``parallel_state.initialize_model_parallel(TP, PP=1)`` (rank order tp-dp: ranks ``[k TP, (k+1) TP)`` form a
  TP group). On CPU the :mod:`lightning_grpo.strategies.megatron.cpu_shims` are applied for the run.
- the strategy is the module's :class:`~lightning_grpo.strategies.base.ParallelBackend`: from
  ``GRPOModule.configure_model`` its :meth:`~MegatronStrategy.configure` turns the policy (and the reference
  policy when ``beta > 0``) into a :class:`~lightning_grpo.strategies.megatron.policy.MegatronPolicy`, whose
  vocab-parallel
  logprobs ``GRPOModule.completion_logprobs`` uses. The HF model is kept as the rollout copy: before each
  rollout after a weight update, the shards are gathered into it in HF format (as a vLLM weight sync would),
  TP rank 0 of each DP group generates and broadcasts the completions to its TP group
  (:class:`~lightning_grpo.strategies.megatron.rollout.TensorParallelRolloutEngine`).
- data: each DP group gets its own prompts (the ``DistributedSampler`` is keyed by DP rank; TP ranks of a group
  see the same ones). ``reduce`` (hence ``GRPOModule``'s metric and loss-normalizer sums) runs over the DP group.
- gradients: after the last backward of an optimizer step they are averaged over the DP group (one flat
  all-reduce); gradient clipping by norm uses the norm of the full, unsharded gradient.
- checkpoints: the policy weights and the optimizer state are gathered into HF names (``policy.model.
  embed_tokens.weight``, ...), so a checkpoint does not depend on the TP size and its ``state_dict`` loads into a
  plain ``GRPOModule``; on resume each rank takes its shard.
- end of fit: the trained weights are gathered into the HF copy (``on_train_end``), which
  ``MegatronPolicy.save_pretrained`` exports; :meth:`MegatronStrategy.restore` (from ``GRPOModule.teardown``)
  hands the HF models back. Teardown destroys megatron-core's model-parallel state and the process groups it
  created (the default group stays, as with ``DDPStrategy``).

Limits (raise or are documented): pipeline parallelism (PP > 1) is rejected; the optimizer is the module's own
(torch AdamW) over this rank's shards, not megatron-core's distributed optimizer; the gathered checkpoint and
HF rollout copy hold a full model per process (fine for models that fit one device, which is the HF-rollout
regime); the vLLM engine is not set up per TP group yet.
"""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_grpo.strategies.base import ClipFallback, GRPOModels, clips_by_norm
from lightning_grpo.strategies.megatron import convert, cpu_shims
from lightning_grpo.strategies.megatron.model import recompute_settings
from lightning_grpo.strategies.megatron.policy import MegatronPolicy
from lightning_grpo.strategies.megatron.rollout import TensorParallelRolloutEngine
from lightning_grpo.training.collectives import Collectives

if TYPE_CHECKING:
    import lightning as L

log = logging.getLogger(__name__)

_POLICY_PREFIX = "policy."


class MegatronStrategy(DDPStrategy):
    """Lightning strategy that trains ``GRPOModule.policy`` as a megatron-core model with tensor and data
    parallelism (see the module docstring); also the module's
    :class:`~lightning_grpo.strategies.base.ParallelBackend`.

    Args:
        tensor_model_parallel_size: TP size; must divide the number of processes, the vocabulary, the key/value
            heads and the MLP size of the model.
        pipeline_model_parallel_size: must be 1 (pipeline parallelism is not supported yet).
        params_dtype: dtype of the megatron-core weights; default: the HF policy's dtype.
        use_transformer_engine: build the layers from Transformer Engine (CUDA and ``transformer_engine`` needed).
        activation_checkpointing: recompute each transformer layer's activations in backward (megatron-core's
            ``recompute_granularity="full"``, :func:`~lightning_grpo.strategies.megatron.model.recompute_settings`);
            None (default): as the HF policy, i.e. ``GRPOModule(gradient_checkpointing=True)`` turns it on.
        seed: seed of megatron-core's CUDA model-parallel RNG tracker (GPU only; no randomness is drawn with
            dropout 0).
        process_group_backend: "nccl" / "gloo"; default: nccl on GPU, gloo on CPU.
        timeout: process-group timeout.
        kwargs: other ``DDPStrategy`` arguments (``start_method``, ...).

    Raises:
        ValueError: ``pipeline_model_parallel_size != 1`` or ``tensor_model_parallel_size < 1`` (at construction);
            a world size that TP does not divide (at setup), or a policy that cannot be converted (at
            ``configure_model``).
    """

    def __init__(
        self,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        params_dtype: Optional[torch.dtype] = None,
        use_transformer_engine: bool = False,
        activation_checkpointing: Optional[bool] = None,
        seed: int = 1234,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = timedelta(minutes=30),
        **kwargs: Any,
    ) -> None:
        if pipeline_model_parallel_size != 1:
            raise ValueError(
                f"MegatronStrategy(pipeline_model_parallel_size={pipeline_model_parallel_size}): pipeline parallelism "
                "is not supported yet, use pipeline_model_parallel_size=1"
            )
        if tensor_model_parallel_size < 1:
            raise ValueError(f"MegatronStrategy(tensor_model_parallel_size={tensor_model_parallel_size}) must be >= 1")
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, **kwargs)
        self.tensor_model_parallel_size = tensor_model_parallel_size
        self.params_dtype = params_dtype
        self.use_transformer_engine = use_transformer_engine
        self.activation_checkpointing = activation_checkpointing
        self.seed = seed
        self._shims_applied = False
        self._model_parallel_groups: list[Any] = []

    # ------------------------------------------------------------------ environment
    @property
    def data_parallel_size(self) -> int:
        """Processes with different data: ``world_size / tensor_model_parallel_size``."""
        return self.world_size // self.tensor_model_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        """This process's data-parallel group index (TP ranks of one group share it)."""
        return self.global_rank // self.tensor_model_parallel_size

    @property
    def tensor_model_parallel_rank(self) -> int:
        return self.global_rank % self.tensor_model_parallel_size

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    @override
    def setup_environment(self) -> None:
        if self.world_size % self.tensor_model_parallel_size != 0:
            raise ValueError(
                f"MegatronStrategy(tensor_model_parallel_size={self.tensor_model_parallel_size}) must divide the "
                f"number of processes (world size {self.world_size})"
            )
        if self.root_device.type == "cpu" and not self._shims_applied:
            cpu_shims.apply()
            self._shims_applied = True
        super().setup_environment()  # accelerator device setup + process group (DDPStrategy.setup_distributed)
        from megatron.core import parallel_state, tensor_parallel

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        existing = set(_process_groups())
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=1,
            create_gloo_process_groups=self.root_device.type == "cpu",
        )
        self._model_parallel_groups = [g for g in _process_groups() if g not in existing]
        if self.root_device.type == "cuda":
            tensor_parallel.model_parallel_cuda_manual_seed(self.seed)
        rank_zero_info(
            f"MegatronStrategy: {self.world_size} processes = TP {self.tensor_model_parallel_size} x "
            f"DP {self.data_parallel_size} ({self.process_group_backend})"
        )

    # ------------------------------------------------------------------------ setup
    @override
    def configure_ddp(self) -> None:
        """No DistributedDataParallel wrapper: the data-parallel gradient average is done in
        :meth:`reduce_gradients` over the DP group only (TP ranks hold different shards)."""

    @override
    def setup(self, trainer: "L.Trainer") -> None:
        if self._megatron_policy() is None:
            raise ValueError(
                f"MegatronStrategy trains a GRPOModule's `policy`, converted by MegatronStrategy.configure from the "
                f"module's configure_model; {type(self.lightning_module).__name__}.policy is not a MegatronPolicy"
            )
        super().setup(trainer)

    # --------------------------------------------------------- ParallelBackend
    def configure(self, models: GRPOModels) -> GRPOModels:
        """Convert the HF policy (and reference policy) into megatron-core ones, this rank's TP shard; wrap the
        rollout engine (:class:`~lightning_grpo.strategies.megatron.rollout.TensorParallelRolloutEngine`). Idempotent.
        Runs in ``configure_model``, after the process groups exist and before a checkpoint is restored.

        Raises:
            ValueError: a policy that cannot be converted (see :meth:`MegatronPolicy.from_hf`).
        """
        if isinstance(models.policy, MegatronPolicy):
            return models
        args = (self.tensor_model_parallel_size, self.params_dtype, self.use_transformer_engine)
        recompute = self.activation_checkpointing
        if recompute is None:  # GRPOModule(gradient_checkpointing=True) enabled transformers' checkpointing
            recompute = bool(getattr(models.policy, "is_gradient_checkpointing", False))
        with _default_tensor_init():
            policy = MegatronPolicy.from_hf(models.policy, *args, **recompute_settings(recompute))
            policy.model.train(models.policy.training)
            ref = None if models.ref is None else MegatronPolicy.from_hf(models.ref, *args).eval().requires_grad_(False)
        engine = models.engine
        if engine is not None and not isinstance(engine, TensorParallelRolloutEngine):
            engine = TensorParallelRolloutEngine(engine, policy)
        assert policy.hf_model is not None
        policy.hf_model.to(self.root_device)
        log.info("MegatronStrategy: converted the policy to megatron-core (TP=%d)", self.tensor_model_parallel_size)
        return GRPOModels(policy, ref, engine)

    def restore(self, models: GRPOModels) -> GRPOModels:
        """The HF models back (each ``MegatronPolicy``'s ``hf_model``, the unwrapped engine) when the HF policy
        holds the trained weights (``on_train_end`` gathered them); else ``models`` unchanged."""
        policy = models.policy
        if not (isinstance(policy, MegatronPolicy) and policy.hf_model_is_current() and policy._hf_loaded):
            return models
        ref, engine = models.ref, models.engine
        return GRPOModels(policy.hf_model, ref.hf_model if isinstance(ref, MegatronPolicy) else ref,
                          engine.engine if isinstance(engine, TensorParallelRolloutEngine) else engine)

    def is_sharded(self, model: nn.Module) -> bool:
        """False: a tensor-parallel forward gathers no parameters."""
        return False

    def grad_norm(self, policy: nn.Module) -> Optional[Tensor]:
        """The norm of the policy's full gradient (:meth:`full_grad_norm`), or None before any gradient."""
        params = list(policy.parameters())
        if all(p.grad is None for p in params):
            return None
        return self.full_grad_norm(params)

    def clip_gradients(
        self,
        policy: nn.Module,
        optimizer: Optimizer,
        gradient_clip_val: Optional[Union[int, float]],
        gradient_clip_algorithm: Optional[str],
        fallback: ClipFallback,
    ) -> Optional[Tensor]:
        """By norm: scale the optimizer's gradients by ``min(1, clip / (norm + 1e-6))`` with the norm of the full
        gradient (:meth:`full_grad_norm`, a TP collective) and return that norm; by value: Lightning's
        ``fallback``."""
        if not clips_by_norm(gradient_clip_val, gradient_clip_algorithm):
            fallback(optimizer, gradient_clip_val, gradient_clip_algorithm)
            return None
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not params:
            return None
        with torch.no_grad():
            total_norm = self.full_grad_norm(params)
            coefficient = (float(gradient_clip_val) / (total_norm + 1e-6)).clamp(max=1.0)
            for p in params:
                p.grad.mul_(coefficient.to(p.grad.dtype))
        return total_norm

    def export_state_dict(self, policy: nn.Module) -> Optional[dict[str, Any]]:
        """None: ``MegatronPolicy.save_pretrained`` saves its HF copy (gathered in :meth:`on_train_end`)."""
        return None

    def reduce_sum(self, tensor: Tensor) -> Tensor:
        """Summed over the data-parallel group (:meth:`reduce`)."""
        return tensor if self.world_size <= 1 else self.reduce(tensor, reduce_op="sum")

    def reduce_max(self, tensor: Tensor) -> Tensor:
        """Maximum over the data-parallel group (:meth:`reduce`)."""
        return tensor if self.world_size <= 1 else self.reduce(tensor, reduce_op="max")

    def collectives(self, device: torch.device) -> Collectives:
        """:meth:`reduce_sum` and :meth:`reduce_max` over the data-parallel group, flags on ``device``."""
        return Collectives(self.reduce_sum, self.reduce_max, device)

    def _megatron_policy(self) -> Optional[MegatronPolicy]:
        policy = getattr(self.lightning_module, "policy", None)
        return policy if isinstance(policy, MegatronPolicy) else None

    # --------------------------------------------------------------- communication
    @override
    def reduce(
        self, tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Union[Any, str]] = "mean"
    ) -> Tensor:
        """Reduce over the data-parallel group by default (TP ranks hold copies of the same values)."""
        if group is None and torch.distributed.is_initialized():
            from megatron.core import parallel_state

            if parallel_state.model_parallel_is_initialized():
                group = parallel_state.get_data_parallel_group()
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        flag = torch.tensor(int(decision), device=self.root_device)
        total = super().reduce(flag, reduce_op="sum")  # over every process
        return bool(total == self.world_size) if all else bool(total)

    # -------------------------------------------------------------------- gradients
    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Any] = None,
        **kwargs: Any,
    ) -> Any:
        def closure_then_reduce() -> Any:
            result = closure()
            self.reduce_gradients()
            return result

        return super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Average the gradients of all trainable parameters over the data-parallel group (one flat all-reduce).
        Called after the last backward of each optimizer step, before clipping and ``on_before_optimizer_step``."""
        from megatron.core import parallel_state

        if self.data_parallel_size == 1:
            return
        params = [p for p in self.lightning_module.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat, group=parallel_state.get_data_parallel_group())
        flat /= self.data_parallel_size
        offset = 0
        for p, g in zip(params, grads, strict=True):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(g).clone()
            offset += n

    @torch.no_grad()
    def full_grad_norm(self, params: Sequence[Tensor]) -> Tensor:
        """The 2-norm (0-dim float32) of the full, unsharded gradient of ``params``: squares of tensor-parallel
        shards (``param.tensor_model_parallel``) are summed over the TP group, replicated parameters (the norms)
        counted once. A collective over the TP group."""
        from megatron.core import parallel_state

        grads = [p for p in params if p.grad is not None]
        device = grads[0].grad.device if grads else self.root_device
        squares = torch.zeros(2, device=device)  # [sharded, replicated]
        for p in grads:
            squares[0 if getattr(p, "tensor_model_parallel", False) else 1] += p.grad.float().square().sum()
        sharded = squares[:1].clone()
        if self.tensor_model_parallel_size > 1:
            torch.distributed.all_reduce(sharded, group=parallel_state.get_tensor_model_parallel_group())
        return (sharded[0] + squares[1]).sqrt()

    # ------------------------------------------------------------------ checkpoints
    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state with the policy gathered into HF names (``policy.<hf name>``). A collective: every
        rank calls it (Lightning does, in ``dump_checkpoint``)."""
        module = self.lightning_module
        assert module is not None
        policy = self._megatron_policy()
        if policy is None:
            return module.state_dict()
        state = {k: v for k, v in module.state_dict().items() if not k.startswith(_POLICY_PREFIX)}
        for name, tensor in policy.iter_hf_weights():
            state[_POLICY_PREFIX + name] = tensor.cpu().clone()
        return state

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load a state dict with the policy in HF names (a Megatron or a plain GRPOModule checkpoint)."""
        module = self.lightning_module
        assert module is not None
        policy = self._megatron_policy()
        if policy is None:  # not converted (a module without configure_model): the policy is the HF model
            module.load_state_dict(checkpoint["state_dict"], strict=strict)
            return
        prefix = len(_POLICY_PREFIX)
        hf_state = {k[prefix:]: v for k, v in checkpoint["state_dict"].items() if k.startswith(_POLICY_PREFIX)}
        convert.load_hf_state_dict(policy.model, hf_state, policy.arch)
        rest = {k: v for k, v in checkpoint["state_dict"].items() if not k.startswith(_POLICY_PREFIX)}
        own = {k: v for k, v in module.state_dict().items() if k.startswith(_POLICY_PREFIX)}
        module.load_state_dict({**own, **rest}, strict=strict)

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer state with the policy's per-parameter tensors gathered into HF names
        (:func:`~lightning_grpo.strategies.megatron.convert.optimizer_state_to_hf`). A collective over the TP group."""
        from megatron.core import parallel_state

        optimizer = getattr(optimizer, "_optimizer", optimizer)
        return convert.optimizer_state_to_hf(optimizer.state_dict(), *self._optimizer_params(optimizer),
                                     parallel_state.get_tensor_model_parallel_group())

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load optimizer states saved by :meth:`optimizer_state`, taking this rank's shards
        (:func:`~lightning_grpo.strategies.megatron.convert.optimizer_state_from_hf`).

        Raises:
            ValueError: an optimizer state in another format (e.g. from a plain, non-Megatron run).
        """
        from megatron.core import parallel_state

        tp = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size())
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"], strict=False):
            optimizer = getattr(optimizer, "_optimizer", optimizer)
            current = optimizer.state_dict()
            own = self._optimizer_params(optimizer)
            optimizer.load_state_dict(convert.optimizer_state_from_hf(saved, current, *own, *tp))

    def _optimizer_params(self, optimizer: Optimizer) -> tuple[list[Tensor], list[str], dict[str, Any], Any]:
        """The optimizer's parameters (torch numbers them across param groups), their module names, the
        ParamMaps by module name (``policy.model.<mcore name>``) and the architecture (None without a
        ``MegatronPolicy``)."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        by_id = {id(p): n for n, p in self.lightning_module.named_parameters()}
        names = [by_id.get(id(p), f"<unnamed {i}>") for i, p in enumerate(params)]
        policy = self._megatron_policy()
        if policy is None:
            return params, names, {}, None
        te = any(n.endswith("layer_norm_weight") for n, _ in policy.model.named_parameters())
        maps = {_POLICY_PREFIX + "model." + pm.mcore: pm for pm in convert.param_maps(policy.arch, te)}
        return params, names, maps, policy.arch

    # -------------------------------------------------------------------- lifecycle
    @override
    def on_train_end(self) -> None:
        """Gather the trained weights into the HF policy copy on every rank (a collective), for the export and
        for :meth:`teardown` to hand the module back with an HF policy."""
        policy = self._megatron_policy()
        if policy is not None and policy.hf_model is not None:
            policy.sync_hf_model(load=True)

    @override
    def teardown(self) -> None:
        """Move the HF copy to CPU with the module (when it holds the trained weights: ``GRPOModule.teardown``
        then takes it back through :meth:`restore`), destroy megatron-core's model-parallel state and the process
        groups it created, remove the CPU shims. The default process group is Lightning's and lives as long as the
        process (as with ``DDPStrategy``), so a later ``fit`` can reuse it."""
        policy = self._megatron_policy()
        if policy is not None and policy.hf_model is not None:
            if policy.hf_model_is_current() and policy._hf_loaded:
                policy.hf_model.cpu()
                self.optimizers = []  # they hold the megatron-core parameters
            else:
                log.warning("MegatronStrategy.teardown: the run did not finish; module.policy stays a MegatronPolicy")
        super().teardown()
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if torch.distributed.is_initialized():
            for group in self._model_parallel_groups:
                if group in _process_groups():  # some are aliases of one another
                    torch.distributed.destroy_process_group(group)
        self._model_parallel_groups = []
        if self._shims_applied:
            cpu_shims.remove()
            self._shims_applied = False


@contextlib.contextmanager
def _default_tensor_init() -> Iterator[None]:
    """CPU and float32 as the default device and dtype of new tensors: Lightning runs ``configure_model`` under the
    root device and the precision plugin's dtype, and the conversion builds on CPU, as it did in ``setup``."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device("cpu"):
            yield
    finally:
        torch.set_default_dtype(dtype)


def _process_groups() -> list[Any]:
    """Every process group torch knows in this process (the default one and all subgroups)."""
    if not torch.distributed.is_initialized():
        return []
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_map)
