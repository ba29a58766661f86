"""``MegatronStrategy``: GRPO on megatron-core with tensor (TP), pipeline (PP), data (DP) and, for a mixture of
experts, expert (EP, ETP) parallelism, as a Lightning strategy.

``L.Trainer(strategy=MegatronStrategy(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), devices=8)``
trains a :class:`lightning_grpo.GRPOModule` whose HF Llama/Qwen2 policy is converted into a megatron-core
``GPTModel``: its layers split evenly over the PP stages, each stage's layers split over TP ranks; the
``world_size / (TP x PP)`` model-parallel groups are data-parallel replicas. What it does:

- process groups and data: megatron-core's TP, PP and DP groups, the rollouts' own group, each DP replica its own
  prompts, ``reduce`` over the DP group (its base, :class:`~lightning_grpo.strategies.megatron.layout.MegatronLayout`).
- the strategy is the module's :class:`~lightning_grpo.strategies.backend.ParallelBackend`: from
  ``GRPOModule.configure_model`` its :meth:`~MegatronStrategy.configure` turns the policy (and the reference policy
  when ``beta > 0``) into a :class:`~lightning_grpo.strategies.megatron.policy.MegatronPolicy` (this rank's stage and
  TP shard), whose vocab-parallel logprobs ``GRPOModule.completion_logprobs`` uses (old and reference logprobs go
  through a forward-only pipeline schedule). The rollout engine is wrapped
  (:class:`~lightning_grpo.strategies.megatron.rollout_engine.TensorParallelRolloutEngine`): the first rank of each
  model-parallel group generates (HF ``generate`` on the HF copy, colocated vLLM, or the rollout servers, each fed
  the weights gathered one tensor at a time) and broadcasts the completions to its group.
- training: the backend runs whole optimizer steps (:attr:`runs_whole_step`): at each step's first micro-batch
  :meth:`train_step` feeds all of the step's micro-batches through megatron-core's schedule (1F1B with PP > 1,
  :mod:`lightning_grpo.strategies.megatron.pipeline`); the last stage computes the vocab-parallel logprobs and the
  GRPO loss of each micro-batch with the step-wide normalizer, so accumulation, the PP size and the process count do
  not change the gradient. Lightning still counts the micro-batches and steps the optimizer.
- gradients and optimizer: by default the module's own optimizer over this rank's shards, the gradients averaged
  over the DP group after the step and clipped by the full gradient's norm (:mod:`~lightning_grpo.strategies.
  megatron.gradients`); with ``use_distributed_optimizer=True`` megatron-core's ``DistributedDataParallel`` and
  ``DistributedOptimizer``, built from the module's (:mod:`lightning_grpo.strategies.megatron.optimizer`).
- checkpoints: the policy weights and the optimizer state in HF names (:mod:`~lightning_grpo.strategies.megatron.
  checkpoint`): independent of the TP, PP and DP sizes and of the optimizer's sharding; on resume each rank takes its
  shard.
- end of fit: the trained weights are gathered into the HF copy (``on_train_end``), which ``MegatronPolicy.
  save_pretrained`` exports and :meth:`MegatronStrategy.restore` (from ``GRPOModule.teardown``) hands back.

- mixtures of experts (Qwen3-MoE, Mixtral: :mod:`~lightning_grpo.strategies.megatron.experts`): the experts split
  over the expert-parallel ranks (and each expert over the expert-TP ranks), carved out of the DP replicas; the
  policy's routers replay the routing the rollout recorded, if any (:mod:`~lightning_grpo.strategies.megatron.replay`).

Limits (raise or are documented, docs/megatron.md): the interleaved (virtual-pipeline) schedule is refused, and TP > 1
for a mixture of experts (megatron-core's MoE layer needs sequence parallelism then); the layers must split evenly
over the stages; the gathered checkpoint and the HF rollout copy hold a full model on every process (the optimizer
state only on rank 0, on the CPU).
"""

from __future__ import annotations

