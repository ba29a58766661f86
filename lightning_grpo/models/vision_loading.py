"""Vision-language policies: which checkpoints are ones and their image facts (:mod:`lightning_grpo.protocols.vision`:
``VISION_FAMILIES``, ``VisionSpec``, ``vision_spec``, which the engines read too), loading them with
their image processor, turning one image into the model's inputs (:func:`process_image`) and LoRA on their language
model only (:func:`language_model_lora`). docs/vision.md.

Families (``config.model_type``):

* ``qwen2_vl``, ``qwen2_5_vl``, ``qwen3_vl``: an image is resized so both sides are multiples of
  ``patch_size * merge_size`` within the processor's ``[min_pixels, max_pixels]`` (its ``smart_resize``), cut into
  ``t x h x w`` patches and becomes ``t*h*w / merge_size**2`` ``<|image_pad|>`` tokens between ``<|vision_start|>``
  and ``<|vision_end|>``; positions are 3-D (mRoPE, Qwen2-VL report, arXiv:2409.12191 sec. 2.1:
  :func:`lightning_grpo.training.vision_layouts.mrope_positions`).
* ``llava``: the processor resizes and crops to the vision tower's square input; an image becomes
  ``(image_size / patch_size)**2`` ``<image>`` tokens (plus one with ``vision_feature_select_strategy="full"``);
  positions are 1-D.

The image processors are transformers' PIL ones (``backend="pil"``), which need no torchvision.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from lightning_grpo.protocols.vision import PromptImage, VisionSpec, vision_spec

if TYPE_CHECKING:
    from peft import LoraConfig
    from torch import nn

#: Module-name pieces of the vision tower and projector of every family: LoRA adapts the language model only.
VISION_MODULE_PATTERN = r".*(visual|vision_tower|vision_model|multi_modal_projector|merger).*"


def is_vision_checkpoint(path: str) -> bool:
    """Whether the model folder or hub id ``path`` holds a vision-language checkpoint (its ``config.json``)."""
    from transformers import AutoConfig

    return vision_spec(AutoConfig.from_pretrained(path)) is not None


def load_vision_policy(path: str, dtype: torch.dtype, quantization_config: Any = None) -> nn.Module:
    """The vision-language model at ``path`` (``AutoModelForImageTextToText``), in train mode."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype, quantization_config=quantization_config)
    return model.train()


def load_image_processor(path: str) -> Any:
    """The image processor saved with the checkpoint at ``path``, transformers' PIL backend (no torchvision).

    Raises:
        ValueError: ``path`` has no image processor (``preprocessor_config.json`` / ``processor_config.json``).
    """
    from transformers import AutoImageProcessor

    try:
        return AutoImageProcessor.from_pretrained(path, backend="pil")
    except (OSError, ValueError) as err:
        raise ValueError(f"{path!r} holds no image processor (preprocessor_config.json): a vision-language model "
                         f"needs its processor saved beside it: {err}") from err


def _rgb(image: Any) -> Any:
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise TypeError(f"an image must be a PIL image here, got {type(image).__name__} (PromptDataModule decodes "
                        "paths and bytes)")
    return image if image.mode == "RGB" else image.convert("RGB")


def qwen_size(processor: Any, height: int, width: int) -> tuple[int, int]:
    """``(height, width)`` a Qwen-VL processor resizes an image to (its ``smart_resize``: multiples of
    ``patch_size * merge_size``, ``min_pixels <= h * w <= max_pixels``, aspect ratio kept as closely as possible).

    Raises:
        ValueError: an aspect ratio over 200 (the processor's limit).
    """
    factor = int(processor.patch_size) * int(processor.merge_size)
    size = processor.size
    min_pixels, max_pixels = int(size["shortest_edge"]), int(size["longest_edge"])
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"an image of {width}x{height} pixels has an aspect ratio over 200, which Qwen-VL refuses")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = max(factor, math.floor(height / beta / factor) * factor), max(factor, math.floor(width / beta / factor)
                                                                              * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h, w


def process_image(image: Any, processor: Any, spec: VisionSpec, model_config: Any) -> PromptImage:
    """One image (a PIL image) as the model takes it: resized within the processor's limits, its tensors and the
    placeholder tokens it becomes.

    Qwen-VL: the picture is resized here to the processor's size (bicubic, as the processor), so every engine's
    processor sees the same pixels. LLaVA: the processor resizes and crops.

    Raises:
        TypeError: not a PIL image.
        ValueError: the processor's output does not have the family's shape.
    """
    picture = _rgb(image)
    if spec.family == "qwen_vl":
        from PIL import Image

        height, width = qwen_size(processor, picture.height, picture.width)
        if (picture.height, picture.width) != (height, width):
            picture = picture.resize((width, height), resample=Image.Resampling.BICUBIC)
        out = processor(images=[picture], return_tensors="pt")
        grid = out["image_grid_thw"]
        if grid.shape != (1, 3):
            raise ValueError(f"the image processor returned image_grid_thw of shape {tuple(grid.shape)}, not (1, 3)")
        t, h, w = (int(v) for v in grid[0])
        tokens = t * h * w // (spec.merge_size ** 2)
        tensors = {"pixel_values": out["pixel_values"], "image_grid_thw": grid.long()}
        return PromptImage(tensors, tokens, (t, h, w), picture)
    out = processor(images=[picture], return_tensors="pt")
    pixels = out["pixel_values"]
    vision = model_config.vision_config
    if pixels.dim() != 4 or pixels.shape[0] != 1:
        raise ValueError(f"the image processor returned pixel_values of shape {tuple(pixels.shape)}, not (1, C, H, W)")
    per_side = int(vision.image_size) // int(vision.patch_size)
    extra = 1 if getattr(model_config, "vision_feature_select_strategy", "default") == "full" else 0
    return PromptImage({"pixel_values": pixels}, per_side * per_side + extra, None, picture)


def language_model_lora(config: LoraConfig) -> LoraConfig:
    """``config`` with the vision tower and projector excluded from its target modules (LoRA on the language model
    only), unless ``config.exclude_modules`` already says what to exclude. The projector can still be trained in
    full with ``modules_to_save=["multi_modal_projector"]`` (LLaVA) or ``["merger"]`` (Qwen-VL). A copy."""
    import dataclasses

    if config.exclude_modules is not None:
        return config
    return dataclasses.replace(config, exclude_modules=VISION_MODULE_PATTERN)
