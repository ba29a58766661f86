"""GRPOModule: the LightningModule whose ``training_step`` is the GRPO loss on one experience micro-batch. Lightning
wiring only: :class:`~lightning_grpo.components.GRPOComponents` builds the components, each owning one concern
(docs/architecture.md), and each hook here calls one: entering and leaving a stage (the datamodule's plan, the rollout
engine kept across stages, the trainer's backend, the resolved "auto" values), what the loop asks for (the
experience), the training step, the optimizer's hooks, the validation and test steps and the export."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from collections import deque
from typing import Any, Callable, Literal, Optional, Sequence, Union

import lightning as L
import torch
from peft import LoraConfig
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase
from typing_extensions import override

from lightning_grpo.algorithm import ObjectiveOutput
from lightning_grpo.callbacks.grpo_callback import EventRoute
from lightning_grpo.components import GRPOComponents
from lightning_grpo.config import GRPOConfig
from lightning_grpo.data.source import DataPlan
from lightning_grpo.episodes import AgentFn, AgentRollout, ToolCallParser
from lightning_grpo.episodes.environment import EnvironmentFactory
from lightning_grpo.episodes.tools import ToolSpec
from lightning_grpo.experience import RolloutContext
from lightning_grpo.loop import schedule
from lightning_grpo.loop.fit_loop import install_loop
from lightning_grpo.models.dropout import warn_dropout_with_reused_rollouts
from lightning_grpo.models.loading import export_folder
from lightning_grpo.models.lora import (
    check_quantized_engine,
    check_tied_head,
    export_policy,
    lora_settings,
    trim_frozen_weights,
)
from lightning_grpo.protocols import Collectives, RolloutEngine, RolloutOutput, SamplingConfig
from lightning_grpo.protocols.streaming import StreamingEngine
from lightning_grpo.rewards import RewardSpec
from lightning_grpo.rollout.prefetch import PrefetchedRollout
from lightning_grpo.rollout.streaming import RolloutStream
from lightning_grpo.runtime.checkpointing import use_atomic_checkpoint_io
from lightning_grpo.runtime.cleanup import ReleaseOnException, install
from lightning_grpo.strategies import backend_for, compute_dtype
from lightning_grpo.strategies.backend import GRPOModels, ParallelBackend
from lightning_grpo.strategies.local import LocalBackend
from lightning_grpo.training.experience import Experience, StepPlan
from lightning_grpo.training.nonfinite import check_finite_checkpoint
from lightning_grpo.training.optim import (
    adamw_with_warmup,
    check_optimized_parameters,
    check_optimizer_arguments,
    warn_rounded_away_updates,
)
from lightning_grpo.training.token_budget import fit_token_budget

log = logging.getLogger(__name__)


class GRPOModule(L.LightningModule):
    """GRPO (DeepSeekMath, arXiv:2402.03300, sec. 4) for a causal LM, as a LightningModule.

    Args:
        model: an HF model id, a local folder, an ``nn.Module`` (a transformers causal LM), or None / "embedded"
            for the embedded SmolLM2-135M-Instruct (:func:`lightning_grpo.models.embedded.default_model_path`).
        tokenizer: a tokenizer, or its id/folder; None loads it from ``model`` (required when ``model`` is a module).
        reward_funcs: reward functions ``fn(prompts, completions, **columns) -> list[float | None]``, or names
            registered in :data:`lightning_grpo.rewards.REWARD_FUNCTIONS`, or "module:function" import paths, or
            reward models: a folder or hub id (a string with a ``/``), loaded as a
            :class:`lightning_grpo.rewards.reward_model.RewardModel` on this process's device (docs/rewards.md).
        reward_weights: one weight per reward function (default 1 each); the reward is the weighted sum.
        accuracy_reward: the reward function used for validation accuracy (``val/accuracy``); default: the first.
        config: the algorithm settings (on-policy distillation's teacher, ``config.distillation``, is made here).
        learning_rate: AdamW peak learning rate.
        weight_decay: AdamW weight decay.
        adam_betas: AdamW betas.
        warmup_steps: linear warmup from 0 over this many optimizer steps, then constant.
        dtype: dtype the model weights are loaded in ("float32", "bfloat16", "float16").
        gradient_checkpointing: recompute each decoder layer's activations in backward to save memory, on every
            backend: transformers' non-reentrant checkpointing on one device, DDP, FSDP2 and FSDP1; megatron-core's
            full per-layer recompute under ``MegatronStrategy``. "offload": also keep the layers' saved inputs in
            pinned CPU memory until backward (CUDA; docs/performance.md).
        export_dir: where the trained policy is saved with ``save_pretrained`` at the end of fit; default
            ``<trainer.log_dir or default_root_dir>/hf_model``; "" disables the export.
        tolerant_reward_funcs: names (as in ``rewards/<name>/mean``) of reward functions whose exceptions become
            missing rewards (logged as a warning) instead of stopping the run; any other reward function that
            raises stops the run with its name and the index of the failing sample.
        lora: train LoRA adapters on the frozen base: a ``peft.LoraConfig`` or a dict of its fields
            (:mod:`lightning_grpo.models.lora`); the KL reference is the base (adapters off); checkpoints: adapters.
        quantization: "4bit" or "8bit": a bitsandbytes-quantized frozen base for ``lora`` (CUDA only).
        export_merged: with ``lora``, also export the merged model to ``<export_dir>/merged``.
        tools: multi-turn tool use (docs/multiturn.md): functions with type hints and a Google-style docstring, or
            built-in tool names ("calculator"); the model's tool calls are run and their results appended as tool
            turns until it answers without a call or a limit (``config.episode``) ends the episode.
        environment_factory: multi-turn episodes with a stateful environment: a callable (e.g. a class) making one
            :class:`lightning_grpo.episodes.Environment` per episode (``reset(**row)``, ``step(turn) -> EnvStep``,
            ``close()``); with it, ``tools`` are only described in the prompt.
        tool_parser: the tool-call format (:class:`lightning_grpo.episodes.ToolCallParser`); default Hermes/Qwen JSON.
        processor: a vision-language ``model``'s image processor or its folder (default: the model's; docs/vision.md).
        agent: train an unmodified agent (docs/agents.md): ``fn(base_url, api_key, row)`` (sync or ``async``) running
            any agent code against the OpenAI-compatible gateway at ``base_url`` (it may return the episode's reward),
            or an :class:`~lightning_grpo.episodes.AgentRollout`; not with tools, an environment or a tool parser.

    Raises:
        ValueError: a bad argument (named in the message).
    """

    def __init__(
        self,
        model: Union[str, nn.Module, None] = None,
        tokenizer: Union[str, PreTrainedTokenizerBase, None] = None,
        reward_funcs: Sequence[RewardSpec] = ("gsm8k_accuracy", "gsm8k_format"),
        reward_weights: Optional[Sequence[float]] = None,
        accuracy_reward: Optional[RewardSpec] = None,
        config: GRPOConfig = GRPOConfig(),  # noqa: B008 - a dataclass default: --help lists every config field
        learning_rate: float = 1e-6,
        weight_decay: float = 0.0,
        adam_betas: tuple[float, float] = (0.9, 0.99),
        warmup_steps: int = 0,
        dtype: str = "float32",
        gradient_checkpointing: Union[bool, Literal["offload"]] = False,
        export_dir: Optional[str] = None,
        tolerant_reward_funcs: Sequence[str] = (),
        lora: Optional[LoraConfig] = None,
        quantization: Optional[Literal["4bit", "8bit"]] = None,
        export_merged: bool = False,
        tools: Sequence[ToolSpec] = (),
        environment_factory: Optional[EnvironmentFactory] = None,
        tool_parser: Optional[ToolCallParser] = None,
        processor: Any = None,
        agent: Union[AgentRollout, AgentFn, None] = None,
    ) -> None:
        super().__init__()
        config = config or GRPOConfig()
        self.config = GRPOConfig.from_dict(config) if isinstance(config, dict) else copy.deepcopy(config)
        # hyperparameters are stored as plain data so checkpoints load with torch.load(weights_only=True)
        self.save_hyperparameters(ignore=["model", "tokenizer", "reward_funcs", "accuracy_reward", "config", "lora",
                                          "tools", "environment_factory", "tool_parser", "processor", "agent"])
        self._lora_settings = settings = lora_settings(lora, quantization, dtype, export_merged)
        self.hparams.update(config=dataclasses.asdict(self.config), lora=settings.hparams)
        self.hparams["model"] = model if isinstance(model, str) or model is None else type(model).__name__
        check_optimizer_arguments(learning_rate, weight_decay, adam_betas, warmup_steps, dtype)
        parts = GRPOComponents.build(
            self.config, settings, self._emit, model=model, tokenizer=tokenizer, reward_funcs=reward_funcs,
            reward_weights=reward_weights, accuracy_reward=accuracy_reward, tolerant_reward_funcs=tolerant_reward_funcs,
            dtype=dtype, gradient_checkpointing=gradient_checkpointing, tools=tools,
            environment_factory=environment_factory, tool_parser=tool_parser, processor=processor, agent=agent)
        self._loaded, self._reference, self.resolved = parts.loaded, parts.reference, parts.resolved
        self._engine_checkpoint = parts.engine_checkpoint
        self.policy, self.tokenizer, self.model_path = parts.loaded.policy, parts.loaded.tokenizer, parts.loaded.path
        trim_frozen_weights(self, parts.loaded)  # LoRA: checkpoints hold the adapters only
        self.tools, self.rewards, self.rollout, self.teacher = parts.tools, parts.rewards, parts.rollout, parts.teacher
        self.logprobs, self.experience_maker, self.timer = parts.logprobs, parts.experience_maker, parts.timer
        self.step_selection, self.step_metrics = parts.step_selection, parts.step_metrics
        self.nonfinite, self.preemption, self.evaluator = parts.nonfinite, parts.preemption, parts.evaluator
        self.routing = parts.routing
        self.hparams["tools"] = [t.name for t in self.tools]
        self._record_resolved()
        self.data_plan = DataPlan()  # what the trainer's datamodule says, read at each setup
        self._events = EventRoute()  # the trainer's GRPOCallbacks, picked at each setup
        self._release_on_exception = ReleaseOnException(self.experience_maker.release)
        self._step_outputs: deque[ObjectiveOutput] = deque()  # a whole-step backend's outputs not yet logged
        self.backend: ParallelBackend = LocalBackend()  # the trainer's backend from configure_model on
        self._set_models(self.backend.configure(self._models()))  # one process until a trainer's backend

    def _emit(self, name: str, payload: Any) -> None:
        """Rollout events (:mod:`lightning_grpo.events`) to the ``name`` hook of the trainer's ``GRPOCallback``s."""
        self._events(self, name, payload)

    def _record_resolved(self) -> None:
        """The resolved values into the hyperparameters (beside the config as given) and the log."""
        self.hparams["resolved"] = self.resolved.as_dict()
        log.info("resolved settings: %s", self.resolved.as_dict())

    @property
    def generated_tokens_estimate(self) -> int:
        """Tokens the engine has generated so far, all rollouts (the stop flag's count; the progress bar shows it)."""
        return self.rollout.stop.ticks

    @property
    def ref_model(self) -> Optional[nn.Module]:
        """The frozen reference policy (beta > 0), else None."""
        return self._reference.model

    @property
    def hf_model(self) -> nn.Module:
        """The policy's transformers model: a PEFT policy's base model (whose layers carry the adapters), else the
        policy (what the HF engine generates with)."""
        return self._loaded.base

    @property
    def teacher_model(self) -> Optional[nn.Module]:
        """On-policy distillation's frozen teacher model (``config.distillation.teacher``) as the backend made it,
        else None (no teacher, or a served one)."""
        return None if self.teacher is None else self.teacher.model

    @property
    def token_budget(self) -> Optional[int]:
        """The micro-batch token budget in effect (``resolved.max_tokens_per_microbatch``), None without one."""
        return self.resolved.max_tokens_per_microbatch

    @property
    def rollout_engine(self) -> Optional[RolloutEngine]:
        """The rollout engine (made in ``setup``; a backend may wrap it)."""
        return self.rollout.engine

    @rollout_engine.setter
    def rollout_engine(self, engine: Optional[RolloutEngine]) -> None:
        self.rollout.engine = engine

    @property
    def streaming_engine(self) -> Optional[StreamingEngine]:
        """Streaming rollouts' engine (``GRPOConfig.streaming.enabled``): made in ``setup`` from ``config.engine``
        (the rollout servers' pool) unless given; None otherwise."""
        adapter = self.rollout.streaming_engine
        return None if adapter is None else adapter.streaming

    @streaming_engine.setter
    def streaming_engine(self, engine: Optional[StreamingEngine]) -> None:
        """Give a :class:`~lightning_grpo.protocols.streaming.StreamingEngine` (yours: kept, never closed by the
        module) for streaming rollouts; it is the rollout engine too (validation samples on it)."""
        self.rollout.streaming_engine = engine

    @property
    def rollout_stream(self) -> Optional[RolloutStream]:
        """Streaming rollouts' stream while a fit trains (handed to the loop, which takes its groups and checkpoints
        it), else None."""
        return self.experience_maker.stream

    @property
    def collectives(self) -> Collectives:
        """The trainer's data-parallel reductions (the backend's), flags on this module's device."""
        return self.backend.collectives(self.device)

    @override
    def setup(self, stage: str) -> None:
        """Read the datamodule (:class:`~lightning_grpo.data.source.DataPlan`); make the rollout engine, once: a
        validation before the fit hands its engine to the fit (it is closed when the fit ends, when a run fails, or
        by :meth:`close_rollout_engine`)."""
        if stage == "fit":
            install_loop(self.trainer)
        self.data_plan = prompts = DataPlan.of(self.trainer.datamodule)
        self.rollout.check_image_column(prompts.image_field)  # images for a causal LM: refused before any rollout
        self._events = EventRoute.of(self.trainer)  # the trainer's GRPOCallbacks
        if stage == "fit" and prompts.prompts_per_step is not None:  # refused before an engine is built:
            schedule.rollouts_ahead(self.config, prompts.prompts_per_step)  # a max_staleness that cannot run ahead
        self.make_rollout_engine(prompts.prompts_per_step)
        install(self.trainer, self._release_on_exception)  # no teardown runs after a failure
        check_quantized_engine(self._lora_settings, self.rollout.require_engine())
        self.rewards.setup(self.trainer.strategy.root_device,  # e.g. a reward model's device="auto": this rank's
                           compute_dtype(self.trainer.strategy, next(self.policy.parameters()).dtype))
        check_tied_head(self.policy, self._loaded.base, self.rollout.require_engine())
        if stage == "fit":
            updates = 1 if prompts.prompts_per_step is None else schedule.steps_per_rollout(self.config,
                                                                                            prompts.prompts_per_step)
            warn_dropout_with_reused_rollouts(self.policy, max(updates, self.config.num_iterations))
        self.preemption.attach(self.trainer)
        use_atomic_checkpoint_io(self.trainer.strategy)

    def make_rollout_engine(self, rollout_prompts: Optional[int] = None) -> RolloutEngine:
        """Make the rollout engine ``config.engine`` names, once (``setup`` does; a made or given engine is kept;
        :meth:`lightning_grpo.rollout.worker.RolloutWorker.start`), resolving its "auto" settings into
        :attr:`resolved`. ``rollout_prompts``: prompts per rollout on this process, when known (sizes
        ``engine.kv_cache_space_gib="auto"``). Under a trainer, the engine samples in the dtype the trainer computes
        in (``engine.dtype="auto"``: :func:`~lightning_grpo.strategies.compute_dtype`; the HF engine inside the
        precision plugin's ``forward_context``). Returns the engine."""
        trainer, dtype, context = self._trainer, None, contextlib.nullcontext
        if trainer is not None:
            dtype = compute_dtype(trainer.strategy, next(self.policy.parameters()).dtype)
            context = trainer.precision_plugin.forward_context
        self.resolved = self.rollout.start(self._loaded.base, self._engine_checkpoint, self.resolved, rollout_prompts,
                                           dtype, context)
        self._record_resolved()
        return self.rollout.require_engine()

    def close_rollout_engine(self) -> None:
        """Close the rollout engine the module made (a validation or test keeps it for a following stage; the end
        of a fit closes it itself); the next stage makes a new one. A given engine is kept. Idempotent."""
        self.rollout.close()

    @override
    def configure_model(self) -> None:
        """The trainer's backend shards or converts the policy, reference, teacher and engine
        (``strategies.backend_for``)."""
        self.backend = backend_for(self.trainer.strategy)
        self._set_models(self.backend.configure(self._models()))

    def _models(self) -> GRPOModels:
        """The module's models for a backend: the engine as it was made or given, the policy's kind, the
        distillation teacher's model."""
        return GRPOModels(self.policy, self.ref_model, self.rollout.own_engine, lora=self._loaded.lora,
                          teacher=self.teacher_model,
                          routing_counts=None if self.routing is None else self.routing.add_replay_counts)

    def _set_models(self, models: GRPOModels) -> None:
        """Take what the backend made: the models, the engine's wrapper and weights, the scorer and layout."""
        self.policy, self._reference.model = models.policy, models.ref
        if self.teacher is not None and self.teacher.model is not None:  # sharded or converted like the reference
            self.teacher.model = models.teacher
        self.rollout.attach(models.engine, models.weights)
        self.logprobs.use(models.scorer, models.sharded, models.scorer_replays_routing)

    def _bind_context(self) -> None:
        """The experience maker's :class:`~lightning_grpo.experience.RolloutContext` for this run (the backend,
        device and trainer settings are final once the fit, validation or test starts; the token budget once
        training starts)."""
        self.experience_maker.bind(RolloutContext(
            collectives=self.collectives, timer=self.timer,
            forward_context=self.trainer.precision_plugin.forward_context,
            micro_batches_per_step=self.trainer.accumulate_grad_batches, rank=self.global_rank,
            token_budget=self.resolved.max_tokens_per_microbatch,
        ))

    @override
    def teardown(self, stage: str) -> None:
        """Stop background rollouts; plain HF models again (Megatron converts back); a finished module holds no
        trainer's backend. The rollout engine stays for the next stage, except at the end of a fit, which closes an
        engine the module made from ``config.engine`` (a given engine is the caller's, kept;
        :meth:`lightning_grpo.rollout.worker.RolloutWorker.end_stage`)."""
        self.experience_maker.close()
        restored = self.backend.restore(GRPOModels(self.policy, self.ref_model, teacher=self.teacher_model))
        self.rollout.end_stage(stage)
        self.backend = LocalBackend()
        self._set_models(self.backend.configure(dataclasses.replace(self._models(), policy=restored.policy,
                                                                    ref=restored.ref, teacher=restored.teacher)))

    @override
    def on_fit_start(self) -> None:
        """Check the optimizers (:func:`~lightning_grpo.training.optim.check_optimized_parameters`: they must hold
        :meth:`trained_parameters`, raises ValueError otherwise); the frozen models onto the device; the loop's plan."""
        check_optimized_parameters(self.policy, self.trainer.optimizers)
        for frozen in (self.ref_model, self.teacher_model):
            if frozen is not None:
                frozen.to(self.device)
        if self.trainer.precision in ("bf16-true", "16-true"):  # half-precision weights: updates may round away
            warn_rounded_away_updates((p for p in self.policy.parameters() if p.requires_grad),
                                      self.hparams.learning_rate, self.trainer.precision)
        self._bind_context()
        self._hand_plan()

    def _hand_plan(self) -> None:
        """Hand the loop the fit's :class:`~lightning_grpo.loop.schedule.LoopPlan` (the backend, device and trainer
        settings are final when the fit starts; the token budget once training starts)."""
        install_loop(self.trainer).use_plan(schedule.LoopPlan(
            self.config, self.data_plan.prompts_per_step, self.trainer.accumulate_grad_batches,
            self.backend.data_parallel_size, self.collectives, self.token_budget, self._plan_step))

    def _plan_step(self, micro_batches: list[Experience]) -> list[StepPlan]:
        """The loop's step planner: an optimizer step's statistics over all its micro-batches, before its first
        ``training_step`` (:meth:`lightning_grpo.training.selection.StepSelection.plan`), so that accumulation does
        not change the gradient. Counts as ``timing/forward_s``."""
        with self.timer.span("forward_s"):
            if self.routing is not None:  # the load-balancing loss's expert shares of the step
                self.routing.prepare_step(self.policy, micro_batches, lambda mb: self.logprobs(self.policy, mb),
                                          self.collectives)
            return self.step_selection.plan(self.policy, micro_batches, self.collectives, self.global_step)

    @override
    def on_validation_start(self) -> None:
        self._bind_context()

    @override
    def on_test_start(self) -> None:
        self._bind_context()

    @override
    def on_train_start(self) -> None:
        if self.config.max_tokens_per_microbatch == "auto" and self.resolved.max_tokens_per_microbatch is None:
            self._fit_token_budget()
        self.timer.start()
        if self.config.streaming.enabled:  # the engine gets the weights, then groups start streaming
            prompts = self.data_plan.prompts_per_step
            steps = schedule.steps_per_rollout(self.config, prompts)  # raises without prompts_per_step
            assert prompts is not None
            install_loop(self.trainer).use_stream(self.experience_maker.open_stream(self.policy, prompts, steps))

    def _fit_token_budget(self) -> None:
        """Choose ``max_tokens_per_microbatch="auto"`` from probe steps (the smallest over processes,
        :func:`~lightning_grpo.training.token_budget.fit_token_budget`) into :attr:`resolved`; log it as
        ``token_budget``. Raises MemoryError as that function."""
        tokens = fit_token_budget(lambda batch: self.compute_loss(batch).loss, self.policy,
                                  self.trainer.precision_plugin.forward_context, self.config,
                                  self.data_plan.prompts_per_step, self.device, self.trainer.optimizers,
                                  self.backend.reduce_max)
        self.resolved = self.resolved.replace(max_tokens_per_microbatch=tokens)
        self._record_resolved()
        self._bind_context()  # the old/ref logprob passes take the budget too
        self._hand_plan()  # and the loop's micro-batches
        for logger in self.trainer.loggers:
            logger.log_metrics({"token_budget": float(tokens)}, step=self.global_step)

    @override
    def on_fit_end(self) -> None:
        """Export the trained policy to :meth:`export_path` (:func:`lightning_grpo.models.lora.export_policy`; the
        full weights of a sharded one gathered by every process, written by the first)."""
        path = self.export_path()
        state_dict = self.backend.export_state_dict(self.policy) if path else None  # sharded: a collective
        if path and self.trainer.is_global_zero:
            export_policy(self.policy, self.tokenizer, path, state_dict, merged=self.hparams.export_merged)

    def export_path(self) -> Optional[str]:
        """The HF export folder (see ``export_dir``; :func:`lightning_grpo.models.loading.export_folder`), or None when
        disabled."""
        return export_folder(self.hparams.export_dir, self.trainer.log_dir, self.trainer.default_root_dir)

    def make_experience(
        self, batch: Optional[dict[str, list]],
        next_prompt_batch: Optional[Callable[[], Optional[dict[str, list]]]] = None,
        prefetched: Optional[PrefetchedRollout] = None,
    ) -> Optional[Experience]:
        """One rollout batch -> experience (:meth:`lightning_grpo.experience.maker.ExperienceMaker.make`, which
        documents the steps and errors; ``prefetched``: the background rollout :meth:`prefetch_rollout` started for
        ``batch``; ``batch`` None: streaming rollouts, the next finished groups of :attr:`rollout_stream`, None when
        the epoch's data is used up). Called by the loop; runs on this process's prompts only. On SIGTERM the rollout
        stops and Lightning's ``SIGTERMException`` is raised (:mod:`lightning_grpo.runtime.preemption`)."""
        with self.preemption.exit_on_stop():
            return self.experience_maker.make(batch, self.policy, self.ref_model, next_prompt_batch=next_prompt_batch,
                                              prefetched=prefetched)

    def prefetch_rollout(self, batch: dict[str, list]) -> PrefetchedRollout:
        """Start generating ``batch``'s rollout in the background from the current weights
        (:meth:`lightning_grpo.experience.maker.ExperienceMaker.prefetch`); the loop passes it to
        :meth:`make_experience` later."""
        return self.experience_maker.prefetch(batch, self.policy)

    def wait_for_rollouts(self) -> None:
        """Wait until no rollout is generated in the background (the loop calls it before a checkpoint)."""
        self.experience_maker.wait_for_rollouts()

    def generate(self, prompts: Sequence[Any], num_generations: int, sampling: SamplingConfig) -> RolloutOutput:
        """Rollout from raw prompts with the engine's current weights
        (:meth:`lightning_grpo.rollout.worker.RolloutWorker.sample_prompts`)."""
        return self.rollout.sample_prompts(prompts, num_generations, sampling)

    def completion_logprobs(
        self, model: nn.Module, batch: Experience, with_entropy: bool = False, entropy_grad: bool = False
    ) -> tuple[Tensor, Optional[Tensor]]:
        """Per-token logprobs ``(B, T)`` float32 (and entropy) of ``batch``'s completions under ``model`` (logprobs)."""
        return self.logprobs(model, batch, with_entropy=with_entropy, entropy_grad=entropy_grad)

    @override
    def training_step(self, batch: Experience, batch_idx: int) -> Tensor:
        """GRPO loss on one experience micro-batch (DeepSeekMath eq. 3 with the chosen variants; see
        :func:`lightning_grpo.algorithm.grpo_objective`).

        Returns the micro-batch's share of the step loss, scaled so that after Lightning's division by
        ``accumulate_grad_batches`` and data-parallel averaging the step's gradient is that of (summed loss / step
        normalizer). A backend that ``runs_whole_step`` (Megatron's pipeline schedules) gets all of the step's
        micro-batches at its first one (``backend.train_step``: forward and backward with the same normalization);
        its outputs are logged micro-batch by micro-batch and the returned loss is detached."""
        with self.timer.span("forward_s"):
            if batch.step_start and self.backend.runs_whole_step:  # e.g. pipeline schedules: the whole step now
                self._step_outputs.extend(self.backend.train_step(self.policy, list(batch.step_members()),
                                                                  self.objective, self.config))
            output = self._step_outputs.popleft() if self.backend.runs_whole_step else self.compute_loss(batch)
        self.timer.add("train_tokens", float(self.logprobs.forward_tokens(self.policy, batch)))
        self.step_metrics.update(output)
        if batch.step_end:
            metrics = self.step_metrics.compute(self.collectives) | batch.metrics
            if self.routing is not None:  # sampling/router_disagreement, aux_loss
                metrics |= self.routing.step_metrics(self.collectives)
            self.nonfinite.observe_loss(metrics.get("loss"))
            shown = {k: metrics.pop(k) for k in ("loss", "reward") if k in metrics}
            self.log_dict(shown, prog_bar=True, on_step=True, on_epoch=False, batch_size=1)
            self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
        return output.loss * batch.loss_scale

    def compute_loss(self, batch: Experience) -> ObjectiveOutput:
        """The policy's forward pass on ``batch`` and :func:`lightning_grpo.algorithm.grpo_objective` (the loss
        before ``batch.loss_scale``). Needs no Trainer.

        Raises:
            ValueError: ``batch`` is not ``on_policy`` but has no ``old_logprobs``; see also ``grpo_objective``.
        """
        logprobs, entropy = self.completion_logprobs(self.policy, batch, True,
                                                     entropy_grad=self.config.entropy_coef > 0)
        output = self.objective(batch, logprobs, entropy)
        aux = None if self.routing is None else self.routing.aux_loss()
        if aux is not None:  # the load-balancing loss's share of this micro-batch (GRPOConfig.router_aux_loss_coef)
            output = dataclasses.replace(output, loss=output.loss + self.config.router_aux_loss_coef * aux)
        return output

    def objective(self, batch: Experience, logprobs: Tensor, entropy: Optional[Tensor]) -> ObjectiveOutput:
        """:func:`lightning_grpo.algorithm.grpo_objective` of ``batch`` given the policy's ``(B, T)`` float32 logprobs
        and entropy, with its step's statistics (``batch.step_plan``;
        :meth:`lightning_grpo.training.selection.StepSelection.objective`, which names the errors)."""
        return self.step_selection.objective(batch, logprobs, entropy)

    @override
    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        """Lightning's ``optimizer.zero_grad()``, except for a backend that runs whole steps (it zeroes the gradients
        itself before its schedule; Lightning would zero them after the first micro-batch's ``training_step``)."""
        if not self.backend.runs_whole_step:
            super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Log ``grad_norm``; a non-finite loss or gradient norm stops the run or skips the step
        (``GRPOConfig.on_nonfinite``, :class:`lightning_grpo.training.nonfinite.NonFiniteGuard`)."""
        norm = self.backend.grad_norm(self.policy)  # of the full gradient, also when sharded (a collective there)
        if norm is not None:
            self.log("grad_norm", norm, on_step=True, on_epoch=False, batch_size=1)
        scaled = self.trainer.precision == "16-mixed"  # float16 AMP's grad scaler skips inf gradients itself
        counts = self.nonfinite.before_optimizer_step(self.global_step, norm, optimizer, check_grad_norm=not scaled)
        self.log_dict(counts, on_step=True, on_epoch=False, batch_size=1)

    @override
    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer,
                                    gradient_clip_val: Optional[Union[int, float]] = None,
                                    gradient_clip_algorithm: Optional[str] = None) -> None:
        """``Trainer(gradient_clip_val=...)``; by the norm of the full gradient also under FSDP and Megatron
        (the backend's ``clip_gradients``)."""
        self.backend.clip_gradients(self.policy, optimizer, gradient_clip_val, gradient_clip_algorithm,
                                    fallback=self.clip_gradients)

    @override
    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's step; the engine's weights are a version older (streaming rollouts: the new weights go to the
        engine in flight now, :meth:`lightning_grpo.experience.maker.ExperienceMaker.after_optimizer_step`)."""
        super().optimizer_step(*args, **kwargs)
        self.timer.after_optimizer_step()
        self.rollout.mark_stale()
        self.experience_maker.after_optimizer_step(self.policy)

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse non-finite weights or optimizer states (nonfinite.check_finite_checkpoint); keep the skip count."""
        check_finite_checkpoint(checkpoint, self.collectives)
        checkpoint["lightning_grpo_nonfinite"] = self.nonfinite.state_dict()

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The skipped-step count; the rollout worker's weight version (the checkpoint's optimizer steps)."""
        self.nonfinite.load_state_dict(checkpoint.get("lightning_grpo_nonfinite"))
        self.rollout.load_state_dict({"weights_version": checkpoint.get("global_step", self.rollout.weights_version)})

    @override
    def on_before_backward(self, loss: Tensor) -> None:
        self.timer.before_backward()

    @override
    def on_after_backward(self) -> None:
        self.timer.after_backward()

    @override
    def on_train_batch_end(self, outputs: Any, batch: Experience, batch_idx: int) -> None:
        """After an optimizer step, log where its wall time went
        (:meth:`lightning_grpo.training.metrics.StepTimer.step_end`:
        ``timing/{rollout,scoring,logprobs,sync,forward,backward,optimizer,step,other,train}_s``, seconds) and
        ``generated_tokens``, ``train_tokens``; streaming rollouts: ``timing/weight_update_s`` and
        ``timing/weight_pause_s`` of the step's weight update."""
        if batch.step_end:  # the loop's batches are experience micro-batches
            metrics = self.timer.step_end() | self.experience_maker.weight_update_metrics()
            self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
        self.preemption.on_micro_batch_end(batch.step_end)  # SIGTERM inside a step waits for its end

    def trained_parameters(self) -> list[nn.Parameter]:
        """The parameters the optimizer steps: the policy's with ``requires_grad`` (a LoRA policy's adapters), as the
        trainer's backend made them in ``configure_model`` (converted into megatron-core's by ``MegatronStrategy``,
        sharded by FSDP). Build the optimizer from these inside ``configure_optimizers``, which Lightning calls after
        ``configure_model``: parameters taken before it are not the trained ones, and a fit refuses an optimizer
        over them (:meth:`on_fit_start`)."""
        return [p for p in self.policy.parameters() if p.requires_grad]

    @override
    def configure_optimizers(self) -> Any:
        """AdamW over :meth:`trained_parameters` with ``learning_rate``, ``weight_decay``, ``adam_betas`` and a linear
        warmup of ``warmup_steps`` optimizer steps (:func:`~lightning_grpo.training.optim.adamw_with_warmup`);
        ``lightning-grpo fit --optimizer ...`` replaces it (:func:`lightning_grpo.cli.use_cli_optimizer`)."""
        hp = self.hparams
        return adamw_with_warmup(self.trained_parameters(), hp.learning_rate, hp.weight_decay, hp.adam_betas,
                                 hp.warmup_steps)

    @override
    def validation_step(self, batch: dict[str, list], batch_idx: int, dataloader_idx: int = 0) -> None:
        """Greedy accuracy, and pass@k / maj@k / mean@k with ``eval.num_samples``, per dataset (torchmetrics
        over all processes; names in :class:`lightning_grpo.evaluation.evaluator.Evaluator`)."""
        self._evaluate(batch, dataloader_idx, "val")

    @override
    def test_step(self, batch: dict[str, list], batch_idx: int, dataloader_idx: int = 0) -> None:
        """As :meth:`validation_step`, logged as ``test/...``."""
        self._evaluate(batch, dataloader_idx, "test")

    def _evaluate(self, batch: dict[str, list], dataloader_idx: int, stage: str) -> None:
        dataset, check = self.data_plan.evaluated(dataloader_idx)  # the first is the training one: the module's
        sampler = self.trainer.distributed_sampler_kwargs or {}  # it pads: each prompt is counted once
        with self.preemption.exit_on_stop():
            out = self.experience_maker.evaluate(batch, self.policy, self.rewards.accuracy_for(check),
                                                 (sampler.get("rank", 0), sampler.get("num_replicas", 1)))
        for key, (metric, size, attribute) in self.evaluator.update(stage, dataset, out).items():
            self.log(key, metric, on_step=False, on_epoch=True, prog_bar=key.endswith("/accuracy"), batch_size=size,
                     add_dataloader_idx=False, metric_attribute=f"evaluator.{attribute}")