import contextlib
import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, Union

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_grpo.algorithm import ObjectiveOutput
from lightning_grpo.config import GRPOConfig
from lightning_grpo.models.moe import ReplayStats
from lightning_grpo.strategies.backend import ClipFallback, GRPOModels, ParallelBackend, StepObjective, clips_by_norm
from lightning_grpo.strategies.backend_registry import backend_for, compute_dtype, precision_dtype
from lightning_grpo.strategies.megatron import checkpoint, convert, gradients
from lightning_grpo.strategies.megatron.experts import check_dense_layout, moe_from_hf_config
from lightning_grpo.strategies.megatron.layout import MegatronLayout
from lightning_grpo.strategies.megatron.model import recompute_settings
from lightning_grpo.strategies.megatron.optimizer import (
    DistParamStates,
    DistributedOptimizerAdapter,
    build_distributed_optimizer,
    wrap_ddp,
)
from lightning_grpo.strategies.megatron.pipeline import detached, run_schedule
from lightning_grpo.strategies.megatron.policy import MegatronPolicy, MegatronWeights, score_completions
from lightning_grpo.strategies.megatron.replay import pipeline_sum
from lightning_grpo.strategies.megatron.rollout_engine import TensorParallelRolloutEngine
from lightning_grpo.training.experience import Experience
from lightning_grpo.training.logprobs import check_untruncated_scoring

if TYPE_CHECKING:
    import lightning as L

log = logging.getLogger(__name__)


