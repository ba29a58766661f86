"""The protocols of images in prompts (vision-language models): the encoder that turns prompts with images into token
ids and processed images (:class:`ImagePromptEncoder`), the engines that take them (:class:`ImageRolloutEngine`), and
:func:`generate`, which calls an engine with images only when there are some (docs/vision.md)."""

from __future__ import annotations

from typing import Any, Optional, Protocol, Sequence

from lightning_grpo.protocols.images import EncodedPrompts, RowImages
from lightning_grpo.protocols.rollout import RolloutOutput
from lightning_grpo.protocols.sampling import SamplingConfig


class ImagePromptEncoder(Protocol):
    """Encodes prompts whose chat messages hold images (:class:`lightning_grpo.rollout.images.ImagePrompts`)."""

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
        """The prompts' ids with their images, never truncated through an image.

        Raises:
            ValueError: a prompt that does not fit ``max_prompt_length`` without cutting an image (its index named).
        """
        ...


class ImageRolloutEngine(Protocol):
    """A rollout engine that takes images with its prompts (HF ``generate`` on a vision-language policy, colocated
    vLLM, the rollout servers); ``accepts_images`` False: it would drop them, so image prompts are refused."""

    @property
    def accepts_images(self) -> bool:
        """Whether ``generate(..., images=...)`` feeds the images to the model."""
        ...

    def generate(self, prompt_ids: Sequence[Sequence[int]], num_generations: int, sampling: SamplingConfig,
                 images: Optional[Sequence[Optional[RowImages]]] = None) -> RolloutOutput:
        """As :meth:`~lightning_grpo.protocols.engine.RolloutEngine.generate`; ``images[i]``: prompt i's images
        (its ids hold their expanded placeholder runs). The output's ``images`` are each row's."""
        ...


def has_images(images: Optional[Sequence[Optional[RowImages]]]) -> bool:
    """Whether any prompt of ``images`` has an image."""
    return images is not None and any(row for row in images)


def generate(engine: Any, prompt_ids: Sequence[Sequence[int]], num_generations: int, sampling: SamplingConfig,
             images: Optional[Sequence[Optional[RowImages]]] = None, accepts: Optional[bool] = None) -> RolloutOutput:
    """``engine.generate(prompt_ids, num_generations, sampling)``, with ``images=`` when a prompt has images (an
    engine without images keeps its three-argument ``generate``).

    Args:
        engine: a rollout engine; with images, one that declares ``accepts_images``
            (:class:`ImageRolloutEngine`: the built-in engines, the backends' wrappers of them, and a user engine
            as the rollout worker adapted it, :func:`lightning_grpo.rollout.adapter.as_rollout_engine`).
        accepts: whether ``engine`` takes images, when the caller read it already (the adapter of a user engine,
            from what it declared); default ``engine.accepts_images``.

    Raises:
        ValueError: images for an engine that does not take them (it would drop them), or not one entry per prompt.
    """
    if not has_images(images):
        return engine.generate(prompt_ids, num_generations, sampling)
    assert images is not None
    if len(images) != len(prompt_ids):
        raise ValueError(f"{len(images)} image entries for {len(prompt_ids)} prompts: one per prompt (None: no image)")
    if not (engine.accepts_images if accepts is None else accepts):
        raise ValueError(f"the rollout engine {type(engine).__name__} does not take images, but the prompts have "
                         "images: use engine.name='hf', 'vllm' or 'vllm_server' with a vision-language model")
    return engine.generate(prompt_ids, num_generations, sampling, images=images)
