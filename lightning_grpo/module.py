"""GRPOModule: the LightningModule whose ``training_step`` is the GRPO loss on one experience micro-batch. Lightning
wiring only: each hook calls a component that owns one concern (docs/architecture.md). The hooks of entering and
leaving a stage (setup, the backend, the engine's lifetime, the export) are its base
:class:`~lightning_grpo.lifecycle.RunLifecycle`'s; here are its construction, what the loop asks of it, the training
step and the optimizer's hooks."""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections import deque
from typing import Any, Callable, Iterator, Literal, Optional, Sequence, Union

import torch
from peft import LoraConfig
from torch import Tensor, nn
from transformers import PreTrainedTokenizerBase
from typing_extensions import override

from lightning_grpo.algorithm import ObjectiveOutput
from lightning_grpo.callbacks.base import EventRoute
from lightning_grpo.config import GRPOConfig, ResolvedConfig
from lightning_grpo.data.source import DataPlan
from lightning_grpo.distillation.make import make_teacher
from lightning_grpo.episodes import AgentFn, AgentRollout, ToolCallParser, as_tools, rollout_path
from lightning_grpo.episodes.environment import EnvironmentFactory
from lightning_grpo.episodes.tools import ToolSpec
from lightning_grpo.evaluation.evaluator import Evaluator
from lightning_grpo.experience_maker import ExperienceMaker, RolloutContext
from lightning_grpo.lifecycle import RunLifecycle
from lightning_grpo.models.dropout import disable_dropout
from lightning_grpo.models.lora import load_lora_policy, lora_settings, reference_for, trim_frozen_weights
from lightning_grpo.protocols import RolloutOutput, SamplingConfig, StopFlag
from lightning_grpo.rewards import RewardSet, RewardSpec
from lightning_grpo.rewards.reward_model import resolve_reward_models
from lightning_grpo.rollout.prefetch import PrefetchedRollout
from lightning_grpo.rollout.registry import resolve_engine_name
from lightning_grpo.rollout.worker import RolloutWorker
from lightning_grpo.runtime.cleanup import ReleaseOnException
from lightning_grpo.runtime.preemption import Preemption
from lightning_grpo.strategies.base import ParallelBackend
from lightning_grpo.strategies.local import LocalBackend
from lightning_grpo.training import schedule
from lightning_grpo.training.experience import Experience
from lightning_grpo.training.logprobs import CompletionLogprobs
from lightning_grpo.training.metrics import StepMetrics, StepTimer
from lightning_grpo.training.nonfinite import NonFiniteGuard, check_finite_checkpoint
from lightning_grpo.training.optim import adamw_with_warmup, check_optimizer_arguments
from lightning_grpo.training.routing import PolicyRouting
from lightning_grpo.training.selection import StepSelection

log = logging.getLogger(__name__)