class MegatronStrategy(MegatronLayout):
    """Lightning strategy that trains ``GRPOModule.policy`` as a megatron-core model with tensor, pipeline and data
    parallelism (see the module docstring); also the module's
    :class:`~lightning_grpo.strategies.backend.ParallelBackend`.

    Args:
        tensor_model_parallel_size: TP size; must divide the vocabulary, the key/value heads and the MLP size.
        pipeline_model_parallel_size: PP size; must divide the number of layers (1F1B schedule).
        virtual_pipeline_model_parallel_size: must be None (the interleaved schedule is not supported).
        expert_model_parallel_size: EP, a mixture of experts only: each MoE layer's experts split over EP ranks of
            different data-parallel replicas (must divide the number of experts; EP x ETP must divide TP x DP).
        use_distributed_optimizer: megatron-core's distributed optimizer (optimizer states sharded over the DP
            group) built from the module's optimizer (torch AdamW or Adam with one param group).
        params_dtype: dtype of the megatron-core weights; default: bfloat16 under ``Trainer(precision="bf16-true")``,
            else the HF policy's dtype. With bfloat16 weights, ``use_distributed_optimizer=True`` keeps float32 main
            weights and AdamW state (megatron-core's mixed precision); without it Lightning's AdamW steps the
            bfloat16 weights themselves. ``Trainer(precision="bf16-mixed")`` instead autocasts float32 weights
            (docs/megatron.md, "bf16").
        use_transformer_engine: build the layers from Transformer Engine (CUDA and ``transformer_engine`` needed).
        activation_checkpointing: recompute each transformer layer's activations in backward (megatron-core's
            ``recompute_granularity="full"``, :func:`~lightning_grpo.strategies.megatron.model.recompute_settings`);
            None (default): as the HF policy, i.e. ``GRPOModule(gradient_checkpointing=True)`` turns it on.
        expert_tensor_parallel_size: ETP, a mixture of experts only: each expert's matrices split over ETP ranks of
            different data-parallel replicas (must divide the experts' inner size).
        seed: seed of megatron-core's CUDA model-parallel RNG tracker (GPU only; no randomness is drawn with
            dropout 0).
        process_group_backend: "nccl" / "gloo"; default: nccl on GPU, gloo on CPU.
        timeout: process-group timeout.
        kwargs: other ``DDPStrategy`` arguments (``start_method``, ...).

    Raises:
        ValueError: a size below 1 or ``virtual_pipeline_model_parallel_size`` (at construction); a world size that
            TP x PP does not divide, a TP x DP that EP x ETP does not divide (at setup), a policy that cannot be
            converted (at ``configure_model``: also EP or ETP > 1 for a dense model, TP > 1 for a mixture of
            experts), or a token budget (``GRPOConfig.max_tokens_per_microbatch``) with the experts split over ranks.
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
        expert_tensor_parallel_size: int = 1,
        seed: int = 1234,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = timedelta(minutes=30),
        **kwargs: Any,
    ) -> None:
        super().__init__(tensor_model_parallel_size, pipeline_model_parallel_size, virtual_pipeline_model_parallel_size,
                         expert_model_parallel_size, expert_tensor_parallel_size, seed,
                         process_group_backend=process_group_backend, timeout=timeout, **kwargs)
        self.use_distributed_optimizer = use_distributed_optimizer
        self.params_dtype = params_dtype
        self.use_transformer_engine = use_transformer_engine
        self.activation_checkpointing = activation_checkpointing
        self._policy: Optional[MegatronPolicy] = None  # what configure converted the module's policy into
        self._ref: Optional[MegatronPolicy] = None  # ... and its reference policy
        self._teacher: Optional[MegatronPolicy] = None  # ... and on-policy distillation's teacher
        self._dist_optimizer: Optional[DistributedOptimizerAdapter] = None  # what setup_optimizers built
        self._routing_counts: Optional[Callable[[Tensor, Tensor], None]] = None  # GRPOModels.routing_counts

    # ------------------------------------------------------------------------ setup
    def setup_environment(self) -> None:
        super().setup_environment()
        experts = (f", experts: EP {self.expert_model_parallel_size} x ETP {self.expert_tensor_parallel_size}"
                   if self.expert_model_parallel_size * self.expert_tensor_parallel_size > 1 else "")
        rank_zero_info(
            f"MegatronStrategy: {self.world_size} processes = TP {self.tensor_model_parallel_size} x "
            f"PP {self.pipeline_model_parallel_size} x DP {self.data_parallel_size}{experts} "
            f"({self.process_group_backend}{', distributed optimizer' if self.use_distributed_optimizer else ''})"
        )

    def configure_ddp(self) -> None:
        """No torch DistributedDataParallel: TP and PP ranks hold different shards. With the distributed optimizer
        the policy's ``GPTModel`` is wrapped in megatron-core's ``DistributedDataParallel`` here (after it was moved
        to its device, before the optimizers are made); else the gradients are averaged in
        :meth:`reduce_gradients`."""
        policy = self._policy
        if self.use_distributed_optimizer and policy is not None and policy.ddp is None:
            policy.set_ddp(wrap_ddp(policy.model))

    def setup(self, trainer: "L.Trainer") -> None:
        """Lightning's setup, after checking that ``configure_model`` converted the policy and that no token budget
        is set with the experts split over ranks.

        Raises:
            ValueError: the module's policy is not a ``MegatronPolicy``; ``GRPOConfig.max_tokens_per_microbatch``
                with EP x ETP > 1 (each rank's token budget makes its own number of micro-batches, and every forward
                of a mixture split over ranks is a collective of its expert groups); a routing option the Megatron
                policy does not offer (:func:`check_routing_options`).
        """
        if self._policy is None:
            raise ValueError(
                f"MegatronStrategy trains a GRPOModule's `policy`, converted by MegatronStrategy.configure from the "
                f"module's configure_model; {type(self.lightning_module).__name__}.policy is not a MegatronPolicy"
            )
        assert self.lightning_module is not None
        config = self.lightning_module.hparams.get("config", {})
        check_no_token_budget(config.get("max_tokens_per_microbatch"), self.expert_model_parallel_size,
                              self.expert_tensor_parallel_size)
        check_routing_options(config)
        if self._policy.replay is not None:  # "R3": every scored experience carries the sampler's routing
            self._policy.replay.required = config.get("routing_replay") == "R3"
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
        policy = self._policy
        assert policy is not None and policy.ddp is not None
        hyper = self.optimizers[0]
        dtype = next(policy.model.parameters()).dtype
        self._dist_optimizer = DistributedOptimizerAdapter(hyper, build_distributed_optimizer(hyper, policy.ddp, dtype),
                                                           policy.ddp)
        self.optimizers = [self._dist_optimizer]

    # --------------------------------------------------------- ParallelBackend
    def configure(self, models: GRPOModels) -> GRPOModels:
        """Convert the HF policy (and the reference policy and distillation teacher) into megatron-core ones, this
        rank's pipeline stage and TP shard, kept in this strategy's fields; wrap the rollout engine
        (:class:`~lightning_grpo.strategies.megatron.rollout_engine.TensorParallelRolloutEngine`); the engines read the
        weights gathered from the shards (:class:`~lightning_grpo.strategies.megatron.policy.MegatronWeights`) and
        the models score their completions themselves (vocab-parallel). Idempotent. Runs in ``configure_model``,
        after the process groups exist and before a checkpoint is restored.

        Raises:
            ValueError: a policy that cannot be converted (see :meth:`MegatronPolicy.from_hf`), a LoRA policy,
                expert parallelism for a dense policy.
        """
        if models.lora:
            raise ValueError("GRPOModule(lora=...) is not supported with MegatronStrategy: the policy is converted to "
                             "megatron-core layers, which carry no PEFT adapters; use strategy='grpo_fsdp2', 'ddp' "
                             "or a single device")
        self._routing_counts = models.routing_counts  # the module's sampling/router_disagreement, if replayed
        if self._policy is None or models.policy is not self._policy:
            check_dense_layout(moe_from_hf_config(models.policy.config), self.expert_model_parallel_size,
                               self.expert_tensor_parallel_size)
            self._policy, self._ref, self._teacher = self._convert(models)
        policy = self._policy
        engine = None if models.engine is None else TensorParallelRolloutEngine(models.engine, policy,
                                                                                  self._rollout_group)
        return GRPOModels(policy, self._ref, engine, weights=MegatronWeights(policy), scorer=score_completions,
                          teacher=self._teacher, scorer_replays_routing=policy.replay is not None)

    def _convert(self, models: GRPOModels) -> tuple[MegatronPolicy, Optional[MegatronPolicy],
                                                    Optional[MegatronPolicy]]:
        """The policy (whose routers replay a rollout's recorded routing, for a mixture of experts), the reference
        policy and the teacher (routed live: the sampler recorded the policy's routing) as ``MegatronPolicy`` s."""
        args = (self.tensor_model_parallel_size, self.policy_params_dtype, self.use_transformer_engine)
        recompute = self.activation_checkpointing
        if recompute is None:  # GRPOModule(gradient_checkpointing=True) enabled transformers' checkpointing
            recompute = bool(getattr(models.policy, "is_gradient_checkpointing", False))
        with convert.default_tensor_init():
            policy = MegatronPolicy.from_hf(models.policy, *args, replay_routing=True, **recompute_settings(recompute))
            policy.model.train(models.policy.training)
            ref = None if models.ref is None else MegatronPolicy.from_hf(models.ref, *args).eval().requires_grad_(False)
            teacher = (None if models.teacher is None  # the distillation teacher, converted as the reference
                       else MegatronPolicy.from_hf(models.teacher, *args).eval().requires_grad_(False))
        assert policy.hf_model is not None
        policy.hf_model.to(self.root_device)
        log.info("MegatronStrategy: converted the policy to megatron-core (TP=%d, PP=%d, stage %d)",
                 self.tensor_model_parallel_size, self.pipeline_model_parallel_size, policy.stage.pp_rank)
        return policy, ref, teacher

    @property
    def policy_params_dtype(self) -> Optional[torch.dtype]:
        """The megatron-core weights' dtype: ``params_dtype``, else bfloat16 (float16) under ``Trainer(precision=
        "bf16-true")`` (``"16-true"``: megatron-core is built in it rather than cast behind its back by Lightning),
        else None (the HF policy's)."""
        precision = str(self.precision_plugin.precision)
        if self.params_dtype is not None or not precision.endswith("-true") or precision.startswith(("32", "64")):
            return self.params_dtype
        return precision_dtype(precision, torch.float32)

    def restore(self, models: GRPOModels) -> GRPOModels:
        """The HF models back (the ``hf_model`` of the policy, reference policy and teacher this strategy converted)
        when the HF policy holds the trained weights (``on_train_end`` gathered them); else ``models`` unchanged."""
        policy, ref, teacher = self._policy, self._ref, self._teacher
        if policy is None or models.policy is not policy or not policy.hf_model_holds_weights():
            return models
        self._policy = self._ref = self._teacher = None
        return GRPOModels(policy.hf_model, models.ref if ref is None else ref.hf_model,
                          teacher=models.teacher if teacher is None else teacher.hf_model)

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
        policy = self._require_policy()
        check_untruncated_scoring(config, "MegatronStrategy's vocab-parallel logprobs", config.entropy_coef > 0)
        scale = float(self.data_parallel_size)

        def loss(batch: Experience, logprobs: Tensor, entropy: Optional[Tensor]) -> tuple[Tensor, ObjectiveOutput]:
            output = objective(batch, logprobs, entropy)
            return output.loss * scale, detached(output)

        check_no_token_budget(config.max_tokens_per_microbatch, self.expert_model_parallel_size,
                               self.expert_tensor_parallel_size)
        self._zero_grad(policy)
        counts = ReplayStats()
        counting = (policy.replay.counting(counts) if policy.replay is not None and self._routing_counts is not None
                    else contextlib.nullcontext())
        with counting:
            outputs = run_schedule(policy.schedule_model, micro_batches, config.temperature, loss, with_entropy=True,
                                   replay=policy.replay)
        if policy.replay is not None and self._routing_counts is not None:
            self._routing_counts(*self._stage_sum(counts))
        optimizer = self._distributed_optimizer()
        if optimizer is not None:
            optimizer.gradients_ready()
        return outputs

    def _stage_sum(self, counts: ReplayStats) -> tuple[Tensor, Tensor]:
        """The routers' ``(differing, counted)`` of this step over every MoE layer: summed over the pipeline stages
        (a collective of the pipeline group when PP > 1; the TP ranks of a stage count the same tokens, and TP is 1
        for a mixture of experts)."""
        from megatron.core import parallel_state

        group = parallel_state.get_pipeline_model_parallel_group() if self.pipeline_model_parallel_size > 1 else None
        return pipeline_sum(counts, group, self.root_device)

    def _zero_grad(self, policy: MegatronPolicy) -> None:
        optimizer = self._distributed_optimizer()
        if optimizer is not None:
            optimizer.zero_grad()
            return
        for param in policy.parameters():
            param.grad = None

    def _distributed_optimizer(self) -> Optional[DistributedOptimizerAdapter]:
        """The distributed optimizer :meth:`setup_optimizers` built, while it is the strategy's optimizer."""
        optimizer = self._dist_optimizer
        return optimizer if optimizer is not None and self.optimizers and self.optimizers[0] is optimizer else None

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
        return gradients.clip_by_norm(params, float(gradient_clip_val), self.full_grad_norm) if params else None

    def export_state_dict(self, policy: nn.Module) -> Optional[dict[str, Any]]:
        """None: ``MegatronPolicy.save_pretrained`` saves its HF copy (gathered in :meth:`on_train_end`)."""
        return None

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
        policy = self._policy
        if policy is not None:
            policy.mark_updated()
        return result

    def reduce_gradients(self) -> None:
        """Average the gradients of all trainable parameters over the data-parallel group, then sum the two copies of
        a tied embedding's (:func:`~lightning_grpo.strategies.megatron.gradients.reduce_gradients`). Called after the
        step's backward passes, before clipping and ``on_before_optimizer_step``."""
        assert self.lightning_module is not None
        params = [p for p in self.lightning_module.parameters() if p.requires_grad]
        gradients.reduce_gradients(params, self._policy, self.data_parallel_size, self.pipeline_model_parallel_size)

    def full_grad_norm(self, params: Sequence[Tensor]) -> Tensor:
        """The 2-norm of the full, unsharded gradient of ``params`` (:func:`~lightning_grpo.strategies.megatron.
        gradients.full_grad_norm`; a collective over the model-parallel group)."""
        return gradients.full_grad_norm(params, self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                                        self.root_device)

    # ------------------------------------------------------------------ checkpoints
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The module's state with the policy gathered into HF names (``policy.<hf name>``,
        :func:`~lightning_grpo.strategies.megatron.checkpoint.module_state_dict`). A collective: every rank calls it
        (Lightning does, in ``dump_checkpoint``)."""
        assert self.lightning_module is not None
        return checkpoint.module_state_dict(self.lightning_module, self._policy)

    def load_model_state_dict(self, checkpoint_: Mapping[str, Any], strict: bool = True) -> None:
        """Load a state dict with the policy in HF names (a Megatron or a plain GRPOModule checkpoint)."""
        assert self.lightning_module is not None
        checkpoint.load_module_state_dict(self.lightning_module, self._policy, checkpoint_["state_dict"], strict)

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
                                               _uses_te(policy), policy.stage, *tp, policy.experts)
            checkpoint.load_hyperparameters(hyper.param_groups, saved)

    def _param_states(self, optimizer: Optimizer) -> tuple[checkpoint.ParamStates, Optimizer]:
        """The per-parameter states of ``optimizer`` (one of :attr:`optimizers`) and the optimizer holding the
        hyper-parameters (the module's)."""
        distributed = self._distributed_optimizer()
        if distributed is not None and optimizer is distributed:
            return DistParamStates(distributed.megatron), distributed.hyper
        return checkpoint.TorchParamStates(optimizer), optimizer

    def _require_policy(self) -> MegatronPolicy:
        policy = self._policy
        if policy is None:
            raise RuntimeError("MegatronStrategy: the module's policy is not a MegatronPolicy (configure_model did "
                               "not convert it)")
        return policy

    # -------------------------------------------------------------------- lifecycle
    def on_train_end(self) -> None:
        """Gather the trained weights into the HF policy copy on every rank (a collective), for the export and
        for :meth:`teardown` to hand the module back with an HF policy."""
        policy = self._policy
        if policy is not None and policy.hf_model is not None:
            policy.sync_hf_model(load=True)

    def teardown(self) -> None:
        """Move the HF copy to CPU with the module (when it holds the trained weights: ``GRPOModule.teardown``
        then takes it back through :meth:`restore`), destroy megatron-core's model-parallel state and the process
        groups it created, remove the CPU shims. The default process group is Lightning's and lives as long as the
        process (as with ``DDPStrategy``), so a later ``fit`` can reuse it."""
        policy = self._policy
        self._dist_optimizer = None
        if policy is not None and policy.hf_model is not None:
            if policy.hf_model_holds_weights():
                policy.hf_model.cpu()
                self.optimizers = []  # they hold the megatron-core parameters
            else:
                log.warning("MegatronStrategy.teardown: the run did not finish; module.policy stays a MegatronPolicy")
        super().teardown()  # megatron-core's state and groups (MegatronLayout.teardown)


@backend_for.register
def _backend(strategy: MegatronStrategy) -> ParallelBackend:
    """A ``MegatronStrategy`` is its own backend."""
    return strategy


@compute_dtype.register
def _compute_dtype(strategy: MegatronStrategy, parameter_dtype: torch.dtype) -> torch.dtype:
    """The megatron-core weights' dtype when set (``params_dtype``, or "bf16-true": megatron-core computes in its
    parameters' dtype), else the precision plugin's."""
    return strategy.policy_params_dtype or precision_dtype(strategy.precision_plugin.precision, parameter_dtype)


def _uses_te(policy: MegatronPolicy) -> bool:
    return any(n.endswith("layer_norm_weight") for n, _ in policy.model.named_parameters())


def check_routing_options(config: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` for the mixture-of-experts options of ``config`` (a ``GRPOConfig`` as a dict) that the
    Megatron policy does not offer: ``routing_replay="R2"`` (the old-logprob pass would have to record the
    routers' choices into the experience), ``routing_replay_diagnostics`` and ``router_aux_loss_coef > 0`` (both
    observe the HF model's routers, which the Megatron policy's forward passes do not run). ``routing_replay="R3"``
    is offered (the policy's routers replay the rollout's routing, :mod:`~lightning_grpo.strategies.megatron.
    replay`)."""
    refused = {"routing_replay": config.get("routing_replay") == "R2",
               "routing_replay_diagnostics": bool(config.get("routing_replay_diagnostics")),
               "router_aux_loss_coef": bool(config.get("router_aux_loss_coef"))}
    for field, bad in refused.items():
        if bad:
            raise ValueError(f"GRPOConfig.{field}={config[field]!r} is not offered with MegatronStrategy (its "
                             "megatron-core routers replay the rollout's routing, routing_replay='R3', but neither "
                             "record the old policy's ('R2') nor add the load-balancing loss); use 'R3' or 'off' and "
                             "router_aux_loss_coef=0, or the HF policy (single device, DDP, FSDP2)")


def check_no_token_budget(budget: Any, expert_model_parallel_size: int, expert_tensor_parallel_size: int) -> None:
    """Raise ``ValueError`` for a token budget (``GRPOConfig.max_tokens_per_microbatch``, an int or "auto") with the
    experts split over ranks (see :meth:`MegatronStrategy.setup`)."""
    if budget is not None and expert_model_parallel_size * expert_tensor_parallel_size > 1:
        raise ValueError(
            f"GRPOConfig.max_tokens_per_microbatch={budget!r} with MegatronStrategy(expert_model_parallel_size="
            f"{expert_model_parallel_size}, expert_tensor_parallel_size={expert_tensor_parallel_size}): a token budget "
            "gives each data-parallel rank its own number of micro-batches, while every forward pass of experts split "
            "over ranks is a collective of their groups; set it to None (micro-batches by accumulate_grad_batches)")
