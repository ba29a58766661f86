"""What one image of a prompt is once processed (:class:`PromptImage`), the images of a prompt or rollout row
(:data:`RowImages`), and the checks and layouts of their placeholder tokens (docs/vision.md).

The rule every engine and the trainer follow: a prompt's token ids hold each image's placeholder run *expanded*, one
placeholder token per visual token the model inserts (``<|image_pad|>`` x ``num_tokens``, as the model's processor
writes them), and the prompt's images come in the order of their runs. The trainer scores exactly those ids; an
engine that expands placeholders itself (vLLM) is given the collapsed form (:func:`collapse_runs`) and its expansion
is checked against these ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import Tensor


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


@dataclass(frozen=True)
class EncodedPrompts:
    """A prompt batch encoded for the engine: what a :class:`~lightning_grpo.protocols.sampler.Sampler` samples from
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
