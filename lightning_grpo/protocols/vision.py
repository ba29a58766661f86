"""Images in prompts (vision-language models, docs/vision.md): the image facts of a checkpoint, what one processed
image is, and the rule their placeholder tokens follow.

* The checkpoint's facts, read from its transformers config (:func:`vision_spec`): its family
  (:data:`VISION_FAMILIES`), placeholder token, the tokens never sampled, Qwen-VL's merge size and 3-D positions
  (:class:`VisionSpec`; loading and processing images: :mod:`lightning_grpo.models.vision_loading`).
* One image as the model takes it (:class:`PromptImage`), the images of a prompt or rollout row (:data:`RowImages`,
  ``()`` for none), their batch inputs (:func:`image_batch`), checkpoints (:func:`row_images_state`) and devices
  (:func:`images_to`).
* The placeholder rule every engine and the trainer follow: a prompt's token ids hold each image's placeholder run
  *expanded*, one placeholder token per visual token the model inserts (``<|image_pad|>`` x ``num_tokens``, as the
  model's processor writes them), and the prompt's images come in the order of their runs. The trainer scores
  exactly those ids (:func:`check_image_tokens`); an engine that expands placeholders itself (vLLM) is given the
  collapsed form (:func:`collapse_runs`) and its expansion is checked against these ids.

The prompt encoder with images and the prompt record a sampler takes belong to the rollout path
(:class:`~lightning_grpo.protocols.sampler.ImagePromptEncoder`,
:class:`~lightning_grpo.protocols.sampler.EncodedPrompts`); the engine that takes images is
:class:`~lightning_grpo.protocols.engine.ImageRolloutEngine`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

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


@dataclass(frozen=True, eq=False)
class PromptImage:
    """One image as the model takes it: its processor outputs and the placeholder tokens it fills.

    Attributes:
        tensors: the model's inputs for this image alone, each with this image's rows along dim 0 (the batch's are
            their concatenation, image after image, :func:`image_batch`): Qwen2/2.5/3-VL ``pixel_values``
            ``(t*h*w, C*tp*p*p)`` float and ``image_grid_thw`` ``(1, 3)`` long; LLaVA ``pixel_values`` ``(1, C, H, W)``.
        num_tokens: placeholder tokens of this image in the token ids (the visual tokens the model scatters in).
        grid: ``(t, h, w)`` patches of a Qwen-VL image (the 3-D rotary positions, before the spatial merge); None for
            models with 1-D positions.
        picture: the image as the processor saw it (a PIL image, resized to the processed size) for engines that run
            the processor themselves (vLLM, the rollout servers); None once only the tensors are kept (checkpoints).
    """

    tensors: dict[str, Tensor]
    num_tokens: int
    grid: Optional[tuple[int, int, int]] = None
    picture: Any = None

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"PromptImage.num_tokens={self.num_tokens} must be >= 1")
        if not self.tensors:
            raise ValueError("PromptImage.tensors is empty: an image needs its model inputs (e.g. pixel_values)")

    def to(self, device: torch.device) -> "PromptImage":
        """This image with its tensors on ``device`` (itself when they are there)."""
        if all(t.device == device for t in self.tensors.values()):
            return self
        return PromptImage({k: v.to(device) for k, v in self.tensors.items()}, self.num_tokens, self.grid, self.picture)

    def state(self) -> dict[str, Any]:
        """As plain data (CPU tensors, ints; the picture left out) for a checkpoint."""
        return {"tensors": {k: v.detach().cpu() for k, v in self.tensors.items()}, "num_tokens": self.num_tokens,
                "grid": None if self.grid is None else list(self.grid)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "PromptImage":
        """The image :meth:`state` returned (without its picture)."""
        grid = state.get("grid")
        return cls(dict(state["tensors"]), int(state["num_tokens"]), None if grid is None else
                   (int(grid[0]), int(grid[1]), int(grid[2])))


#: The images of one prompt or one rollout row, in the order of their placeholder runs in its ids.
RowImages = tuple[PromptImage, ...]


def image_batch(images: Sequence[PromptImage]) -> dict[str, Tensor]:
    """The model's image inputs of a forward pass holding ``images`` in this order: each tensor concatenated along
    dim 0 (``pixel_values`` row blocks and ``image_grid_thw`` rows stay paired image by image).

    Raises:
        ValueError: no images, or images with different tensor names (two processors).
    """
    if not images:
        raise ValueError("image_batch needs at least one image")
    keys = sorted(images[0].tensors)
    for i, image in enumerate(images):
        if sorted(image.tensors) != keys:
            raise ValueError(f"images[{i}] has inputs {sorted(image.tensors)}, images[0] has {keys}: one processor "
                             "made them all")
    return {k: torch.cat([image.tensors[k] for image in images], dim=0) for k in keys}


def row_images_state(images: Sequence[RowImages]) -> list:
    """Per-row images as plain data, each image once (rows that share an image refer to it by index)."""
    index: dict[int, int] = {}
    table: list[dict] = []
    rows: list[list[int]] = []
    for row in images:
        for image in row:
            if id(image) not in index:
                index[id(image)] = len(table)
                table.append(image.state())
        rows.append([index[id(image)] for image in row])
    return [table, rows]


def row_images_from_state(state: Optional[list]) -> list[RowImages]:
    """The per-row images :func:`row_images_state` returned (what rows shared they share again). A checkpoint written
    before every row had an entry holds None (no images: ``[]``, one ``()`` per row made by the record) or None rows
    (``()``)."""
    if not state:
        return []
    table, rows = state
    unique = [PromptImage.from_state(s) for s in table]
    made: dict[tuple, RowImages] = {}
    return [made.setdefault(key, tuple(unique[i] for i in key)) for key in
            (tuple(int(i) for i in (r or ())) for r in rows)]


def images_to(images: Sequence[RowImages], device: torch.device) -> list[RowImages]:
    """Per-row images with their tensors on ``device``; what rows shared (a tuple, an image) they share moved."""
    rows: dict[int, RowImages] = {}
    moved: dict[int, PromptImage] = {}
    out: list[RowImages] = []
    for row in images:
        if id(row) not in rows:
            for image in row:
                if id(image) not in moved:
                    moved[id(image)] = image.to(device)
            rows[id(row)] = tuple(moved[id(image)] for image in row)
        out.append(rows[id(row)])
    return out


def count_tokens(ids: Sequence[int] | Tensor, token_ids: Sequence[int]) -> int:
    """How many of ``ids`` are one of ``token_ids`` (a model's image placeholder tokens)."""
    tensor = torch.as_tensor(ids, dtype=torch.long) if not isinstance(ids, Tensor) else ids
    return int(torch.isin(tensor, torch.as_tensor(list(token_ids), dtype=torch.long, device=tensor.device)).sum())


def check_image_tokens(ids: Sequence[int] | Tensor, images: Optional[RowImages], placeholder_id: int,
                       where: str) -> None:
    """Check that ``ids`` hold exactly the placeholder tokens of ``images`` (the count a vision-language model's
    forward scatters the image features into): the failure "Image features and image tokens do not match" turned into
    an error that names the row before any forward pass.

    Raises:
        ValueError: the counts differ (``where`` names the prompt or row): a prompt truncated through an image, a
            sampled placeholder token, or images that are not this prompt's.
    """
    have = count_tokens(ids, [placeholder_id])
    want = sum(image.num_tokens for image in images or ())
    if have != want:
        raise ValueError(f"{where}: image features and image tokens do not match: its ids hold {have} image "
                         f"placeholder tokens (id {placeholder_id}), its {len(images or ())} image(s) fill {want}")


def collapse_runs(ids: Sequence[int], images: RowImages, placeholder_id: int) -> list[int]:
    """``ids`` with each image's placeholder run (``num_tokens`` tokens, in order) replaced by one placeholder token:
    the prompt form an engine that expands placeholders itself (vLLM) takes, so that it is never expanded twice.

    Raises:
        ValueError: a run shorter than its image's ``num_tokens``, or placeholders left over
            (:func:`check_image_tokens`).
    """
    check_image_tokens(ids, images, placeholder_id, "the prompt")
    out: list[int] = []
    pending = [image.num_tokens for image in images]
    i, n = 0, len(ids)
    while i < n:
        token = int(ids[i])
        if token != placeholder_id:
            out.append(token)
            i += 1
            continue
        size = pending.pop(0)
        run = ids[i:i + size]
        if len(run) != size or any(int(t) != placeholder_id for t in run):
            raise ValueError(f"an image's placeholder run at position {i} is shorter than its {size} tokens")
        out.append(placeholder_id)
        i += size
    return out
