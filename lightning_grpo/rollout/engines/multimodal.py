"""Images in the engines' requests (vision-language policies), shared by the HF engine, colocated vLLM and the rollout
servers: the rows of an HF ``generate`` with their pixel inputs (:class:`ImageRows`), vLLM's requests with
``multi_modal_data`` (:func:`vllm_prompt`) and the check of its placeholder expansion (:func:`check_expansion`),
and images on the wire to a rollout server (:func:`encode_picture`, :func:`decode_picture`).
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from torch import Tensor

from lightning_grpo.protocols.vision import RowImages, VisionSpec, check_image_tokens, collapse_runs, image_batch

#: Most bytes of one image on the wire to a rollout server (a PNG of 4096 x 4096 RGB pixels is at most ~48 MiB; the
#: processors' pixel limits keep real ones far smaller).
MAX_IMAGE_BYTES = 16 * 2**20
#: Most images of one prompt in a request to a rollout server.
MAX_IMAGES_PER_PROMPT = 16


@dataclass
class ImageRows:
    """The rows an HF ``generate`` call runs and their images.

    Without images: the prompts, ``num_return_sequences`` G. With images and sampling, each prompt is repeated G
    times with its images (transformers' expansion of ``num_return_sequences`` repeats tensors row by row, which
    would hand one prompt's pixel rows to another); greedy: each prompt once, its completion repeated.

    Attributes:
        prompt_ids: the rows' prompt ids.
        per_row: ``num_return_sequences`` of each row (G, or 1 once repeated).
        repeat: how often :func:`~lightning_grpo.protocols.rollout.finish_rollout` repeats each row's prompt.
        images: each row's images (``()``: none; empty without images).
        spec: the policy's image facts.
    """

    prompt_ids: Sequence[Sequence[int]]
    per_row: int
    repeat: int
    images: list[RowImages] = field(default_factory=list)
    spec: Optional[VisionSpec] = None

    @classmethod
    def of(cls, prompt_ids: Sequence[Sequence[int]], images: Sequence[RowImages], num_generations: int, greedy: bool,
           spec: Optional[VisionSpec]) -> "ImageRows":
        """The rows of ``prompt_ids`` with ``images`` (each prompt's; ``()``: none; see the class docstring).

        Raises:
            ValueError: images for a policy without ``spec``, or a prompt whose placeholders are not its images'.
        """
        if not any(images):
            return cls(prompt_ids, num_generations, num_generations)
        if spec is None:
            raise ValueError("the prompts have images, but the policy is not a vision-language model")
        for i, (ids, row) in enumerate(zip(prompt_ids, images, strict=True)):
            check_image_tokens(ids, row, spec.placeholder_id, f"prompt_ids[{i}]")
        if greedy:
            return cls(prompt_ids, num_generations, num_generations, list(images), spec)
        rows = [p for p in prompt_ids for _ in range(num_generations)]
        return cls(rows, 1, 1, [row for row in images for _ in range(num_generations)], spec)

    def model_inputs(self, ids: Tensor) -> dict[str, Tensor]:
        """``generate``'s image keyword arguments for the left-padded ``(N, P)`` ``ids`` of these rows: the rows'
        images in order and, for Qwen-VL, ``mm_token_type_ids`` (1 on image tokens: transformers' 3-D positions)."""
        if self.spec is None or not any(self.images):
            return {}
        out = {k: v.to(ids.device) for k, v in image_batch([im for row in self.images for im in row]).items()}
        if self.spec.mrope:
            out["mm_token_type_ids"] = (ids == self.spec.placeholder_id).int()
        return out


def vllm_prompt(ids: Sequence[int], images: Optional[RowImages], placeholder_id: int) -> dict[str, Any]:
    """vLLM's ``TokensPrompt`` of one prompt: its ids with each image's placeholder run collapsed to one token (vLLM
    expands them again from the images, verl's ``qwen2_5_vl_dedup_image_tokens``) and ``multi_modal_data`` with
    the pictures; the plain ids without images.

    Raises:
        ValueError: an image without its picture (restored from a checkpoint), or placeholders that are not the
            images'.
    """
    if not images:
        return {"prompt_token_ids": [int(t) for t in ids]}
    pictures = [image.picture for image in images]
    if any(p is None for p in pictures):
        raise ValueError("an image of the prompt has no picture (only its tensors were kept): vLLM needs the picture")
    return {"prompt_token_ids": collapse_runs(ids, images, placeholder_id), "multi_modal_data": {"image": pictures}}


def check_expansion(engine_ids: Sequence[int], ids: Sequence[int], index: int) -> None:
    """The prompt ids vLLM ran (its placeholder expansion) must be the trainer's ``ids``: else the sampler and the
    trainer would condition on different sequences.

    Raises:
        ValueError: they differ (the first differing position named).
    """
    engine_ids, ids = [int(t) for t in engine_ids], [int(t) for t in ids]
    if engine_ids != ids:
        pairs = enumerate(zip(engine_ids, ids, strict=False))
        first = next((i for i, (a, b) in pairs if a != b), min(len(engine_ids), len(ids)))
        raise ValueError(f"prompt {index}: vLLM expanded the image placeholders into {len(engine_ids)} tokens, the "
                         f"trainer's prompt has {len(ids)}; they differ from position {first}: the engine's processor "
                         "resizes images differently from the trainer's")


def bad_words(tokenizer: Any, banned_token_ids: Sequence[int]) -> Optional[list[str]]:
    """The banned tokens as vLLM's ``bad_words`` (each one token's text, which vLLM tokenizes back to that one token
    and removes before temperature and truncation, as :func:`~lightning_grpo.protocols.sampling.sampling_removed`);
    None when nothing is banned.

    Raises:
        ValueError: a banned token whose text does not tokenize back to it alone, or whose text after a space is
            another single token (vLLM bans that one too): it could not be banned exactly. Special tokens (image
            placeholders) are exact.
    """
    if not banned_token_ids:
        return None
    words = []
    for token in banned_token_ids:
        text = tokenizer.convert_ids_to_tokens(int(token))
        exact = isinstance(text, str) and tokenizer.encode(text, add_special_tokens=False) == [int(token)]
        if exact:
            spaced = tokenizer.encode(" " + text.lstrip(), add_special_tokens=False)
            exact = text == text.lstrip() and (len(spaced) != 1 or spaced == [int(token)])
        if not exact:
            raise ValueError(f"banned token {token} ({text!r}) is not exactly one vLLM bad word (its text does not "
                             "tokenize back to it alone, or with a space before it is another token, which vLLM "
                             "would ban too)")
        words.append(text)
    return words


def check_expansions(engine_ids: Sequence[Sequence[int]], prompts: Sequence[Sequence[int]]) -> None:
    """:func:`check_expansion` of every prompt. Raises as it, or ValueError for another number of prompts."""
    if len(engine_ids) != len(prompts):
        raise ValueError(f"the engine ran {len(engine_ids)} prompts, not {len(prompts)}")
    for i, (ran, ids) in enumerate(zip(engine_ids, prompts, strict=True)):
        check_expansion(ran, ids, i)


def wire_images(prompts: Sequence[Sequence[int]], images: Sequence[RowImages],
                placeholder_id: Optional[int]) -> list[tuple[list[int], list[str]]]:
    """Each prompt as a rollout server takes it with images: its ids with every placeholder run collapsed and its
    pictures as base64 PNG (:func:`vllm_prompt`, :func:`encode_picture`).

    Raises:
        ValueError: no placeholder id (the servers' model takes no images); as :func:`vllm_prompt`.
    """
    if placeholder_id is None:
        raise ValueError("the prompts have images, but the rollout servers' model is not a vision-language model")
    out = []
    for ids, row in zip(prompts, images, strict=True):
        request = vllm_prompt(ids, row, placeholder_id)
        pictures = request.get("multi_modal_data", {}).get("image", [])
        out.append((request["prompt_token_ids"], [encode_picture(p) for p in pictures]))
    return out


def encode_picture(picture: Any) -> str:
    """A picture (PIL image) as base64 PNG text, lossless, for a rollout server's request."""
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_picture(text: str, where: str) -> Any:
    """The picture :func:`encode_picture` wrote (an RGB PIL image).

    Raises:
        ValueError: not base64, over :data:`MAX_IMAGE_BYTES`, or not an image (``where`` names it).
    """
    from PIL import Image, UnidentifiedImageError

    if len(text) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise ValueError(f"{where} is over {MAX_IMAGE_BYTES} bytes")
    try:
        data = base64.b64decode(text, validate=True)
    except (ValueError, TypeError) as err:
        raise ValueError(f"{where} is not base64: {err}") from err
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.width * image.height > MAX_IMAGE_BYTES // 3:
                raise ValueError(f"{where} has {image.width}x{image.height} pixels, over {MAX_IMAGE_BYTES // 3}")
            return image.convert("RGB")
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError) as err:
        raise ValueError(f"{where} is not an image: {err}") from err
