"""How a rollout turns prompts into completions: :class:`PromptEncoder` (prompts -> token ids) and :class:`Sampler`
(token ids -> a :class:`~lightning_grpo.protocols.rollout.RolloutOutput`, through a rollout engine).

The :class:`~lightning_grpo.rollout.worker.RolloutWorker` is given one of each when it is made, and every rollout
(training, asynchronous prefetch, evaluation) goes through them:

* single-turn: :class:`~lightning_grpo.rollout.prompts.TemplatePrompts` (the chat template) and
  :class:`~lightning_grpo.rollout.single_turn.SingleTurnSampler` (one ``engine.generate``);
* multi-turn (``GRPOModule(tools=..., environment_factory=...)``): the
  :class:`~lightning_grpo.episodes.runner.EpisodeRunner` is both (the prompts with their tools; the turn loop);
* agents (``GRPOModule(agent=...)``): the :class:`~lightning_grpo.episodes.agents.agent_sampler.AgentSampler` is
  both (the agents behind an OpenAI-compatible gateway write their own prompts).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

from lightning_grpo.protocols.engine import RolloutEngine
from lightning_grpo.protocols.rollout import RolloutOutput
from lightning_grpo.protocols.sampling import SamplingConfig

#: The data-parallel agreement ``any_process(flag) -> bool``: True when ``flag`` is True on any process (a
#: collective: every process calls it together; :meth:`lightning_grpo.protocols.collectives.Collectives.any_process`).
AnyProcess = Callable[[bool], bool]


class PromptEncoder(Protocol):
    """Encodes a prompt batch's prompts for the engine."""

    def encode_prompts(self, prompts: Sequence[Any], max_prompt_length: int) -> tuple[list[list[int]], int]:
        """The prompts' token ids (no padding), each left-truncated to ``max_prompt_length``.

        Args:
            prompts: the batch's "prompt" column: chat-message lists or strings.
            max_prompt_length: most tokens per prompt (``GRPOConfig.max_prompt_length``).

        Returns:
            ``(ids, num_truncated)``: one id list per prompt, and how many prompts were truncated.

        Raises:
            ValueError, TypeError: a prompt it cannot encode (its index named).
        """
        ...


class Sampler(Protocol):
    """Samples a rollout's completions with an engine: ``num_generations`` rows per prompt, prompt-major."""

    def sample(self, engine: RolloutEngine, prompt_ids: Sequence[Sequence[int]], num_generations: int,
               sampling: SamplingConfig, rows: Sequence[Mapping[str, Any]],
               any_process: Optional[AnyProcess] = None) -> RolloutOutput:
        """The ``B * G`` completions of ``B`` prompts. A sampler of vision-language prompts also takes
        ``images=`` (each prompt's :data:`~lightning_grpo.protocols.images.RowImages`, passed only when a prompt has
        images: a sampler without the argument is refused images by the worker's call) and returns each row's in
        the output's ``images``.

        Args:
            engine: the rollout engine, awake and synced (its ``generate`` is the only way to sample).
            prompt_ids: ``B`` token-id lists (:meth:`PromptEncoder.encode_prompts`).
            num_generations: G, completions per prompt.
            sampling: the sampling distribution and the per-request seed base.
            rows: the prompt batch as one dict per prompt, every column (an environment's ``reset(**row)``).
            any_process: the processes' agreement, given on the trainer's thread only (None on the prefetch thread,
                and on one process): a sampler whose engine call may be a collective (an engine that
                ``uses_policy_parameters`` under FSDP) agrees with it on how many engine calls every process makes.

        Returns:
            The :class:`~lightning_grpo.protocols.rollout.RolloutOutput` (its ``columns`` and ``metrics`` say what
            the sampler adds for the reward functions and the logs).

        Raises:
            RolloutInterrupted: the stop flag was set while sampling.
        """
        ...
