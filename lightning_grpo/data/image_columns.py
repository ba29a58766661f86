"""Image columns of prompt datasets (vision-language GRPO, docs/vision.md): reading an image from what a dataset holds
(:func:`load_image`: a PIL image, a file path, bytes, or the ``{"bytes", "path"}`` dict of ``datasets.Image``), the
prompt messages with image parts (:func:`image_messages`), the batches with the images in their parts
(:class:`ImageCollator`) and the prompt lengths with the images' tokens (:class:`ImagePromptLengths`).

A prompt with images is TRL's format: the user message's content is a list of parts, the images first
(``{"type": "image", "image": <PIL image>}``), then ``{"type": "text", "text": ...}``; every other message's content is
a list of text parts too (so that the dataset's Arrow columns have one type).
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from typing import Any, Optional, Sequence

#: Most pixels of an image read from a dataset (PIL's decompression-bomb limit is about 89 M).
MAX_IMAGE_PIXELS = 64 * 2**20


def load_image(value: Any, where: str) -> Any:
    """An RGB PIL image from a dataset value: a PIL image, a path (str or ``os.PathLike``), ``bytes``, or a
    ``{"bytes": ..., "path": ...}`` dict (``datasets.Image`` undecoded).

    Raises:
        ValueError: a value of another type, a missing file, data that is not an image, or more than
            :data:`MAX_IMAGE_PIXELS` pixels (``where`` names the row and column).
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        image = value
    else:
        if isinstance(value, Mapping):
            value = value.get("bytes") or value.get("path")
        try:
            if isinstance(value, (bytes, bytearray)):
                image = Image.open(io.BytesIO(bytes(value)))
            elif isinstance(value, (str, os.PathLike)):
                if not os.path.isfile(value):
                    raise ValueError(f"{where}: no image file {str(value)!r}")
                image = Image.open(value)
            else:
                raise ValueError(f"{where}: an image must be a PIL image, a file path, bytes or a "
                                 f"{{'bytes', 'path'}} dict, got {type(value).__name__}")
            if image.width * image.height > MAX_IMAGE_PIXELS:
                raise ValueError(f"{where}: {image.width}x{image.height} pixels, over {MAX_IMAGE_PIXELS}")
            image.load()
        except (UnidentifiedImageError, Image.DecompressionBombError, OSError) as err:
            raise ValueError(f"{where}: not an image: {err}") from err
    return image if image.mode == "RGB" else image.convert("RGB")


def as_image_list(value: Any) -> list[Any]:
    """A column value as a list of images: None -> none, a list or tuple -> itself, anything else -> one."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def text_parts(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages with each string content as one text part (the Arrow columns of prompts with images)."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
        out.append({**message, "content": content})
    return out


def image_messages(messages: Sequence[Mapping[str, Any]], num_images: int) -> list[dict[str, Any]]:
    """``messages`` (the last one the user's) with every content a list of parts and ``num_images`` image parts
    (``{"type": "image"}``, filled by :class:`ImageCollator`) before the last message's text."""
    out = text_parts(messages)
    last = out[-1]
    last["content"] = [{"type": "image"} for _ in range(num_images)] + list(last["content"])
    return out


def fill_images(messages: Sequence[Mapping[str, Any]], images: Sequence[Any], where: str) -> list[dict[str, Any]]:
    """``messages`` with their image parts (``{"type": "image"}``, in order) holding ``images``.

    Raises:
        ValueError: the messages have another number of image parts than ``images``.
    """
    pending = list(images)
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if isinstance(part, Mapping) and part.get("type") == "image":
                    if not pending:
                        raise ValueError(f"{where}: more image parts in the prompt than images ({len(images)})")
                    part = {"type": "image", "image": pending.pop(0)}
                elif isinstance(part, Mapping):
                    part = {k: v for k, v in part.items() if v is not None}  # Arrow's struct fills absent keys
                parts.append(part)
            content = parts
        out.append({**message, "content": content})
    if pending:
        raise ValueError(f"{where}: {len(images)} images but only {len(images) - len(pending)} image parts in the "
                         "prompt")
    return out


class ImageCollator:
    """The collate function of prompts with images: a list of examples -> a dict of equal-length lists, each
    prompt's image parts holding its images read from ``image_field`` (:func:`load_image`).

    Args:
        image_field: the column of the images (one or a list per row).
    """

    def __init__(self, image_field: str) -> None:
        self.image_field = image_field

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, list[Any]]:
        batch = {key: [example[key] for example in examples] for key in examples[0]}
        prompts = []
        for i, example in enumerate(examples):
            question = str(example.get("question", ""))[:60]
            where = f"row {i} of the batch (question {question!r}), column {self.image_field!r}"
            images = [load_image(v, where) for v in as_image_list(example[self.image_field])]
            prompts.append(fill_images(example["prompt"], images, where))
        batch["prompt"] = prompts
        return batch