class GRPOModule(RunLifecycle):
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
        reward_funcs = resolve_reward_models(reward_funcs)  # "owner/name", "./folder": a reward model, as in TRL
        self.rewards = RewardSet.from_specs(reward_funcs, reward_weights, tolerant_reward_funcs,
                                            primary=self.config.primary_reward, accuracy=accuracy_reward,
                                            pool_width=self.config.reward_num_workers)
        self._loaded = loaded = load_lora_policy(model, tokenizer, dtype, gradient_checkpointing, settings)
        self.policy, self.tokenizer, self.model_path = loaded.policy, loaded.tokenizer, loaded.path
        if self.config.disable_dropout:
            disable_dropout(self.policy)
        self._reference = reference_for(loaded, self.config.beta)  # outside the module tree; LoRA: adapters off
        # a mixture-of-experts policy's routing replay and load-balancing loss (after the reference's copy: its
        # routers stay unhooked), None otherwise
        self.routing = PolicyRouting.of(self.config, loaded.base)
        trim_frozen_weights(self, loaded)  # LoRA: checkpoints hold the adapters only
        self.tools = as_tools(tools)  # multi-turn episodes (docs/multiturn.md)
        self.hparams["tools"] = [t.name for t in self.tools]
        # the config's "auto" values as this run resolves them (the config itself never changes)
        budget = self.config.max_tokens_per_microbatch
        self.resolved = ResolvedConfig(resolve_engine_name(self.config.engine.name),
                                       max_tokens_per_microbatch=None if budget == "auto" else budget)
        self._record_resolved()
        stop = StopFlag()  # polled by the engine and the sampler (with tools or an environment: the turn loop)
        path = rollout_path(self.config, self.tokenizer, self.policy, self.tools, environment_factory, tool_parser,
                            stop, processor, self.model_path, agent)
        self.rollout = RolloutWorker(self.config, self.tokenizer, self._emit, prompts=path.prompts,
                                     sampler=path.sampler, stop=stop, images=path.images,
                                     routing=None if self.routing is None else self.routing.recorder)
        self.logprobs = CompletionLogprobs(self.config, vision=loaded.vision)
        self.logprobs.use_routing(self.routing)
        self.teacher = make_teacher(self.config.distillation, self.tokenizer, dtype, self.logprobs)  # or None
        self.experience_maker = ExperienceMaker(self.config, self.rollout, self.rewards, self.logprobs, self._emit,
                                                teacher=self.teacher)
        self.step_selection = StepSelection(self.config, self.logprobs)
        self.step_metrics = StepMetrics(self.config.clip_ratio_c, self.config.tis_cap())
        self.timer = StepTimer()
        self.nonfinite = NonFiniteGuard(self.config.on_nonfinite)
        self.preemption = Preemption(self.rollout.stop)
        self.evaluator = Evaluator(self.config.eval.k)
        self.data_plan = DataPlan()  # what the trainer's datamodule says, read at each setup
        self._events = EventRoute()  # the trainer's GRPOCallbacks, picked at each setup
        self._release_on_exception = ReleaseOnException(self.release)
        self._step_members: list[Experience] = []  # the micro-batches of the step being trained (prepare_step)
        self._step_outputs: deque[ObjectiveOutput] = deque()  # a whole-step backend's outputs not yet logged
        self.backend: ParallelBackend = LocalBackend()  # the trainer's backend from configure_model on
        self._set_models(self.backend.configure(self._models()))  # one process until a trainer's backend
        self.experience_maker.bind(RolloutContext(timer=self.timer, token_budget=self.token_budget))

    def _emit(self, name: str, payload: Any) -> None:
        """Rollout events (:mod:`lightning_grpo.events`) to the ``name`` hook of the trainer's ``GRPOCallback``s."""
        self._events(self, name, payload)

    @property
    def generated_tokens_estimate(self) -> int:
        """Tokens the engine has generated so far, all rollouts (the stop flag's count; the progress bar shows it)."""
        return self.rollout.stop.ticks

    @property
    def ref_model(self) -> Optional[nn.Module]:
        """The frozen reference policy (beta > 0), else None."""
        return self._reference.model

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

    def prefetch_rollout(self, batch: dict[str, list]) -> PrefetchedRollout:
        """Start generating ``batch``'s rollout in the background from the current weights
        (:meth:`lightning_grpo.experience_maker.ExperienceMaker.prefetch`); the loop passes it to
        :meth:`make_experience` later."""
        return self.experience_maker.prefetch(batch, self.policy)

    def wait_for_rollouts(self) -> None:
        """Wait until no rollout is generated in the background (the loop calls it before a checkpoint)."""
        self.experience_maker.wait_for_rollouts()

    def micro_batches(self, experience: Experience, step: Optional[int] = None) -> Iterator[Experience]:
        """The loop's view of one rollout (:func:`lightning_grpo.training.schedule.rollout_micro_batches`), shuffled
        with ``shuffle_seed + step`` (default: the current optimizer step)."""
        return schedule.rollout_micro_batches(experience, self.config, self.global_step if step is None else step,
                                              self.trainer.accumulate_grad_batches, self.backend.data_parallel_size,
                                              self.collectives, self.resolved.max_tokens_per_microbatch)

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
                self._step_outputs.extend(self.backend.train_step(self.policy, self._step_members or [batch],
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

    def prepare_step(self, micro_batches: list[Experience]) -> None:
        """The loop hands each optimizer step's micro-batches forward before its first ``training_step``: the
        whole step's token statistics (:class:`lightning_grpo.training.selection.StepSelection`), so that
        accumulation does not change the gradient. Counts as ``timing/forward_s``."""
        self._step_members = micro_batches
        with self.timer.span("forward_s"):
            self.step_selection.prepare(self.policy, micro_batches, self.collectives, self.global_step)
            if self.routing is not None:  # the load-balancing loss's expert shares of the step
                self.routing.prepare_step(self.policy, micro_batches, lambda mb: self.logprobs(self.policy, mb),
                                          self.collectives)

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
        and entropy, with the step's statistics (:meth:`lightning_grpo.training.selection.StepSelection.objective`,
        which names the errors)."""
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
        ``generated_tokens``, ``train_tokens``."""
        if batch.step_end:  # the loop's batches are experience micro-batches
            self.log_dict(self.timer.step_end(), on_step=True, on_epoch=False, batch_size=1)
        self.preemption.on_micro_batch_end(batch.step_end)  # SIGTERM inside a step waits for its end

    @override
    def configure_optimizers(self) -> Any:
        hp = self.hparams
        return adamw_with_warmup((p for p in self.policy.parameters() if p.requires_grad), hp.learning_rate,
                                 hp.weight_decay, hp.adam_betas, hp.warmup_steps)
