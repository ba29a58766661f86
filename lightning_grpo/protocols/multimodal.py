"""The protocol of images in prompts (vision-language models): the encoder that turns prompts with images into token
ids and processed images (:class:`ImagePromptEncoder`; the engines that take them:
:class:`~lightning_grpo.protocols.engine.ImageRolloutEngine`; docs/vision.md)."""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from lightning_grpo.protocols.images import EncodedPrompts


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
        """The prompts' ids with their images (``rows`` left empty: the worker adds the dataset rows), never
        truncated through an image.

        Raises:
            ValueError: a prompt that does not fit ``max_prompt_length`` without cutting an image (its index named).
        """
        ...