class ImagePromptLengths:
    """Prompt lengths in tokens with their images' placeholder tokens: the chat template's ids (one placeholder per
    image) plus what each image adds once processed (:func:`lightning_grpo.models.vision_loading.process_image`).

    Args:
        model_dir: the vision-language checkpoint's folder (tokenizer with its chat template, config, image
            processor).

    Raises:
        ValueError: the folder is not a vision-language checkpoint.
    """

    def __init__(self, model_dir: str) -> None:
        from transformers import AutoConfig, AutoTokenizer

        from lightning_grpo.models.vision_loading import load_image_processor
        from lightning_grpo.protocols.vision import vision_spec

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.config = AutoConfig.from_pretrained(model_dir)
        spec = vision_spec(self.config)
        if spec is None:
            raise ValueError(f"image_field is set, but {model_dir!r} (tokenizer=) is not a vision-language checkpoint: "
                             "give the model's folder, whose processor counts the images' tokens")
        self.spec = spec
        self.processor = load_image_processor(model_dir)

    def __call__(self, prompt: Sequence[Mapping[str, Any]], images: Sequence[Any]) -> int:
        """The tokens of ``prompt`` (messages with image parts) with ``images`` (PIL)."""
        from lightning_grpo.models.vision_loading import process_image

        ids = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
        if isinstance(ids, Mapping) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        extra = sum(process_image(image, self.processor, self.spec, self.config).num_tokens - 1 for image in images)
        return len(ids) + extra


def long_prompt_rows(prompts: Sequence[Any], images: Sequence[Any], lengths: ImagePromptLengths, max_length: int,
                     image_field: str, split: str, on_long: str) -> list[int]:
    """The indices of the prompts that fit ``max_length`` tokens with their images; the others are left out
    (``on_long="skip"``) or refused.

    Raises:
        ValueError: ``on_long="error"`` and a prompt does not fit (its row, length and the limit named).
    """
    keep = []
    for i, (prompt, value) in enumerate(zip(prompts, images, strict=True)):
        where = f"split {split!r} row {i}, column {image_field!r}"
        pictures = [load_image(v, where) for v in as_image_list(value)]
        length = lengths(fill_images(prompt, pictures, where), pictures)
        if length <= max_length:
            keep.append(i)
        elif on_long == "error":
            raise ValueError(f"split {split!r} row {i}: its prompt has {length} tokens with its {len(pictures)} "
                             f"image(s), over max_prompt_length={max_length}; a prompt with images is never cut "
                             "(long_prompts='skip' leaves such prompts out)")
    return keep


def check_on_long(value: str) -> str:
    """``PromptDataModule(long_prompts=...)``: "skip" or "error".

    Raises:
        ValueError: another value.
    """
    if value not in ("skip", "error"):
        raise ValueError(f"long_prompts={value!r}: 'skip' (leave the prompt out, counted) or 'error'")
    return value


def optional_column(columns: Sequence[str], name: Optional[str], dataset: str, split: str) -> None:
    """Raise ``ValueError`` when the image column ``name`` is set and not among ``columns``."""
    if name is not None and name not in columns:
        raise ValueError(f"dataset={dataset!r} split {split!r}: image_field={name!r} is not a column; available "
                         f"columns: {list(columns)}")
