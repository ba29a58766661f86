"""Prompts with images (vision-language models): chat messages whose parts hold images -> token ids with each image's
placeholder run expanded, and the processed images (an
:class:`~lightning_grpo.protocols.sampler.ImagePromptEncoder`).

A prompt is a list of chat messages whose ``content`` may be a list of parts (``{"type": "text", "text": ...}`` and
``{"type": "image", "image": <PIL image>}``, TRL's format). The chat template writes each image part as the
family's placeholder (one ``<|image_pad|>`` between ``<|vision_start|>`` and ``<|vision_end|>``, or ``<image>``),
through the text encoder it wraps (single-turn: :class:`~lightning_grpo.rollout.prompts.TemplatePrompts`; multi-turn:
the prompts with their tools); each placeholder is then expanded to the image's ``num_tokens``, as the model's
processor does (:func:`lightning_grpo.models.vision_loading.process_image`). A prompt longer than ``max_prompt_length``
loses its oldest tokens only when no image token is among them; else it is refused (never truncated through an image).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, Optional, Sequence

from transformers import PreTrainedTokenizerBase

from lightning_grpo.models.vision_loading import load_image_processor, process_image
from lightning_grpo.protocols.sampler import EncodedPrompts, PromptEncoder
from lightning_grpo.protocols.vision import PromptImage, RowImages, VisionSpec, count_tokens, vision_spec
from lightning_grpo.rollout.prompts import adds_bos


def split_images(prompt: Any, where: str) -> tuple[Any, list[Any]]:
    """A prompt's messages with every image part reduced to ``{"type": "image"}``, and the images in order.

    Raises:
        ValueError: an image part without its image.
    """
    if isinstance(prompt, str) or not isinstance(prompt, Sequence):
        return prompt, []
    images: list[Any] = []
    messages = []
    for m, message in enumerate(prompt):
        content = message.get("content") if isinstance(message, Mapping) else None
        if not isinstance(content, list):
            messages.append(message)
            continue
        parts = []
        for p, part in enumerate(content):
            if isinstance(part, Mapping) and part.get("type") == "image":
                image = part.get("image")
                if image is None:
                    raise ValueError(f"{where}: message {m} part {p} is an image part without its image "
                                     "(PromptDataModule(image_field=...) puts the images into the parts)")
                images.append(image)
                parts.append({"type": "image"})
            else:
                parts.append(part)
        messages.append({**message, "content": parts})
    return messages, images


_PICTURE_KEY = "__picture_rgb__"


def pictures_state(value: Any) -> Any:
    """``value`` (a prompt batch: dicts, lists, strings, numbers) with every PIL image replaced by plain data (its RGB
    pixels as a ``(H, W, 3)`` uint8 tensor), for a checkpoint that loads with ``torch.load(weights_only=True)``."""
    from PIL import Image

    if isinstance(value, Image.Image):
        import numpy as np
        import torch

        return {_PICTURE_KEY: torch.from_numpy(np.array(value.convert("RGB")))}
    if isinstance(value, Mapping):
        return {k: pictures_state(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(pictures_state(v) for v in value)
    return value


def pictures_from_state(value: Any) -> Any:
    """The value :func:`pictures_state` saved, its images PIL images again (RGB, the same pixels)."""
    if isinstance(value, Mapping):
        if set(value) == {_PICTURE_KEY}:
            from PIL import Image

            return Image.fromarray(value[_PICTURE_KEY].numpy(), mode="RGB")
        return {k: pictures_from_state(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(pictures_from_state(v) for v in value)
    return value


class ImagePrompts:
    """The prompt encoding of a vision-language policy (an
    :class:`~lightning_grpo.protocols.sampler.ImagePromptEncoder` and a
    :class:`~lightning_grpo.protocols.sampler.PromptEncoder`).

    Args:
        text: the text encoder writing the chat template (its placeholders collapsed, one per image).
        tokenizer: the policy's tokenizer (the BOS rule of truncation).
        processor: the checkpoint's image processor (:func:`lightning_grpo.models.vision_loading.load_image_processor`).
        spec: the checkpoint's image facts (:func:`lightning_grpo.protocols.vision.vision_spec`).
        model_config: the checkpoint's config (LLaVA's vision tower size).
    """

    def __init__(self, text: PromptEncoder, tokenizer: PreTrainedTokenizerBase, processor: Any, spec: VisionSpec,
                 model_config: Any) -> None:
        self.text = text
        self.tokenizer = tokenizer
        self.processor = processor
        self.spec = spec
        self.model_config = model_config

    @property
    def placeholder_id(self) -> int:
        """The image placeholder token id."""
        return self.spec.placeholder_id

    @property
    def banned_token_ids(self) -> tuple[int, ...]:
        """The placeholder and vision delimiter ids, never sampled."""
        return self.spec.banned_token_ids

    def save_processor(self, folder: str) -> None:
        """The image processor's ``save_pretrained(folder)`` (an engine checkpoint of a policy given as a module)."""
        self.processor.save_pretrained(folder)

    def process(self, image: Any) -> PromptImage:
        """One image as the model takes it (:func:`lightning_grpo.models.vision_loading.process_image`)."""
        return process_image(image, self.processor, self.spec, self.model_config)

    def expand(self, ids: Sequence[int], images: Sequence[PromptImage], where: str) -> list[int]:
        """``ids`` with its k-th placeholder token repeated ``images[k].num_tokens`` times.

        Raises:
            ValueError: the number of placeholders is not the number of images (``where`` names the prompt).
        """
        placeholders = count_tokens(ids, [self.placeholder_id])
        if placeholders != len(images):
            raise ValueError(f"{where} has {len(images)} image(s), but its chat template wrote {placeholders} image "
                             f"placeholder(s) (id {self.placeholder_id}): does the template write image parts?")
        out: list[int] = []
        k = 0
        for token in ids:
            if int(token) == self.placeholder_id:
                out.extend([self.placeholder_id] * images[k].num_tokens)
                k += 1
            else:
                out.append(int(token))
        return out

    def encode_prompts(self, prompts: Sequence[Any], max_prompt_length: int) -> tuple[list[list[int]], int]:
        """:meth:`encode_image_prompts` without the images: ``(ids, num_truncated)``."""
        encoded = self.encode_image_prompts(prompts, max_prompt_length)
        return encoded.ids, encoded.num_truncated

    def encode_image_prompts(self, prompts: Sequence[Any], max_prompt_length: int) -> EncodedPrompts:
        """The prompts' ids (placeholders expanded) and images.

        Raises:
            ValueError: ``max_prompt_length < 1``; a prompt whose image placeholders do not match its images; a
                prompt over ``max_prompt_length`` whose truncation would cut an image (its index, length and
                limit named: filter such prompts in the data, ``PromptDataModule(max_prompt_length=...)``).
        """
        if max_prompt_length < 1:
            raise ValueError(f"max_prompt_length={max_prompt_length} must be >= 1")
        split = [split_images(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
        collapsed, _ = self.text.encode_prompts([messages for messages, _ in split], sys.maxsize)
        with_bos = adds_bos(self.tokenizer)
        ids_out: list[list[int]] = []
        images_out: list[RowImages] = []
        truncated = 0
        for i, ((_, raw), ids) in enumerate(zip(split, collapsed, strict=True)):
            images = tuple(self.process(image) for image in raw)
            expanded = self.expand(ids, images, f"prompts[{i}]") if images else list(ids)
            if len(expanded) > max_prompt_length:
                keep = 1 if with_bos and max_prompt_length >= 2 else 0
                cut = expanded[keep:len(expanded) - (max_prompt_length - keep)]
                if count_tokens(cut, self.banned_token_ids):
                    raise ValueError(
                        f"prompts[{i}] has {len(expanded)} tokens with its {len(images)} image(s), over "
                        f"max_prompt_length={max_prompt_length}, and truncating it would cut an image: raise "
                        "max_prompt_length, lower the processor's max_pixels, or drop such prompts in the data "
                        "(PromptDataModule(max_prompt_length=..., tokenizer=<the model folder>))")
                expanded = expanded[:keep] + expanded[len(expanded) - (max_prompt_length - keep):]
                truncated += 1
            ids_out.append(expanded)
            images_out.append(images)
        return EncodedPrompts.of(ids_out, images=images_out, num_truncated=truncated)


def image_prompts(text: PromptEncoder, tokenizer: PreTrainedTokenizerBase, policy: Any, processor: Any = None,
                  model_path: Optional[str] = None) -> Optional[ImagePrompts]:
    """The :class:`ImagePrompts` of a vision-language ``policy`` around the text encoder ``text``, or None for a
    causal LM.

    Args:
        text, tokenizer: the run's text prompt encoding and tokenizer.
        policy: the policy (a transformers model, or a PEFT model of one: its ``config`` is the model's).
        processor: the image processor, or the folder holding it; None: ``model_path``'s
            (:func:`lightning_grpo.models.vision_loading.load_image_processor`).
        model_path: the policy's folder.

    Raises:
        ValueError: an image processor for a model without images, or a vision-language model without one.
    """
    config = policy.config  # a PEFT policy's is its transformers model's
    spec = vision_spec(config)
    if spec is None:
        if processor is not None:
            raise ValueError(f"GRPOModule(processor=...) was given, but the policy ({config.model_type}) is not a "
                             "vision-language model")
        return None
    if processor is None or isinstance(processor, str):
        source = processor or model_path
        if source is None:
            raise ValueError(f"the policy is a vision-language model ({spec.model_type}) given as a module: pass its "
                             "image processor, GRPOModule(processor=<processor or folder>)")
        processor = load_image_processor(source)
    return ImagePrompts(text, tokenizer, processor, spec, config)
