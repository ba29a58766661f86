"""``MegatronStrategy``: GRPO on megatron-core with tensor (TP), pipeline (PP) and data (DP) parallelism, as a
Lightning strategy.

``L.Trainer(strategy=MegatronStrategy(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), devices=8)``
trains a :class:`lightning_grpo.GRPOModule` whose HF Llama/Qwen2 policy is converted into a megatron-core
``GPTModel``: its layers split evenly over the PP stages, each stage's layers split over TP ranks; the
``world_size / (TP x PP)`` model-parallel groups are data-parallel replicas. What it does:

- process groups: Lightning's DDP setup (NCCL on GPU, gloo on CPU), then
  ``parallel_state.initialize_model_parallel(TP, PP)`` (megatron-core's rank order tp-dp-pp: TP ranks are
  adjacent, then DP replicas, then stages). On CPU the :mod:`lightning_grpo.strategies.megatron.cpu_shims` are
  applied for the run. One more group per model-parallel group carries the rollouts (so a background rollout's
  broadcast, ``max_staleness > 0``, never interleaves with the training collectives).
- the strategy is the module's :class:`~lightning_grpo.strategies.base.ParallelBackend`: from
  ``GRPOModule.configure_model`` its :meth:`~MegatronStrategy.configure` turns the policy (and the reference policy
  when ``beta > 0``) into a :class:`~lightning_grpo.strategies.megatron.policy.MegatronPolicy` (this rank's stage and
  TP shard), whose vocab-parallel logprobs ``GRPOModule.completion_logprobs`` uses (old and reference logprobs go
  through a forward-only pipeline schedule). The rollout engine is wrapped
  (:class:`~lightning_grpo.strategies.megatron.rollout.TensorParallelRolloutEngine`): the first rank of each
  model-parallel group generates (HF ``generate`` on the HF copy, colocated vLLM, or the rollout servers, each fed
  the weights gathered one tensor at a time) and broadcasts the completions to its group.
- training: the backend runs whole optimizer steps (:attr:`runs_whole_step`): at each step's first micro-batch
  :meth:`train_step` feeds all of the step's micro-batches through megatron-core's schedule (1F1B with PP > 1,
  :mod:`lightning_grpo.strategies.megatron.pipeline`); the last stage computes the vocab-parallel logprobs and the
  GRPO loss of each micro-batch with the step-wide normalizer, so accumulation, the PP size and the process count do
  not change the gradient. Lightning still counts the micro-batches and steps the optimizer.
- data: each DP replica gets its own prompts (the ``DistributedSampler`` is keyed by DP rank; the TP and PP ranks
  of a replica see the same ones). ``reduce`` (hence ``GRPOModule``'s metric and loss-normalizer sums) runs over
  the DP group.
- gradients and optimizer: by default the module's own optimizer over this rank's shards; the gradients are
  averaged over the DP group after the step (one flat all-reduce) and the two copies of a tied embedding (first
  and last stage) summed; clipping by norm uses the norm of the full, unsharded gradient. With
  ``use_distributed_optimizer=True`` the policy is wrapped in megatron-core's ``DistributedDataParallel`` and the
  optimizer is megatron-core's ``DistributedOptimizer`` built from the module's (optimizer states sharded over the
  DP group; :mod:`lightning_grpo.strategies.megatron.optimizer`).
- checkpoints: the policy weights and the optimizer state are gathered into HF names (``policy.model.
  embed_tokens.weight``, ...; :mod:`lightning_grpo.strategies.megatron.checkpoint`), so a checkpoint does not depend
  on the TP, PP or DP sizes nor on the optimizer's sharding, and its ``state_dict`` loads into a plain
  ``GRPOModule``; on resume each rank takes its shard.
- end of fit: the trained weights are gathered into the HF copy (``on_train_end``), which
  ``MegatronPolicy.save_pretrained`` exports; :meth:`MegatronStrategy.restore` (from ``GRPOModule.teardown``)
  hands the HF models back. Teardown destroys megatron-core's model-parallel state and the process groups it
  created (the default group stays, as with ``DDPStrategy``).

Limits (raise or are documented, docs/megatron.md): the interleaved (virtual-pipeline) schedule and expert
parallelism are refused; the layers must split evenly over the stages; the gathered checkpoint and the HF
rollout copy hold a full model on every process (the optimizer state only on rank 0, on the CPU).
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

from lightning_grpo.algorithm import ObjectiveOutput
from lightning_grpo.config import GRPOConfig
from lightning_grpo.strategies.base import ClipFallback, GRPOModels, StepObjective, clips_by_norm
from lightning_grpo.strategies.megatron import checkpoint, convert, cpu_shims
from lightning_grpo.strategies.megatron.model import recompute_settings
from lightning_grpo.strategies.megatron.optimizer import (
    DistParamStates,
    DistributedOptimizerAdapter,
    build_distributed_optimizer,
    wrap_ddp,
)
from lightning_grpo.strategies.megatron.pipeline import detached, run_schedule
from lightning_grpo.strategies.megatron.policy import MegatronPolicy
from lightning_grpo.strategies.megatron.rollout import TensorParallelRolloutEngine
from lightning_grpo.training.collectives import Collectives
from lightning_grpo.training.experience import Experience
from lightning_grpo.training.logprobs import check_untruncated_scoring

if TYPE_CHECKING:
    import lightning as L

log = logging.getLogger(__name__)

_POLICY_PREFIX = "policy."

class MegatronStrategy(DDPStrategy):
    """Lightning strategy that trains ``GRPOModule.policy`` as a megatron-core model with tensor, pipeline and data
    parallelism (see the module docstring); also the module's
    :class:`~lightning_grpo.strategies.base.ParallelBackend`.

    Args:
        tensor_model_parallel_size: TP size; must divide the vocabulary, the key/value heads and the MLP size.
        pipeline_model_parallel_size: PP size; must divide the number of layers (1F1B schedule).
        virtual_pipeline_model_parallel_size: must be None (the interleaved schedule is not supported).
        expert_model_parallel_size: must be 1 (expert parallelism is not supported, docs/megatron.md).
        use_distributed_optimizer: megatron-core's distributed optimizer (optimizer states sharded over the DP
            group) built from the module's optimizer (torch AdamW or Adam with one param group).
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
        ValueError: a size below 1, ``virtual_pipeline_model_parallel_size`` or ``expert_model_parallel_size != 1``
            (at construction); a world size that TP x PP does not divide (at setup), or a policy that cannot be
            converted (at ``configure_model``).
    """

    def __init__(
        self,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        virtual_pipeline_model_parallel_size: Optional[int] = None,
        expert_model_parallel_size: int = 1,
        use_distributed_optimizer: bool = False,
        params_dtype: Optional[torch.dtype] = None,
        use_transformer_engine: bool = False,
        activation_checkpointing: Optional[bool] = None,
        seed: int = 1234,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = timedelta(minutes=30),
        **kwargs: Any,
    ) -> None:
        for name, value in (("tensor_model_parallel_size", tensor_model_parallel_size),
                            ("pipeline_model_parallel_size", pipeline_model_parallel_size)):
            if value < 1:
                raise ValueError(f"MegatronStrategy({name}={value}) must be >= 1")
        if virtual_pipeline_model_parallel_size is not None:
            raise ValueError(
                f"MegatronStrategy(virtual_pipeline_model_parallel_size={virtual_pipeline_model_parallel_size}): the "
                "interleaved pipeline schedule is not supported; leave it None (the 1F1B schedule)")
        if expert_model_parallel_size != 1:
            raise ValueError(
                f"MegatronStrategy(expert_model_parallel_size={expert_model_parallel_size}): expert parallelism "
                "(MoE models) is not supported; see docs/megatron.md 'Expert parallelism'")
        super().__init__(process_group_backend=process_group_backend, timeout=timeout, **kwargs)
        self.tensor_model_parallel_size = tensor_model_parallel_size
        self.pipeline_model_parallel_size = pipeline_model_parallel_size
        self.use_distributed_optimizer = use_distributed_optimizer
        self.params_dtype = params_dtype
        self.use_transformer_engine = use_transformer_engine
        self.activation_checkpointing = activation_checkpointing
        self.seed = seed
        self._shims_applied = False
        self._model_parallel_groups: list[Any] = []
        self._rollout_group: Any = None

    # ------------------------------------------------------------------ environment
    @property
    def model_parallel_size(self) -> int:
        """Processes that hold one copy of the model: TP x PP."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    @property
    def data_parallel_size(self) -> int:
        """Processes with different data: ``world_size / (TP x PP)``."""
        return self.world_size // self.model_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        """This process's data-parallel replica (its TP and PP ranks share it; megatron-core's order tp-dp-pp)."""
        return (self.global_rank // self.tensor_model_parallel_size) % self.data_parallel_size

    @property
    def tensor_model_parallel_rank(self) -> int:
        return self.global_rank % self.tensor_model_parallel_size

    @property
    def pipeline_model_parallel_rank(self) -> int:
        return self.global_rank // (self.tensor_model_parallel_size * self.data_parallel_size)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    def model_parallel_ranks(self, data_parallel_rank: int) -> list[int]:
        """The global ranks of replica ``data_parallel_rank``'s model-parallel group (TP x PP), sorted."""
        tp, dp = self.tensor_model_parallel_size, self.data_parallel_size
        return sorted(t + tp * (data_parallel_rank + dp * p) for p in range(self.pipeline_model_parallel_size)
                      for t in range(tp))

    def setup_environment(self) -> None:
        if self.world_size % self.model_parallel_size != 0:
            raise ValueError(
                f"MegatronStrategy(tensor_model_parallel_size={self.tensor_model_parallel_size}, "
                f"pipeline_model_parallel_size={self.pipeline_model_parallel_size}): TP x PP = "
                f"{self.model_parallel_size} must divide the number of processes (world size {self.world_size})"
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
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            create_gloo_process_groups=self.root_device.type == "cpu",
        )
        groups = [torch.distributed.new_group(self.model_parallel_ranks(d)) for d in range(self.data_parallel_size)]
        self._rollout_group = groups[self.data_parallel_rank]
        mine = torch.distributed.get_process_group_ranks(parallel_state.get_model_parallel_group())
        if sorted(mine) != self.model_parallel_ranks(self.data_parallel_rank):
            raise RuntimeError(f"megatron-core's model-parallel group {sorted(mine)} is not the expected "
                               f"{self.model_parallel_ranks(self.data_parallel_rank)} (rank order tp-dp-pp)")
        self._model_parallel_groups = [g for g in _process_groups() if g not in existing]
        if self.root_device.type == "cuda":
            tensor_parallel.model_parallel_cuda_manual_seed(self.seed)
        rank_zero_info(
            f"MegatronStrategy: {self.world_size} processes = TP {self.tensor_model_parallel_size} x "
            f"PP {self.pipeline_model_parallel_size} x DP {self.data_parallel_size} ({self.process_group_backend}"
            f"{', distributed optimizer' if self.use_distributed_optimizer else ''})"
        )

    # ------------------------------------------------------------------------ setup
    def configure_ddp(self) -> None:
        """No torch DistributedDataParallel: TP and PP ranks hold different shards. With the distributed optimizer
        the policy's ``GPTModel`` is wrapped in megatron-core's ``DistributedDataParallel`` here (after it was moved
        to its device, before the optimizers are made); else the gradients are averaged in
        :meth:`reduce_gradients`."""
        policy = self._megatron_policy()
        if self.use_distributed_optimizer and policy is not None and policy.ddp is None:
            policy.set_ddp(wrap_ddp(policy.model))

    def setup(self, trainer: "L.Trainer") -> None:
        if self._megatron_policy() is None:
            raise ValueError(
                f"MegatronStrategy trains a GRPOModule's `policy`, converted by MegatronStrategy.configure from the "
                f"module's configure_model; {type(self.lightning_module).__name__}.policy is not a MegatronPolicy"
            )
        super().setup(trainer)

    def setup_optimizers(self, trainer: "L.Trainer") -> None:
        """The module's optimizers; with the distributed optimizer, megatron-core's ``DistributedOptimizer`` built
        from the module's one (which keeps its hyper-parameters and LR scheduler,
        :class:`~lightning_grpo.strategies.megatron.optimizer.DistributedOptimizerAdapter`).

        Raises:
            ValueError: with the distributed optimizer, more than one optimizer or one megatron-core cannot build.
        """
        super().setup_optimizers(trainer)
        if not self.use_distributed_optimizer:
            return
        if len(self.optimizers) != 1:
            raise ValueError(f"MegatronStrategy(use_distributed_optimizer=True) takes one optimizer from "
                             f"configure_optimizers, got {len(self.optimizers)}")
        policy = self._megatron_policy()
        assert policy is not None and policy.ddp is not None
        hyper = self.optimizers[0]
        dtype = next(policy.model.parameters()).dtype
        self.optimizers = [DistributedOptimizerAdapter(hyper, build_distributed_optimizer(hyper, policy.ddp, dtype),
                                                       policy.ddp)]

    # --------------------------------------------------------- ParallelBackend
    def configure(self, models: GRPOModels) -> GRPOModels:
        """Convert the HF policy (and reference policy) into megatron-core ones, this rank's pipeline stage and TP
        shard; wrap the rollout engine (:class:`~lightning_grpo.strategies.megatron.rollout.
        TensorParallelRolloutEngine`). Idempotent. Runs in ``configure_model``, after the process groups exist and
        before a checkpoint is restored.

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
            teacher = (None if models.teacher is None  # the distillation teacher, converted as the reference
                       else MegatronPolicy.from_hf(models.teacher, *args).eval().requires_grad_(False))
        engine = models.engine
        if engine is not None and not isinstance(engine, TensorParallelRolloutEngine):
            engine = TensorParallelRolloutEngine(engine, policy, self._rollout_group)
        assert policy.hf_model is not None
        policy.hf_model.to(self.root_device)
        log.info("MegatronStrategy: converted the policy to megatron-core (TP=%d, PP=%d, stage %d)",
                 self.tensor_model_parallel_size, self.pipeline_model_parallel_size, policy.stage.pp_rank)
        return GRPOModels(policy, ref, engine, teacher)

    def restore(self, models: GRPOModels) -> GRPOModels:
        """The HF models back (each ``MegatronPolicy``'s ``hf_model``, the unwrapped engine) when the HF policy
        holds the trained weights (``on_train_end`` gathered them); else ``models`` unchanged."""
        policy = models.policy
        if not (isinstance(policy, MegatronPolicy) and policy.hf_model_is_current() and policy._hf_loaded):
            return models
        ref, engine, teacher = models.ref, models.engine, models.teacher
        return GRPOModels(policy.hf_model, ref.hf_model if isinstance(ref, MegatronPolicy) else ref,
                          engine.engine if isinstance(engine, TensorParallelRolloutEngine) else engine,
                          teacher.hf_model if isinstance(teacher, MegatronPolicy) else teacher)

    def is_sharded(self, model: nn.Module) -> bool:
        """False: a tensor-parallel forward gathers no parameters."""
        return False

    @property
    def runs_whole_step(self) -> bool:
        """True: every optimizer step goes through megatron-core's schedule (:meth:`train_step`)."""
        return True

    def train_step(self, policy: nn.Module, micro_batches: Sequence[Experience], objective: StepObjective,
                   config: GRPOConfig) -> list[ObjectiveOutput]:
        """Zero the gradients and run the step's micro-batches through megatron-core's forward-backward schedule
        (:func:`~lightning_grpo.strategies.megatron.pipeline.run_schedule`); each micro-batch's loss is
        ``objective(...).loss`` times the DP size (the DP gradient average then gives the sum over processes the
        step normalizer expects). Returns the detached objective outputs on every rank (broadcast from the last
        stage). A collective over every rank.

        Raises:
            ValueError: ``entropy_coef > 0`` or top-k / top-p / min-p (vocab-parallel logprobs score the untruncated
                distribution without an entropy gradient).
        """
        assert isinstance(policy, MegatronPolicy)
        check_untruncated_scoring(config, "MegatronStrategy's vocab-parallel logprobs", config.entropy_coef > 0)
        scale = float(self.data_parallel_size)

        def loss(batch: Experience, logprobs: Tensor, entropy: Optional[Tensor]) -> tuple[Tensor, ObjectiveOutput]:
            output = objective(batch, logprobs, entropy)
            return output.loss * scale, detached(output)

        self._zero_grad(policy)
        outputs = run_schedule(policy.schedule_model, micro_batches, config.temperature, loss, with_entropy=True)
        optimizer = self._distributed_optimizer()
        if optimizer is not None:
            optimizer.gradients_ready()
        return outputs

    def _zero_grad(self, policy: MegatronPolicy) -> None:
        optimizer = self._distributed_optimizer()
        if optimizer is not None:
            optimizer.zero_grad()
            return
        for param in policy.parameters():
            param.grad = None

    def _distributed_optimizer(self) -> Optional[DistributedOptimizerAdapter]:
        if not self.use_distributed_optimizer or not self.optimizers:
            return None
        optimizer = getattr(self.optimizers[0], "_optimizer", self.optimizers[0])
        return optimizer if isinstance(optimizer, DistributedOptimizerAdapter) else None

    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        """A no-op: :meth:`train_step` ran the step's backward passes in the schedule (the module's returned loss
        is detached)."""
        return closure_loss

    def grad_norm(self, policy: nn.Module) -> Optional[Tensor]:
        """The norm of the policy's full gradient (:meth:`full_grad_norm`; megatron-core's with the distributed
        optimizer), or None before any gradient. A collective."""
        optimizer = self._distributed_optimizer()
        if optimizer is not None:
            return optimizer.prepare()
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
        gradient (:meth:`full_grad_norm`, a model-parallel collective; the distributed optimizer's main gradients
        with megatron-core's norm) and return that norm; by value: Lightning's ``fallback``.

        Raises:
            ValueError: clipping by value with the distributed optimizer.
        """
        distributed = self._distributed_optimizer()
        if not clips_by_norm(gradient_clip_val, gradient_clip_algorithm):
            if distributed is not None and gradient_clip_val:
                raise ValueError(f"Trainer(gradient_clip_algorithm={gradient_clip_algorithm!r}) with "
                                 "MegatronStrategy(use_distributed_optimizer=True): only clipping by norm is supported")
            fallback(optimizer, gradient_clip_val, gradient_clip_algorithm)
            return None
        assert gradient_clip_val is not None
        if distributed is not None:
            return distributed.clip(float(gradient_clip_val))
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
    def reduce(
        self, tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Union[Any, str]] = "mean"
    ) -> Tensor:
        """Reduce over the data-parallel group by default (TP and PP ranks hold copies of the same values)."""
        if group is None and torch.distributed.is_initialized():
            from megatron.core import parallel_state

            if parallel_state.model_parallel_is_initialized():
                group = parallel_state.get_data_parallel_group()
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        flag = torch.tensor(int(decision), device=self.root_device)
        total = super().reduce(flag, reduce_op="sum")  # over every process
        return bool(total == self.world_size) if all else bool(total)

    # -------------------------------------------------------------------- gradients
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Any] = None,
        **kwargs: Any,
    ) -> Any:
        def closure_then_reduce() -> Any:
            result = closure()
            if self._distributed_optimizer() is None:  # else the schedule reduced them (megatron-core's DDP)
                self.reduce_gradients()
            return result

        result = super().optimizer_step(optimizer, closure_then_reduce, model, **kwargs)
        policy = self._megatron_policy()
        if policy is not None:
            policy.mark_updated()
        return result

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Average the gradients of all trainable parameters over the data-parallel group (one flat all-reduce),
        then sum the gradients of a tied embedding's two copies (first and last pipeline stage) over megatron-core's
        embedding group. Called after the step's backward passes, before clipping and ``on_before_optimizer_step``."""
        from megatron.core import parallel_state

        params = [p for p in self.lightning_module.parameters() if p.requires_grad]
        if self.data_parallel_size > 1:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            torch.distributed.all_reduce(flat, group=parallel_state.get_data_parallel_group())
            flat /= self.data_parallel_size
            offset = 0
            for p, g in zip(params, grads, strict=True):
                n = g.numel()
                p.grad = flat[offset : offset + n].view_as(g).clone()
                offset += n
        policy = self._megatron_policy()
        if policy is None or not (policy.arch.tie_word_embeddings and self.pipeline_model_parallel_size > 1):
            return
        if not parallel_state.is_rank_in_embedding_group():
            return
        shared = policy.model.shared_embedding_or_output_weight()
        if shared.grad is None:
            shared.grad = torch.zeros_like(shared)
        torch.distributed.all_reduce(shared.grad, group=parallel_state.get_embedding_group())

    @torch.no_grad()
    def full_grad_norm(self, params: Sequence[Tensor]) -> Tensor:
        """The 2-norm (0-dim float32) of the full, unsharded gradient of ``params``: squares of tensor-parallel
        shards (``param.tensor_model_parallel``) are summed over the TP group, replicated parameters (the norms)
        counted once, then everything summed over the PP group; the last stage's copy of a tied embedding
        (``param.shared``) is left out. A collective over the model-parallel group."""
        from megatron.core import parallel_state

        grads = [p for p in params if p.grad is not None and not getattr(p, "shared", False)]
        device = grads[0].grad.device if grads else self.root_device
        squares = torch.zeros(2, device=device)  # [sharded, replicated]
        for p in grads:
            squares[0 if getattr(p, "tensor_model_parallel", False) else 1] += p.grad.float().square().sum()
        sharded = squares[:1].clone()
        if self.tensor_model_parallel_size > 1:
            torch.distributed.all_reduce(sharded, group=parallel_state.get_tensor_model_parallel_group())
        total = sharded + squares[1:]
        if self.pipeline_model_parallel_size > 1:
            torch.distributed.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
        return total[0].sqrt()

    # ------------------------------------------------------------------ checkpoints
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

    def optimizer_state(self, optimizer: Optimizer, all_ranks: bool = False) -> dict[str, Any]:
        """The optimizer state with the policy's per-parameter tensors gathered into HF names, independent of the
        layout and of the optimizer's sharding (:func:`~lightning_grpo.strategies.megatron.checkpoint.
        optimizer_state_to_hf`). The tensors are kept on global rank 0, which writes the checkpoint (on every rank
        with ``all_ranks``); the others return an empty ``state``. A collective over every rank."""
        policy = self._require_policy()
        states, hyper = self._param_states(optimizer)
        groups = hyper.state_dict()["param_groups"]
        return checkpoint.optimizer_state_to_hf(states, convert._mcore_parameters(policy.model), policy.arch,
                                                _uses_te(policy), groups, keep=all_ranks or self.global_rank == 0)

    def load_optimizer_state_dict(self, checkpoint_: Mapping[str, Any]) -> None:
        """Load optimizer states saved by :meth:`optimizer_state` (at any layout), taking this rank's shards
        (:func:`~lightning_grpo.strategies.megatron.checkpoint.optimizer_state_from_hf`) and the hyper-parameters.

        Raises:
            ValueError: an optimizer state in another format (e.g. from a plain, non-Megatron run).
        """
        from megatron.core import parallel_state

        policy = self._require_policy()
        tp = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size())
        for optimizer, saved in zip(self.optimizers, checkpoint_["optimizer_states"], strict=False):
            states, hyper = self._param_states(optimizer)
            checkpoint.optimizer_state_from_hf(saved, states, convert._mcore_parameters(policy.model), policy.arch,
                                               _uses_te(policy), policy.stage, *tp)
            checkpoint.load_hyperparameters(hyper.param_groups, saved)

    def _param_states(self, optimizer: Optimizer) -> tuple[checkpoint.ParamStates, Optimizer]:
        """The per-parameter states of ``optimizer`` (Lightning's wrapper removed) and the optimizer holding the
        hyper-parameters (the module's)."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        if isinstance(optimizer, DistributedOptimizerAdapter):
            return DistParamStates(optimizer.megatron), optimizer.hyper
        return checkpoint.TorchParamStates(optimizer), optimizer

    def _require_policy(self) -> MegatronPolicy:
        policy = self._megatron_policy()
        if policy is None:
            raise RuntimeError("MegatronStrategy: the module's policy is not a MegatronPolicy (configure_model did "
                               "not convert it)")
        return policy

    # -------------------------------------------------------------------- lifecycle
    def on_train_end(self) -> None:
        """Gather the trained weights into the HF policy copy on every rank (a collective), for the export and
        for :meth:`teardown` to hand the module back with an HF policy."""
        policy = self._megatron_policy()
        if policy is not None and policy.hf_model is not None:
            policy.sync_hf_model(load=True)

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


def _uses_te(policy: MegatronPolicy) -> bool:
    return any(n.endswith("layer_norm_weight") for n, _ in policy.model.named_parameters())


def _process_groups() -> list[Any]:
    """Every process group torch knows in this process (the default one and all subgroups)."""
    if not torch.distributed.is_initialized():
        return []
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_map)
