"""What a :class:`~lightning_grpo.module.GRPOModule` is made of, built once from its arguments
(:meth:`GRPOComponents.build`, in the shape of torchtitan's ``config.build()``): the reward set, the loaded policy and
its frozen reference, the tools, the resolved "auto" values, the rollout worker on the run's rollout path, the
logprob computer, the distillation teacher, the experience maker, and the training step's helpers (step selection,
step metrics, the step timer, the non-finite guard, preemption, the evaluator). The module only wires them to
Lightning's hooks."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

from torch import nn
from transformers import PreTrainedTokenizerBase

from lightning_grpo.config import GRPOConfig, ResolvedConfig
from lightning_grpo.distillation.make import make_teacher
from lightning_grpo.episodes import AgentFn, AgentRollout, ToolCallParser, as_tools, rollout_path
from lightning_grpo.episodes.environment import EnvironmentFactory
from lightning_grpo.episodes.tools import Tool, ToolSpec
from lightning_grpo.evaluation.evaluator import Evaluator
from lightning_grpo.events import EventSink
from lightning_grpo.experience import ExperienceMaker, RolloutContext
from lightning_grpo.models.dropout import disable_dropout
from lightning_grpo.models.loading import FrozenReference
from lightning_grpo.models.lora import LoadedPolicy, LoraSettings, engine_checkpoint, load_lora_policy, reference_for
from lightning_grpo.protocols import StopFlag
from lightning_grpo.protocols.teacher import Teacher
from lightning_grpo.rewards import RewardSet, RewardSpec
from lightning_grpo.rewards.reward_model import resolve_reward_models
from lightning_grpo.rollout.engine_registry import resolve_engine_name
from lightning_grpo.rollout.worker import RolloutWorker
from lightning_grpo.runtime.preemption import Preemption
from lightning_grpo.training.logprobs import CompletionLogprobs
from lightning_grpo.training.metrics import StepMetrics, StepTimer
from lightning_grpo.training.nonfinite import NonFiniteGuard
from lightning_grpo.training.routing_replay import PolicyRouting
from lightning_grpo.training.selection import StepSelection


@dataclass(frozen=True)
class GRPOComponents:
    """The components of one ``GRPOModule``, each owning one concern (docs/architecture.md).

    Attributes:
        rewards: the reward functions, weights, tolerant and accuracy functions (a ``RewardSet``).
        loaded: the loaded policy and what it is (:class:`~lightning_grpo.models.lora.LoadedPolicy`).
        reference: the frozen KL reference (``beta > 0``; LoRA: the adapters off), outside the module tree.
        tools: multi-turn tools (:func:`~lightning_grpo.episodes.as_tools`).
        resolved: the config's "auto" values as far as known when the module is made (engine name, token budget).
        rollout: the rollout worker on the run's rollout path (:func:`~lightning_grpo.episodes.rollout_path`).
        engine_checkpoint: the folder an engine with its own weights is loaded from
            (:func:`~lightning_grpo.models.lora.engine_checkpoint`: saved on first use for a module given without
            one, a vision-language policy's image processor with it).
        logprobs: the completion-logprob computer (the vision-language layouts included).
        teacher: on-policy distillation's teacher (:func:`~lightning_grpo.rollout.teacher.make_teacher`), or None.
        experience_maker: generate -> score -> shape -> logprobs -> advantages (single-process context bound).
        step_selection, step_metrics, timer, nonfinite, preemption, evaluator: the training step's helpers.
        routing: a mixture-of-experts policy's routing replay and load-balancing loss
            (:class:`~lightning_grpo.training.routing_replay.PolicyRouting`), or None.
    """

    rewards: RewardSet
    loaded: LoadedPolicy
    reference: FrozenReference
    tools: list[Tool]
    resolved: ResolvedConfig
    rollout: RolloutWorker
    engine_checkpoint: Callable[[], str]
    logprobs: CompletionLogprobs
    teacher: Optional[Teacher]
    experience_maker: ExperienceMaker
    step_selection: StepSelection
    step_metrics: StepMetrics
    timer: StepTimer
    nonfinite: NonFiniteGuard
    preemption: Preemption
    evaluator: Evaluator
    routing: Optional[PolicyRouting] = None

    @classmethod
    def build(
        cls,
        config: GRPOConfig,
        settings: LoraSettings,
        events: EventSink,
        *,
        model: Union[str, nn.Module, None],
        tokenizer: Union[str, PreTrainedTokenizerBase, None],
        reward_funcs: Sequence[RewardSpec],
        reward_weights: Optional[Sequence[float]],
        accuracy_reward: Optional[RewardSpec],
        tolerant_reward_funcs: Sequence[str],
        dtype: str,
        gradient_checkpointing: Union[bool, str],
        tools: Sequence[ToolSpec],
        environment_factory: Optional[EnvironmentFactory],
        tool_parser: Optional[ToolCallParser],
        processor: Any,
        agent: Union[AgentRollout, AgentFn, None],
    ) -> GRPOComponents:
        """Build the components from ``GRPOModule``'s arguments (documented there), in this order: the reward set
        (reward-model specs loaded, as in TRL), the policy (LoRA: adapted; dropout disabled if the config says so),
        its reference, the tools, the resolved values, the rollout path and worker (``events``: the module's event
        sink), the logprob computer, the teacher and the rest.

        Raises:
            ValueError: a bad argument (named in the message), as the builders named above.
        """
        rewards = RewardSet.from_specs(resolve_reward_models(reward_funcs), reward_weights, tolerant_reward_funcs,
                                       primary=config.primary_reward, accuracy=accuracy_reward,
                                       pool_width=config.reward_num_workers)
        loaded = load_lora_policy(model, tokenizer, dtype, gradient_checkpointing, settings)
        if config.disable_dropout:
            disable_dropout(loaded.policy)
        reference = reference_for(loaded, config.beta)  # outside the module tree; LoRA: adapters off
        # a mixture-of-experts policy's routing replay and load-balancing loss (after the reference's copy: its
        # routers stay unhooked), None otherwise
        routing = PolicyRouting.of(config, loaded.base)
        budget = config.max_tokens_per_microbatch
        resolved = ResolvedConfig(resolve_engine_name(config.engine.name),
                                  max_tokens_per_microbatch=None if budget == "auto" else budget)
        built_tools = as_tools(tools)  # multi-turn episodes (docs/multiturn.md)
        if config.streaming.enabled and (built_tools or environment_factory is not None or agent is not None):
            raise ValueError("GRPOConfig.streaming.enabled=True samples single-turn groups; multi-turn episodes "
                             "(tools, environment_factory) and agents run on the fixed schedule (max_staleness), "
                             "whose rollouts carry each token's weight version too")
        stop = StopFlag()  # polled by the engine and the sampler (with tools or an environment: the turn loop)
        path = rollout_path(config, loaded.tokenizer, loaded.policy, built_tools, environment_factory, tool_parser,
                            stop, processor, loaded.path, agent)
        rollout = RolloutWorker(config, loaded.tokenizer, events, prompts=path.prompts, sampler=path.sampler,
                                stop=stop, images=path.images, routing=None if routing is None else routing.recorder)
        processor_saver = None if path.images is None else path.images.save_processor
        checkpoint = functools.partial(engine_checkpoint, loaded, processor_saver)
        logprobs = CompletionLogprobs(config, vision=loaded.vision)
        logprobs.use_routing(routing)
        teacher = make_teacher(config.distillation, loaded.tokenizer, dtype, logprobs)  # or None
        maker = ExperienceMaker(config, rollout, rewards, logprobs, events, teacher=teacher)
        timer = StepTimer()
        maker.bind(RolloutContext(timer=timer, token_budget=resolved.max_tokens_per_microbatch))
        return cls(rewards, loaded, reference, built_tools, resolved, rollout, checkpoint, logprobs, teacher, maker,
                   StepSelection(config, logprobs), StepMetrics(config.clip_ratio_c, config.tis_cap()), timer,
                   NonFiniteGuard(config.on_nonfinite), Preemption(rollout.stop), Evaluator(config.eval.k), routing)
