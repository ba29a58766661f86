"""GRPOModule: the LightningModule whose ``training_step`` is the GRPO loss on one experience micro-batch. Lightning
wiring only: each hook calls a component that owns one concern (docs/architecture.md)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
from collections import deque
from typing import Any, Callable, Iterator, Literal, Optional, Sequence, Union

import lightning as L
import torch
from peft import LoraConfig
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase
from typing_extensions import override

from lightning_grpo.algorithm import ObjectiveOutput, grpo_objective
from lightning_grpo.callbacks.base import forward_event, warn_untyped_event_hooks
from lightning_grpo.config import GRPOConfig
from lightning_grpo.data.source import EvalSource, PromptSource
from lightning_grpo.episodes import ToolCallParser, as_tools, episode_runner
from lightning_grpo.episodes.environment import EnvironmentFactory
from lightning_grpo.episodes.tools import ToolSpec
from lightning_grpo.evaluation.evaluator import EVAL_INDEX, Evaluator, counted_rows
from lightning_grpo.experience_maker import ExperienceMaker, RolloutContext
from lightning_grpo.loop.fit_loop import install_loop
from lightning_grpo.models.dropout import disable_dropout, warn_dropout_with_reused_rollouts
from lightning_grpo.models.lora import (
    check_quantized_engine,
    check_tied_head,
    export_policy,
    load_lora_policy,
    lora_settings,
    reference_for,
    trim_frozen_weights,
)
from lightning_grpo.rewards import RewardSet, RewardSpec
from lightning_grpo.rewards.reward_model import resolve_reward_models
from lightning_grpo.rollout.base import RolloutEngine, RolloutOutput, SamplingConfig, eos_token_ids_from
from lightning_grpo.rollout.prefetch import PrefetchedRollout
from lightning_grpo.rollout.worker import RolloutWorker
from lightning_grpo.runtime.checkpointing import use_atomic_checkpoint_io
from lightning_grpo.runtime.preemption import Preemption
from lightning_grpo.strategies import backend_for
from lightning_grpo.strategies.base import GRPOModels, ParallelBackend
from lightning_grpo.strategies.local import LocalBackend
from lightning_grpo.training.collectives import Collectives
from lightning_grpo.training.experience import Experience, micro_batches
from lightning_grpo.training.logprobs import CompletionLogprobs
from lightning_grpo.training.metrics import StepMetrics, StepTimer
from lightning_grpo.training.nonfinite import NonFiniteGuard, check_finite_checkpoint
from lightning_grpo.training.optim import adamw_with_warmup, check_optimizer_arguments
from lightning_grpo.training.selection import StepSelection
from lightning_grpo.training.teacher import make_teacher
from lightning_grpo.training.token_budget import adamw_state_bytes, choose_token_budget

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
        config: the algorithm settings.
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
            (:mod:`lightning_grpo.models.lora`); the KL reference is the base (adapters off); checkpoints hold the
            adapters.
        quantization: "4bit" or "8bit": a bitsandbytes-quantized frozen base for ``lora`` (CUDA only).
        export_merged: with ``lora``, also export the merged model to ``<export_dir>/merged``.
        tools: multi-turn tool use (docs/multiturn.md): functions with type hints and a Google-style docstring, or
            built-in tool names ("calculator"); the model's tool calls are run and their results appended as tool
            turns until it answers without a call or a limit (``config.episode``) ends the episode.
        environment_factory: multi-turn episodes with a stateful environment: a callable (e.g. a class) making one
            :class:`lightning_grpo.episodes.Environment` per episode (``reset(**row)``, ``step(turn) -> EnvStep``,
            ``close()``); with it, ``tools`` are only described in the prompt.
        tool_parser: the tool-call format (:class:`lightning_grpo.episodes.ToolCallParser`); default the Hermes /
            Qwen ``<tool_call>`` JSON format.

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
    ) -> None:
        super().__init__()
        config = config or GRPOConfig()
        self.config = GRPOConfig.from_dict(config) if isinstance(config, dict) else copy.deepcopy(config)
        # hyperparameters are stored as plain data so checkpoints load with torch.load(weights_only=True)
        self.save_hyperparameters(ignore=["model", "tokenizer", "reward_funcs", "accuracy_reward", "config", "lora",
                                          "tools", "environment_factory", "tool_parser"])
        self._lora_settings = settings = lora_settings(lora, quantization, dtype, export_merged)
        self.hparams.update(config=dataclasses.asdict(self.config), lora=settings.hparams)
        self.hparams["model"] = model if isinstance(model, str) or model is None else type(model).__name__
        check_optimizer_arguments(learning_rate, weight_decay, adam_betas, warmup_steps, dtype)
        reward_funcs = resolve_reward_models(reward_funcs)  # "owner/name", "./folder": a reward model, as in TRL
        self.rewards = RewardSet.from_specs(reward_funcs, reward_weights, tolerant_reward_funcs,
                                            primary=self.config.primary_reward, accuracy=accuracy_reward,
                                            pool_width=self.config.reward_num_workers)
        self.policy, self.tokenizer, self.model_path = load_lora_policy(model, tokenizer, dtype,
                                                                        gradient_checkpointing, settings)
        if self.config.disable_dropout:
            disable_dropout(self.policy)
        self._reference = reference_for(self.policy, self.config.beta)  # outside the module tree; LoRA: adapters off
        trim_frozen_weights(self)  # LoRA: checkpoints hold the adapters only
        self.backend: ParallelBackend = LocalBackend()  # the trainer's backend from configure_model on
        self.rollout = RolloutWorker(self.config, self.tokenizer, events=self._emit)
        self.tools = as_tools(tools)  # multi-turn episodes (docs/multiturn.md)
        self.hparams["tools"] = [t.name for t in self.tools]
        eos = eos_token_ids_from(getattr(self.policy, "generation_config", None), self.tokenizer)
        self.rollout.episodes = episode_runner(self.config, self.tokenizer, eos, self.tools, environment_factory,
                                               tool_parser, self.rollout.stop)
        self.logprobs = CompletionLogprobs(self.config, is_sharded=lambda m: self.backend.is_sharded(m))
        # on-policy distillation (issue 33): a frozen teacher model (outside the module tree) or a served teacher
        self.teacher = make_teacher(self.config.distillation, self.tokenizer, dtype, self.logprobs)
        self.experience_maker = ExperienceMaker(self.config, self.rollout, self.rewards, self.logprobs, self._emit,
                                                teacher=self.teacher)
        self.step_selection = StepSelection(self.config, self.logprobs)
        self.step_metrics = StepMetrics(self.config.clip_ratio_c, self.config.tis_cap())
        self.timer = StepTimer()
        self.experience_maker.bind(RolloutContext(timer=self.timer))  # one process until a trainer's backend
        self.nonfinite = NonFiniteGuard(self.config.on_nonfinite)
        self.preemption = Preemption(self.rollout.stop)
        self.evaluator = Evaluator(self.config.eval.k)
        self.token_budget: Optional[int] = None  # with max_tokens_per_microbatch="auto": the budget chosen
        self._step_members: list[Experience] = []  # the micro-batches of the step being trained (prepare_step)
        self._step_outputs: deque[ObjectiveOutput] = deque()  # a whole-step backend's outputs not yet logged

    def _emit(self, name: str, payload: Any) -> None:
        """Rollout events (:mod:`lightning_grpo.events`) to the trainer's callbacks that define ``name``."""
        forward_event(self._trainer, self, name, payload)

    @property
    def generated_tokens_estimate(self) -> int:
        """Tokens the engine has generated so far, all rollouts (the stop flag's count; the progress bar shows it)."""
        return self.rollout.stop.ticks

    @property
    def ref_model(self) -> Optional[nn.Module]:
        """The frozen reference policy (beta > 0), else None."""
        return self._reference.model

    @property
    def rollout_engine(self) -> Optional[RolloutEngine]:
        """The rollout engine (made in ``setup``; a backend may wrap it)."""
        return self.rollout.engine

    @rollout_engine.setter
    def rollout_engine(self, engine: Optional[RolloutEngine]) -> None:
        self.rollout.engine = engine

    @override
    def setup(self, stage: str) -> None:
        if stage == "fit":
            install_loop(self.trainer)
        data = self.trainer.datamodule
        prompts = data.prompts_per_step if isinstance(data, PromptSource) else None
        self.rollout.start(self.policy, self.model_path, rollout_prompts=prompts)  # (sizes an "auto" KV cache)
        check_quantized_engine(self._lora_settings, self.rollout.require_engine())
        self.rewards.setup(self.trainer.strategy.root_device)  # e.g. a reward model's device="auto": this rank's
        check_tied_head(self.policy, self.rollout.require_engine())
        if stage == "fit":
            updates = self.steps_per_rollout() if isinstance(self.trainer.datamodule, PromptSource) else 1
            warn_dropout_with_reused_rollouts(self.policy, max(updates, self.config.num_iterations))
        self.preemption.attach(self.trainer)
        use_atomic_checkpoint_io(self.trainer.strategy)
        warn_untyped_event_hooks(self.trainer.callbacks)

    @override
    def configure_model(self) -> None:
        """The trainer's backend shards or converts the policy, reference and engine (``strategies.backend_for``)."""
        self.backend = backend_for(self.trainer.strategy)
        models = self.backend.configure(GRPOModels(self.policy, self.ref_model, self.rollout.engine,
                                                   self.teacher_model))
        self._set_models(models)

    @property
    def collectives(self) -> Collectives:
        """The trainer's data-parallel reductions (the backend's), flags on this module's device."""
        return self.backend.collectives(self.device)

    def _bind_context(self) -> None:
        """The experience maker's :class:`~lightning_grpo.experience_maker.RolloutContext` for this run (the
        backend, device and trainer settings are final once the fit, validation or test starts)."""
        self.experience_maker.bind(RolloutContext(
            collectives=self.collectives, timer=self.timer,
            forward_context=self.trainer.precision_plugin.forward_context,
            micro_batches_per_step=self.trainer.accumulate_grad_batches, rank=self.global_rank,
        ))

    def _set_models(self, models: GRPOModels) -> None:
        self.policy, self.rollout.engine, self._reference.model = models.policy, models.engine, models.ref
        if self.teacher is not None and models.teacher is not None:  # a teacher model, sharded like the reference
            self.teacher.model = models.teacher

    @property
    def teacher_model(self) -> Optional[nn.Module]:
        """On-policy distillation's frozen teacher model (``config.distillation.teacher``), else None (no teacher,
        or a served one)."""
        return None if self.teacher is None else self.teacher.model

    @override
    def teardown(self, stage: str) -> None:
        """Stop background rollouts; plain HF models again (Megatron converts back); close the rollout engine the
        module made from ``config.engine`` (a given engine is kept; the next fit, validate or test makes a new one);
        a finished module holds no trainer's backend."""
        self.experience_maker.close()
        self._set_models(self.backend.restore(GRPOModels(self.policy, self.ref_model, self.rollout.engine,
                                                         self.teacher_model)))
        self.backend = LocalBackend()
        self.rollout.close()

    @override
    def on_fit_start(self) -> None:
        for frozen in (self.ref_model, self.teacher_model):
            if frozen is not None:
                frozen.to(self.device)
        self._bind_context()

    @override
    def on_validation_start(self) -> None:
        self._bind_context()

    @override
    def on_test_start(self) -> None:
        self._bind_context()

    def micro_batches_per_rollout(self) -> Optional[int]:
        """``training_step`` calls per rollout: num_iterations * mini-batches * accumulate_grad_batches; None with
        ``max_tokens_per_microbatch`` (the token budget decides). Raises as :meth:`steps_per_rollout`."""
        steps = self.steps_per_rollout()  # checks the datamodule
        return None if self.config.max_tokens_per_microbatch else steps * self.trainer.accumulate_grad_batches

    def steps_per_rollout(self) -> int:
        """Optimizer steps per rollout: num_iterations * (rollout batch / mini_batch_size). Raises ValueError when the
        datamodule does not say how many prompts a rollout batch has (``prompts_per_step``)."""
        data = self.trainer.datamodule
        if not isinstance(data, PromptSource):
            raise ValueError("GRPO needs the datamodule's prompts_per_step (prompts per rollout batch): pass a "
                             "lightning_grpo.data.PromptDataModule or a LightningDataModule with that attribute "
                             "(lightning_grpo.data.source.PromptSource)")
        n = data.prompts_per_step * self.config.num_generations
        return self.config.num_iterations * (n // (self.config.mini_batch_size or n))

    def make_experience(
        self, batch: dict[str, list], next_prompt_batch: Optional[Callable[[], Optional[dict[str, list]]]] = None,
        prefetched: Optional[PrefetchedRollout] = None,
    ) -> Experience:
        """One rollout batch -> experience (:meth:`lightning_grpo.experience_maker.ExperienceMaker.make`, which
        documents the steps and errors; ``prefetched``: the background rollout :meth:`prefetch_rollout` started for
        ``batch``). Called by the loop; runs on this process's prompts only. On SIGTERM the rollout stops and
        Lightning's ``SIGTERMException`` is raised (:mod:`lightning_grpo.runtime.preemption`)."""
        with self.preemption.exit_on_stop():
            return self.experience_maker.make(batch, self.policy, self.ref_model, next_prompt_batch=next_prompt_batch,
                                              prefetched=prefetched)

    def rollouts_ahead(self, prompt_batches: Optional[int] = None) -> int:
        """Rollouts generated in the background ahead of the one being trained: ``max_staleness //
        steps_per_rollout`` (the weights of a rollout started at a rollout boundary are then at most
        ``max_staleness`` optimizer steps old when it is trained); 0 = synchronous rollouts.

        Args:
            prompt_batches: rollout batches per epoch (the loop's loader length), None when unknown.

        Raises:
            ValueError: ``0 < max_staleness < steps_per_rollout`` (no rollout could be generated ahead), or as many
                rollouts ahead as the epoch has batches or more: the whole epoch would be generated at its start and
                held in memory and in every checkpoint.
        """
        k = self.config.max_staleness
        if k == 0:
            return 0
        steps = self.steps_per_rollout()
        if k < steps:
            raise ValueError(f"GRPOConfig.max_staleness={k} is less than the {steps} optimizer steps of one rollout "
                             f"(num_iterations * mini-batches): no rollout can be generated ahead; use max_staleness "
                             f">= {steps} or 0")
        ahead = k // steps
        if prompt_batches is not None and ahead >= prompt_batches:
            raise ValueError(f"GRPOConfig.max_staleness={k} generates {ahead} rollouts ahead ({steps} optimizer "
                             f"step(s) per rollout), but an epoch has only {prompt_batches} rollout batches: the "
                             "whole epoch would be generated at its start and held in memory and in every "
                             f"checkpoint. Use max_staleness < {prompt_batches * steps} (at most "
                             f"{prompt_batches - 1} rollouts ahead)")
        return ahead

    def prefetch_rollout(self, batch: dict[str, list]) -> PrefetchedRollout:
        """Start generating ``batch``'s rollout in the background from the current weights
        (:meth:`lightning_grpo.experience_maker.ExperienceMaker.prefetch`); the loop passes it to
        :meth:`make_experience` later."""
        return self.experience_maker.prefetch(batch, self.policy)

    def wait_for_rollouts(self) -> None:
        """Wait until no rollout is generated in the background (the loop calls it before a checkpoint)."""
        self.experience_maker.wait_for_rollouts()

    def micro_batches(self, experience: Experience, step: Optional[int] = None) -> Iterator[Experience]:
        """The loop's view of one rollout (:func:`lightning_grpo.training.experience.micro_batches`), shuffled with
        ``shuffle_seed + step`` (default: the current optimizer step)."""
        cfg, step = self.config, self.global_step if step is None else step
        return micro_batches(
            experience, mini_batch_size=cfg.mini_batch_size or len(experience),
            accumulate_grad_batches=self.trainer.accumulate_grad_batches, num_iterations=cfg.num_iterations,
            loss_type=cfg.loss_type, max_new_tokens=cfg.max_new_tokens,
            world_size=self.backend.data_parallel_size,  # processes that hold different data
            generator=torch.Generator().manual_seed(cfg.shuffle_seed + step), collectives=self.collectives,
            max_tokens_per_microbatch=cfg.max_tokens_per_microbatch,
        )

    def tokenize_prompts(self, prompts: Sequence[Any]) -> tuple[list[list[int]], int]:
        """Encode prompts (:meth:`lightning_grpo.rollout.worker.RolloutWorker.tokenize`): ``(ids, num_truncated)``."""
        return self.rollout.tokenize(prompts)

    def generate(self, prompts: Sequence[Any], num_generations: int, sampling: SamplingConfig) -> RolloutOutput:
        """Rollout with the engine's current weights (:meth:`lightning_grpo.rollout.worker.RolloutWorker.generate`)."""
        return self.rollout.generate(prompts, num_generations, sampling)

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
                self._step_outputs.extend(self.backend.train_step(self.policy, self._step_members or [batch],
                                                                  self.objective, self.config))
            output = self._step_outputs.popleft() if self.backend.runs_whole_step else self.compute_loss(batch)
        self.timer.add("train_tokens", float(self.logprobs.forward_tokens(self.policy, batch)))
        self.step_metrics.update(output)
        if batch.step_end:
            metrics = self.step_metrics.compute(self.collectives) | batch.metrics
            self.nonfinite.observe_loss(metrics.get("loss"))
            shown = {k: metrics.pop(k) for k in ("loss", "reward") if k in metrics}
            self.log_dict(shown, prog_bar=True, on_step=True, on_epoch=False, batch_size=1)
            self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)
        return output.loss * batch.loss_scale

    def prepare_step(self, micro_batches: list[Experience]) -> None:
        """The loop hands each optimizer step's micro-batches forward before its first ``training_step``: the
        whole step's token statistics (:class:`lightning_grpo.training.selection.StepSelection`), so that
        accumulation does not change the gradient. Counts as ``timing/forward_s``."""
        self._step_members = micro_batches
        with self.timer.span("forward_s"):
            self.step_selection.prepare(self.policy, micro_batches, self.collectives, self.global_step)

    def compute_loss(self, batch: Experience) -> ObjectiveOutput:
        """The policy's forward pass on ``batch`` and :func:`lightning_grpo.algorithm.grpo_objective` (the loss
        before ``batch.loss_scale``). Needs no Trainer.

        Raises:
            ValueError: ``batch`` is not ``on_policy`` but has no ``old_logprobs``; see also ``grpo_objective``.
        """
        logprobs, entropy = self.completion_logprobs(self.policy, batch, True,
                                                     entropy_grad=self.config.entropy_coef > 0)
        return self.objective(batch, logprobs, entropy)

    def objective(self, batch: Experience, logprobs: Tensor, entropy: Optional[Tensor]) -> ObjectiveOutput:
        """:func:`lightning_grpo.algorithm.grpo_objective` of ``batch`` given the policy's ``(B, T)`` float32 logprobs
        and entropy (the step's statistics from :class:`~lightning_grpo.training.selection.StepSelection`).

        Raises:
            ValueError: ``batch`` is not ``on_policy`` but has no ``old_logprobs``; see also ``grpo_objective``.
        """
        cfg = self.config
        # in bypass mode the old policy is the sampler (grpo_objective reads sampler_logprobs)
        if not batch.on_policy and batch.old_logprobs is None and not cfg.correction.bypass_mode:
            raise ValueError("an experience micro-batch after the rollout's first optimizer step needs old_logprobs")
        return grpo_objective(
            logprobs, batch.completion_mask, batch.advantages, cfg,
            old_logprobs=None if batch.on_policy else batch.old_logprobs,
            ref_logprobs=None if cfg.kl_in_reward else batch.ref_logprobs, sampler_logprobs=batch.sampler_logprobs,
            entropy=entropy, normalizer=batch.loss_normalizer, teacher_logprobs=batch.teacher_logprobs,
            **self.step_selection.objective_kwargs(),
        )

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
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)  # float16 AMP skips inf gradients itself
        counts = self.nonfinite.before_optimizer_step(self.global_step, norm, optimizer, check_grad_norm=scaler is None)
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
        super().optimizer_step(*args, **kwargs)
        self.timer.after_optimizer_step()
        self.rollout.mark_stale()

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse non-finite weights or optimizer states (nonfinite.check_finite_checkpoint); keep the skip count."""
        check_finite_checkpoint(checkpoint, self.collectives)
        checkpoint["lightning_grpo_nonfinite"] = self.nonfinite.state_dict()

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The skipped-step count; the rollout worker's weight version (the checkpoint's optimizer steps)."""
        self.nonfinite.load_state_dict(checkpoint.get("lightning_grpo_nonfinite"))
        self.rollout.weights_version = int(checkpoint.get("global_step", self.rollout.weights_version))

    @override
    def on_train_start(self) -> None:
        if self.config.max_tokens_per_microbatch == "auto":
            self._fit_token_budget()
        self.timer.start()

    # --- memory: the auto token budget (lightning_grpo.training.token_budget) ---
    def _fit_token_budget(self) -> None:
        """Set ``config.max_tokens_per_microbatch`` from probe steps (the smallest over processes) and log it as
        ``token_budget``. Raises MemoryError as :func:`~lightning_grpo.training.token_budget.choose_token_budget`."""

        def train_step(batch: Experience) -> None:
            with self.trainer.precision_plugin.forward_context():
                loss = self.compute_loss(batch).loss
            loss.backward()
            self.policy.zero_grad(set_to_none=True)

        optimizers = self.trainer.optimizers
        budget = choose_token_budget(train_step, self.config, int(self.policy.config.vocab_size), self.device,
                                     self.config.mini_batch_size or self._rollout_sequences(),
                                     adamw_state_bytes(optimizers[0]) if optimizers else 0)
        smallest = -self.backend.reduce_max(torch.tensor([-float(budget.tokens)], device=self.device))
        self.config.max_tokens_per_microbatch = self.token_budget = int(smallest.item())
        log.info("token budget: %s", budget.describe())
        for logger in self.trainer.loggers:
            logger.log_metrics({"token_budget": float(self.token_budget)}, step=self.global_step)

    def _rollout_sequences(self) -> int:
        data = self.trainer.datamodule
        return (data.prompts_per_step if isinstance(data, PromptSource) else 1) * self.config.num_generations

    @override
    def on_before_backward(self, loss: Tensor) -> None:
        self.timer.before_backward()

    @override
    def on_after_backward(self) -> None:
        self.timer.after_backward()

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After an optimizer step, log where its wall time went
        (:meth:`lightning_grpo.training.metrics.StepTimer.step_end`:
        ``timing/{rollout,scoring,logprobs,sync,forward,backward,optimizer,step,other,train}_s``, seconds) and
        ``generated_tokens``, ``train_tokens``."""
        if isinstance(batch, Experience):
            if batch.step_end:
                self.log_dict(self.timer.step_end(), on_step=True, on_epoch=False, batch_size=1)
            self.preemption.on_micro_batch_end(batch.step_end)  # SIGTERM inside a step waits for its end

    @override
    def configure_optimizers(self) -> Any:
        hp = self.hparams
        return adamw_with_warmup((p for p in self.policy.parameters() if p.requires_grad), hp.learning_rate,
                                 hp.weight_decay, hp.adam_betas, hp.warmup_steps)

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
        data = self.trainer.datamodule
        names = data.eval_names if isinstance(data, EvalSource) else [None]
        dataset = names[dataloader_idx] if 0 < dataloader_idx < len(names) else None
        with self.preemption.exit_on_stop():
            out = self.experience_maker.evaluate(batch, self.policy, accuracy=self.rewards.accuracy_for(dataset))
        if EVAL_INDEX in batch:  # count each prompt once over the processes (a distributed sampler pads)
            sampler = self.trainer.distributed_sampler_kwargs or {}
            out.counted = counted_rows(batch[EVAL_INDEX], sampler.get("num_replicas", 1), sampler.get("rank", 0))
        for key, (metric, size, attribute) in self.evaluator.update(stage, dataset, out).items():
            self.log(key, metric, on_step=False, on_epoch=True, prog_bar=key.endswith("/accuracy"), batch_size=size,
                     add_dataloader_idx=False, metric_attribute=f"evaluator.{attribute}")

    @override
    def on_fit_end(self) -> None:
        path = self.export_path()
        if path:
            state_dict = self.backend.export_state_dict(self.policy)  # when sharded a collective: every rank gathers
            if self.trainer.is_global_zero:
                export_policy(self.policy, self.tokenizer, path, state_dict, merged=self.hparams.export_merged)

    def export_path(self) -> Optional[str]:
        """The HF export folder (see ``export_dir``), or None when disabled."""
        export_dir = self.hparams.export_dir
        if export_dir is not None:
            return export_dir or None
        return os.path.join(self.trainer.log_dir or self.trainer.default_root_dir, "hf_model")
