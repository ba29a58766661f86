"""The image inputs of a vision-language policy's training forward, in each layout of
:class:`~lightning_grpo.training.logprobs.CompletionLogprobs`: each row's images (``pixel_values`` and grid sizes,
:class:`~lightning_grpo.protocols.vision.PromptImage`) concatenated in the order their placeholder runs appear in the
forward's ``input_ids``, and Qwen-VL's 3-D rotary positions (:func:`mrope_positions`).

* padded ``(B, P + T)`` rows: every row's images, row after row; positions ``(3, B, P + T)``;
* packed rows: the images of the packed sequences in packing order; positions ``(4, 1, L)``, the first row the text
  positions restarting at each sequence (transformers derives the block-diagonal mask from it), the other three the
  3-D positions of each sequence;
* shared-prefix rows: a group's prompt images once, then each completion's own (multi-turn image observations);
  positions ``(3, 1, L)``, each completion continuing its prompt's.

Every row is checked first: its placeholder tokens must be exactly its images' (:func:`check_rows`), so a mismatch
is an error naming the row, never a feature scattered into another sample's tokens.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from lightning_grpo.protocols.vision import PromptImage, RowImages, VisionSpec, check_image_tokens, image_batch


def mrope_positions(ids: Tensor, images: Optional[RowImages], spec: VisionSpec) -> Tensor:
    """Qwen-VL's 3-D rotary positions (temporal, height, width) of one sequence (Qwen2-VL report, arXiv:2409.12191,
    sec. 2.1 "Multimodal Rotary Position Embedding"; transformers' ``get_rope_index`` for images): a text token at
    position ``c`` gets ``(c, c, c)``; an image whose grid is ``t x h x w`` patches, merged ``m x m``, starting at
    ``c`` gets ``(c + i, c + j, c + k)`` for its ``t x h/m x w/m`` tokens in order, and the text after it continues
    at ``c + max(h, w) / m``.

    Args:
        ids: ``(L,)`` long token ids (no padding), each image's placeholder run expanded, in order.
        images: the images of those runs (None: none).
        spec: the model's image facts (``placeholder_id``, ``merge_size``).

    Returns:
        ``(3, L)`` long positions, on ``ids``' device.

    Raises:
        ValueError: the placeholder tokens are not exactly the images' (:func:`check_image_tokens`), or an image
            without its grid.
    """
    images = images or ()
    check_image_tokens(ids, images, spec.placeholder_id, "the sequence")
    out = torch.empty((3, ids.numel()), dtype=torch.long, device=ids.device)
    is_image = (ids == spec.placeholder_id).tolist()
    position, i, k, n = 0, 0, 0, ids.numel()
    while i < n:
        if not is_image[i]:
            j = i
            while j < n and not is_image[j]:
                j += 1
            out[:, i:j] = torch.arange(position, position + j - i, device=ids.device)
            position += j - i
            i = j
            continue
        image = images[k]
        if image.grid is None:
            raise ValueError("an image without its (t, h, w) grid cannot have 3-D positions")
        t, h, w = image.grid[0], image.grid[1] // spec.merge_size, image.grid[2] // spec.merge_size
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
        out[:, i:i + image.num_tokens] = grid.reshape(3, -1).to(ids.device) + position
        position += max(h, w)
        i += image.num_tokens
        k += 1
    return out


def split_row_images(images: RowImages, prompt_tokens: int) -> tuple[RowImages, RowImages]:
    """A row's images as ``(the prompt's, the completion's)``, given the placeholder tokens of its prompt.

    Raises:
        ValueError: the prompt's placeholder tokens end inside an image.
    """
    total, k = 0, 0
    while k < len(images) and total < prompt_tokens:
        total += images[k].num_tokens
        k += 1
    if total != prompt_tokens:
        raise ValueError(f"the prompt holds {prompt_tokens} image tokens, which ends inside an image")
    return tuple(images[:k]), tuple(images[k:])


class VisionInputs:
    """The image inputs of each forward layout for a batch whose rows have images (see the module docstring).

    A row's laid-out tokens are its real prompt and its completion under ``completion_mask``; its images there are
    the prefix of its images whose placeholder tokens those hold (a row without loss tokens keeps its prompt's).

    Args:
        spec: the policy's image facts.
        images: ``B`` rows' images (``()``: a row without images).
        prompt_ids, prompt_mask: ``(B, P)`` long, left-padded.
        completion_ids, completion_mask: ``(B, T)`` long; the mask is what the forward lays out (with multi-turn
            environment tokens).
    """

    def __init__(self, spec: VisionSpec, images: Sequence[RowImages], prompt_ids: Tensor,
                 prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor) -> None:
        self.spec = spec
        self.images = list(images)
        self.prompt_ids, self.prompt_mask = prompt_ids, prompt_mask
        self.completion_ids, self.completion_mask = completion_ids, completion_mask
        self.filler = next(t for t in range(len(spec.banned_token_ids) + 1) if t not in spec.banned_token_ids)

    def prompt(self, row: int) -> Tensor:
        """``(p,)`` the real prompt ids of ``row``."""
        return self.prompt_ids[row][self.prompt_mask[row].bool()]

    def sequence(self, row: int) -> Tensor:
        """``(p + n,)`` the real prompt and laid-out completion ids of ``row``."""
        n = int(self.completion_mask[row].sum())
        return torch.cat([self.prompt(row), self.completion_ids[row, :n]])

    def row_images(self, row: int) -> RowImages:
        """The images of ``row``'s laid-out tokens (:func:`check_image_tokens` holds for them).

        Raises:
            ValueError: the placeholder tokens are not a whole prefix of the row's images (a truncated image, a
                sampled placeholder, another row's images), naming the row.
        """
        sequence = self.sequence(row)
        tokens = int((sequence == self.spec.placeholder_id).sum())
        try:
            images, _ = split_row_images(self.images[row], tokens)
        except ValueError:
            images = self.images[row]  # the check below names the mismatch
        check_image_tokens(sequence, images, self.spec.placeholder_id, f"row {row} (prompt and completion)")
        return images

    def prompt_keys(self) -> list[tuple[int, ...]]:
        """Per row, the identity of its prompt's images: rows with the same prompt ids and other images are other
        prompts (:func:`lightning_grpo.training.packing.shared_prefix_rows`)."""
        keys = []
        for row in range(len(self.images)):
            tokens = int((self.prompt(row) == self.spec.placeholder_id).sum())
            prompt_images, _ = split_row_images(self.row_images(row), tokens)
            keys.append(tuple(id(image) for image in prompt_images))
        return keys

    def pixels(self, images: list[PromptImage]) -> dict[str, Tensor]:
        """The model's image keyword arguments for ``images`` in this order (none: no arguments)."""
        return image_batch(images) if images else {}

    def padded(self, input_ids: Tensor, positions: Tensor) -> dict:
        """Keyword arguments of the padded forward of every row: ``input_ids`` ``(B, P + T)`` with the completion
        tokens not laid out replaced by a text token (their placeholders would take features), the laid-out images
        row after row and, for 3-D positions, ``position_ids`` ``(3, B, P + T)`` replacing the 1-D ``positions``
        (padding keeps 0)."""
        rows = range(len(self.images))
        mask = torch.cat([self.prompt_mask, self.completion_mask], dim=1).bool()
        out: dict = {"input_ids": input_ids.masked_fill(~mask, self.filler)}
        per_row = [self.row_images(row) for row in rows]
        out.update(self.pixels([image for images in per_row for image in images]))
        if self.spec.mrope:
            position_ids = positions.new_zeros((3, *positions.shape))
            for row in rows:
                position_ids[:, row, mask[row]] = mrope_positions(self.sequence(row), per_row[row], self.spec)
            out["position_ids"] = position_ids
        return out

    def packed(self, rows: Sequence[int], text_positions: Tensor) -> dict:
        """Keyword arguments of a packed forward of ``rows`` in this order (each with a completion): their images
        and, for 3-D positions, ``position_ids`` ``(4, 1, L)`` (``text_positions`` ``(1, L)`` first)."""
        per_row = [self.row_images(row) for row in rows]
        out = self.pixels([image for images in per_row for image in images])
        if self.spec.mrope:
            pieces = [mrope_positions(self.sequence(row), images, self.spec)
                      for row, images in zip(rows, per_row, strict=True)]
            out["position_ids"] = torch.cat([text_positions, torch.cat(pieces, dim=1)], dim=0)[:, None, :]
        return out

    def shared_prefix(self, groups: Sequence[Sequence[int]]) -> dict:
        """Keyword arguments of a shared-prefix forward of ``groups`` (each a prompt's member rows, laid out prompt
        once then each completion, groups one after another): the images in that order and, for 3-D positions,
        ``position_ids`` ``(3, 1, L)``."""
        images: list[PromptImage] = []
        pieces: list[Tensor] = []
        for members in groups:
            prompt = self.prompt(members[0])
            prompt_tokens = int((prompt == self.spec.placeholder_id).sum())
            first, _ = split_row_images(self.row_images(members[0]), prompt_tokens)
            images.extend(first)
            if self.spec.mrope:
                pieces.append(mrope_positions(prompt, first, self.spec))
            for row in members:
                laid_out = self.row_images(row)
                own_prompt, completion = split_row_images(laid_out, prompt_tokens)
                if any(a is not b for a, b in zip(own_prompt, first, strict=True)):
                    raise ValueError(f"row {row} shares its prompt ids with row {members[0]} but not its images: "
                                     "two prompts with the same ids and different images cannot share a prefix")
                images.extend(completion)
                if self.spec.mrope:
                    full = mrope_positions(self.sequence(row), laid_out, self.spec)
                    pieces.append(full[:, prompt.numel():])
        out = self.pixels(images)
        if self.spec.mrope:
            out["position_ids"] = torch.cat(pieces, dim=1)[:, None, :]
        return out
