"""How a rollout turns prompts into completions: :class:`PromptEncoder` (prompts -> token ids; with images:
:class:`ImagePromptEncoder`) and :class:`Sampler` (one :class:`EncodedPrompts` record -> a
:class:`~lightning_grpo.protocols.rollout.RolloutOutput`, through a rollout engine).

The :class:`~lightning_grpo.rollout.worker.RolloutWorker` is given one of each when it is made, and every rollout
(training, asynchronous prefetch, evaluation) goes through them:

* single-turn: :class:`~lightning_grpo.rollout.prompts.TemplatePrompts` (the chat template) and
  :class:`~lightning_grpo.rollout.single_turn.SingleTurnSampler` (one ``engine.generate``);
* multi-turn (``GRPOModule(tools=..., environment_factory=...)``): the
  :class:`~lightning_grpo.episodes.turn_loop.EpisodeRunner` is both (the prompts with their tools; the turn loop);
* agents (``GRPOModule(agent=...)``): the :class:`~lightning_grpo.episodes.agents.agent_sampler.AgentSampler` is
  both (the agents behind an OpenAI-compatible gateway write their own prompts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

from lightning_grpo.protocols.engine import RolloutEngine
from lightning_grpo.protocols.rollout import RolloutOutput
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.protocols.vision import RowImages

#: The data-parallel agreement ``any_process(flag) -> bool``: True when ``flag`` is True on any process (a
#: collective: every process calls it together; :meth:`lightning_grpo.protocols.collectives.Collectives.any_process`).
AnyProcess = Callable[[bool], bool]


@dataclass(frozen=True)
class EncodedPrompts:
    """A prompt batch encoded for the engine: what a :class:`Sampler` samples from
    (:meth:`lightning_grpo.rollout.worker.RolloutWorker.encode`).

    Attributes:
        ids: ``B`` token-id lists (no padding), each image's placeholder run expanded.
        images: each prompt's images in the order of their runs (``()``: a prompt without images).
        rows: each prompt's dataset row, every column (an environment's ``reset(**row)``, an agent's row).
        num_truncated: prompts shortened to ``max_prompt_length`` (never through an image).

    Raises:
        ValueError: ``images`` or ``rows`` not one per prompt.
    """

    ids: list[list[int]]
    images: list[RowImages]
    rows: list[dict[str, Any]]
    num_truncated: int = 0

    def __post_init__(self) -> None:
        if len(self.images) != len(self.ids) or len(self.rows) != len(self.ids):
            raise ValueError(f"EncodedPrompts has {len(self.images)} image entries and {len(self.rows)} rows for "
                             f"{len(self.ids)} prompts: one of each per prompt")

    @classmethod
    def of(cls, ids: Sequence[Sequence[int]], rows: Optional[Sequence[Mapping[str, Any]]] = None,
           images: Sequence[RowImages] = (), num_truncated: int = 0) -> "EncodedPrompts":
        """The record of ``ids`` (lists of ints); ``rows`` default one empty row per prompt, ``images`` default none.

        Raises:
            ValueError: as the class.
        """
        listed = [[int(t) for t in p] for p in ids]
        return cls(listed, list(images) or [()] * len(listed),
                   [{} for _ in listed] if rows is None else [dict(r) for r in rows], num_truncated)

    def __len__(self) -> int:
        return len(self.ids)


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


class ImagePromptEncoder(Protocol):
    """Encodes prompts whose chat messages hold images (:class:`lightning_grpo.rollout.image_prompts.ImagePrompts`)."""

    @property
    def placeholder_id(self) -> int:
        """The image placeholder token id."""
        ...

    @property
    def banned_token_ids(self) -> tuple[int, ...]:
        """Token ids the policy may never sample (its image placeholders and vision delimiters: a sampled one breaks
        the image/feature alignment, verl PR #7038); both engines and the trainer remove them from the sampling
        distribution (:class:`~lightning_grpo.protocols.sampling.SamplingConfig`)."""
        ...

    def save_processor(self, folder: str) -> None:
        """Write the image processor into the checkpoint ``folder`` an engine is loaded from (so that it processes
        the pictures as the trainer does)."""
        ...

    def encode_image_prompts(self, prompts: Sequence[Any], max_prompt_length: int) -> EncodedPrompts:
        """The prompts' ids with their images (an empty ``rows`` entry per prompt: the worker adds the dataset rows),
        never truncated through an image.

        Raises:
            ValueError: a prompt that does not fit ``max_prompt_length`` without cutting an image (its index named).
        """
        ...


class Sampler(Protocol):
    """Samples a rollout's completions with an engine: ``num_generations`` rows per prompt, prompt-major."""

    def sample(self, engine: RolloutEngine, prompts: EncodedPrompts, num_generations: int, sampling: SamplingConfig,
               any_process: Optional[AnyProcess] = None) -> RolloutOutput:
        """The ``B * G`` completions of ``B`` encoded prompts.

        Args:
            engine: the rollout engine, awake and synced (it is called through
                :func:`lightning_grpo.protocols.engine.generate`, which passes the prompts' images to an engine that
                declares ``accepts_images``).
            prompts: the prompt batch as one record (:class:`EncodedPrompts`): ``B`` token-id lists
                (:meth:`PromptEncoder.encode_prompts`), each prompt's images (``()``: none) and its dataset row, every
                column (an environment's ``reset(**row)``).
            num_generations: G, completions per prompt.
            sampling: the sampling distribution and the per-request seed base.
            any_process: the processes' agreement, given on the trainer's thread only (None on the prefetch thread,
                and on one process): a sampler whose engine call may be a collective (an engine that
                ``uses_policy_parameters`` under FSDP) agrees with it on how many engine calls every process makes.

        Returns:
            The :class:`~lightning_grpo.protocols.rollout.RolloutOutput` (its ``images`` each row's; its ``columns``
            and ``metrics`` say what the sampler adds for the reward functions and the logs).

        Raises:
            RolloutInterrupted: the stop flag was set while sampling.
            ValueError: images for an engine that does not take them.
        """
        ...
