"""The image facts of a vision-language checkpoint, read from its transformers config (:func:`vision_spec`): its
family (:data:`VISION_FAMILIES`), placeholder token, the tokens never sampled, Qwen-VL's merge size and 3-D positions.
Plain data the engines, the prompt encoding and the trainer share (loading and processing images:
:mod:`lightning_grpo.models.vision`; docs/vision.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

#: ``config.model_type`` -> family ("qwen_vl": 3-D positions and patch grids; "llava": a square crop, 1-D positions).
VISION_FAMILIES = {"qwen2_vl": "qwen_vl", "qwen2_5_vl": "qwen_vl", "qwen3_vl": "qwen_vl", "llava": "llava"}


@dataclass(frozen=True)
class VisionSpec:
    """The image facts of a vision-language checkpoint.

    Attributes:
        family: "qwen_vl" or "llava" (:data:`VISION_FAMILIES`).
        model_type: the config's ``model_type``.
        placeholder_id: the image placeholder token (``<|image_pad|>``, ``<image>``).
        banned_token_ids: placeholder and delimiter tokens the policy may never sample (image, video, vision start
            and end, where the config has them), sorted.
        merge_size: Qwen-VL ``spatial_merge_size`` (patches merged per side into one token); 1 for LLaVA.
        mrope: whether positions are 3-D (Qwen-VL).
    """

    family: str
    model_type: str
    placeholder_id: int
    banned_token_ids: tuple[int, ...]
    merge_size: int = 1
    mrope: bool = False


def vision_spec(config: Any) -> Optional[VisionSpec]:
    """The :class:`VisionSpec` of a transformers config, or None for a model without images (a causal LM).

    Raises:
        ValueError: a vision-language config without its image token id.
    """
    model_type = str(getattr(config, "model_type", ""))
    family = VISION_FAMILIES.get(model_type)
    if family is None:
        return None
    placeholder = getattr(config, "image_token_id", None)
    if placeholder is None:
        placeholder = getattr(config, "image_token_index", None)
    if placeholder is None:
        raise ValueError(f"the {model_type} config has no image_token_id: it cannot place its images")
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    banned = {int(placeholder)} | {int(v) for n in names if (v := getattr(config, n, None)) is not None}
    if family == "qwen_vl":
        merge = int(config.vision_config.spatial_merge_size)
        return VisionSpec(family, model_type, int(placeholder), tuple(sorted(banned)), merge, mrope=True)
    return VisionSpec(family, model_type, int(placeholder), tuple(sorted(banned)))
