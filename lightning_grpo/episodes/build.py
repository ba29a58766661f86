"""The rollout path of a run (:class:`~lightning_grpo.protocols.sampler.PromptEncoder` and
:class:`~lightning_grpo.protocols.sampler.Sampler`), from ``GRPOModule``'s ``agent``, ``tools``,
``environment_factory`` and ``tool_parser``: the agent gateway with an agent, the turn loop with tools or an
environment, the single-turn path without."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

from lightning_grpo.config import GRPOConfig
from lightning_grpo.episodes.agents.agent_sampler import AgentFn, AgentRollout, AgentSampler
from lightning_grpo.episodes.chat import ChatFormat
from lightning_grpo.episodes.environment import EnvironmentFactory, ToolEnvironment
from lightning_grpo.episodes.parsers import HermesToolCallParser, ToolCallParser
from lightning_grpo.episodes.tools import Tool
from lightning_grpo.episodes.turn_loop import EpisodeRunner
from lightning_grpo.protocols.rollout import StopFlag, eos_token_ids_from
from lightning_grpo.protocols.sampler import PromptEncoder, Sampler
from lightning_grpo.protocols.vision import vision_spec
from lightning_grpo.rollout.image_prompts import ImagePrompts, image_prompts
from lightning_grpo.rollout.prompts import TemplatePrompts
from lightning_grpo.rollout.single_turn import SingleTurnSampler


def episode_runner(config: GRPOConfig, tokenizer: Any, eos_token_ids: Sequence[int], tools: Sequence[Tool],
                   environment_factory: Optional[EnvironmentFactory], parser: Optional[ToolCallParser],
                   stop: StopFlag) -> Optional[EpisodeRunner]:
    """The :class:`EpisodeRunner` of a run, or None (single-turn) without tools and environment.

    With ``tools`` alone each episode gets a :class:`ToolEnvironment` of them (``parser``, default
    :class:`HermesToolCallParser`; ``episode.tool_timeout_s``). With ``environment_factory`` each episode gets
    ``environment_factory()``; ``tools`` are then only described in the prompt (the environment runs them, e.g. as a
    :class:`ToolEnvironment` subclass).

    Raises:
        ValueError: the tokenizer has no chat template; ``parser`` without tools or environment.
    """
    if not tools and environment_factory is None:
        if parser is not None:
            raise ValueError("GRPOModule(tool_parser=...) needs tools or an environment_factory")
        return None
    parser = parser or HermesToolCallParser()
    episode = config.episode
    if environment_factory is None:
        environment_factory = functools.partial(ToolEnvironment, list(tools), parser, episode.tool_timeout_s)
    chat = ChatFormat(tokenizer, eos_token_ids, [t.schema for t in tools], parser)
    return EpisodeRunner(chat, environment_factory, episode.max_turns, episode.max_tokens, episode.env_workers, stop)


@dataclass(frozen=True)
class RolloutPath:
    """A run's rollout path, what ``GRPOModule`` gives its :class:`~lightning_grpo.rollout.worker.RolloutWorker`.

    Attributes:
        prompts: how prompts become token ids.
        sampler: how token ids become a rollout.
        images: a vision-language policy's prompt encoding with images (:class:`ImagePrompts`, also ``prompts``),
            declared here so that nothing asks the encoder what it is; None for a causal LM.
    """

    prompts: PromptEncoder
    sampler: Sampler
    images: Optional[ImagePrompts] = None


def agent_sampler(config: GRPOConfig, tokenizer: Any, eos_token_ids: Sequence[int],
                  agent: Union[AgentFn, AgentRollout], stop: StopFlag) -> AgentSampler:
    """The :class:`~lightning_grpo.episodes.agents.agent_sampler.AgentSampler` of ``GRPOModule(agent=...)`` (a plain
    function gets :class:`AgentRollout`'s defaults), limited by ``config.episode`` and ``config.max_prompt_length``."""
    settings = agent if isinstance(agent, AgentRollout) else AgentRollout(agent)
    return AgentSampler(settings, tokenizer, eos_token_ids, max_turns=config.episode.max_turns,
                        max_tokens=config.episode.max_tokens, max_prompt_length=config.max_prompt_length, stop=stop)


def rollout_path(config: GRPOConfig, tokenizer: Any, policy: Any, tools: Sequence[Tool],
                 environment_factory: Optional[EnvironmentFactory], parser: Optional[ToolCallParser],
                 stop: StopFlag, processor: Any = None, model_path: Optional[str] = None,
                 agent: Union[AgentFn, AgentRollout, None] = None) -> RolloutPath:
    """The prompt encoding and the sampler of a run's rollouts: the :func:`agent_sampler`, both, with an agent; the
    :func:`episode_runner`, both, with tools or an environment (a model turn ends at the EOS ids of ``policy``'s
    ``generation_config`` and the tokenizer); else the single-turn ones
    (:class:`~lightning_grpo.rollout.prompts.TemplatePrompts`,
    :class:`~lightning_grpo.rollout.single_turn.SingleTurnSampler`). A vision-language ``policy``'s prompts go through
    :class:`~lightning_grpo.rollout.image_prompts.ImagePrompts` around them (``processor``: its image processor or
    folder, default ``model_path``'s; the episode runner shows observations' images with it too).

    Raises:
        ValueError: an agent with tools, an environment or a ``tool_parser`` (an agent runs its own tools; its
            parser is ``AgentRollout(tool_parser=...)``), or with a vision-language policy (the agent gateway serves
            text, and would not keep the image placeholders out of the sampled tokens), or with routing replay "R3"
            (its episodes carry no routed experts); else as
            :func:`episode_runner` and :func:`~lightning_grpo.rollout.image_prompts.image_prompts`.
    """
    eos_token_ids = eos_token_ids_from(getattr(policy, "generation_config", None), tokenizer)
    if agent is not None:
        if tools or environment_factory is not None or parser is not None:
            raise ValueError("GRPOModule(agent=...) runs the agent's own tools: leave tools, environment_factory and "
                             "tool_parser unset (the model's tool-call format is AgentRollout(tool_parser=...))")
        if processor is not None or vision_spec(policy.config) is not None:
            raise ValueError("GRPOModule(agent=...) trains text policies: the agent gateway serves text, so a "
                             "vision-language policy (or processor=...) is not supported with an agent")
        if config.routing_replay == "R3":
            raise ValueError("GRPOConfig.routing_replay='R3' is not supported with GRPOModule(agent=...): the agent "
                             "gateway's episodes do not carry the routed experts; use routing_replay='R2' or 'off'")
        sampler = agent_sampler(config, tokenizer, eos_token_ids, agent, stop)
        return RolloutPath(sampler, sampler)
    runner = episode_runner(config, tokenizer, eos_token_ids, tools, environment_factory, parser, stop)
    text: PromptEncoder = TemplatePrompts(tokenizer) if runner is None else runner
    sampler: Sampler = SingleTurnSampler() if runner is None else runner
    images = image_prompts(text, tokenizer, policy, processor, model_path)
    if images is None:
        return RolloutPath(text, sampler)
    if runner is not None:
        runner.images = images
    return RolloutPath(images, sampler, images)
