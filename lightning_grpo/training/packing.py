"""Padding-free layouts and token-budget micro-batches.

:func:`pack_sequences` concatenates the real (unpadded) tokens of a batch of (prompt, completion) rows into one
row with per-sequence position ids, the input of a padding-free forward pass: transformers derives a
block-diagonal causal mask from position ids that restart at 0 (``masking_utils.find_packed_sequence_indices``
for the sdpa/eager/flex paths; the varlen kernels for flash attention), so no compute is spent on padding.
:func:`shared_prefix_rows` lays out each group of rows sharing a prompt as one row (the prompt once, then every
completion) with a 4-D mask, so a GRPO group's prompt is computed once; :func:`merge_rows` combines such rows into
one forward pass. :func:`token_budget_partition` cuts a mini-batch into micro-batches by a token budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Optional, Sequence

import torch
from torch import Tensor


@dataclass
class PackedBatch:
    """One packed row of ``B`` (prompt, completion) sequences.

    Attributes:
        input_ids: ``(1, L)`` long, the real prompt and completion tokens of every row with a non-empty
            completion, row after row (``L`` = the sum of their lengths).
        position_ids: ``(1, L)`` long, 0, 1, ... restarting at each sequence.
        logit_index: ``(K,)`` long, the packed positions whose logits predict the ``K`` real completion tokens
            (position ``offset + prompt_len + j - 1`` predicts completion token ``j``), ascending.
        target_ids: ``(1, K)`` long, those completion tokens.
        rows, cols: ``(K,)`` long, where each of the ``K`` tokens sits in the padded ``(B, T)`` completion layout.
        source: ``(1, L)`` long, where each packed position comes from in the padded ``(B, P + T)`` layout of
            ``[prompt, completion]`` (``row * (P + T) + column``): what :func:`arrange` lays out per-token values by.
    """

    input_ids: Tensor
    position_ids: Tensor
    logit_index: Tensor
    target_ids: Tensor
    rows: Tensor
    cols: Tensor
    source: Tensor

    def unpack(self, values: Tensor, shape: tuple[int, int]) -> Tensor:
        """Scatter per-token ``values`` ``(1, K)`` into a zero ``(B, T)`` tensor of the padded layout."""
        out = values.new_zeros(shape)
        out[self.rows, self.cols] = values.reshape(-1)
        return out


def completion_lengths(completion_mask: Tensor) -> Tensor:
    """``(B,)`` long: the length of each row's prefix mask.

    Raises:
        ValueError: a row is not a prefix mask (1s then 0s): it cannot be packed.
    """
    lengths = completion_mask.sum(dim=1)
    prefix = completion_mask.cumprod(dim=1).sum(dim=1)
    if not torch.equal(prefix, lengths):
        bad = (prefix != lengths).nonzero().flatten().tolist()
        raise ValueError(f"completion_mask rows {bad} are not prefix masks (1s then 0s): they cannot be packed")
    return lengths


def pack_sequences(
    prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor
) -> PackedBatch:
    """Pack left-padded prompts and right-padded completions into one padding-free row.

    Rows whose completion mask is all 0 (no loss: masked or unscored) are left out; their values unpack to 0.

    Args:
        prompt_ids, prompt_mask: ``(B, P)`` long, left-padded (mask 1 on the real tokens).
        completion_ids, completion_mask: ``(B, T)`` long, right-padded; each mask row must be a prefix
            (1s then 0s), as the completion masks of :class:`lightning_grpo.training.experience.Experience` are.

    Raises:
        ValueError: a completion_mask row is not a prefix mask, or a row with a completion has no prompt token.
    """
    lengths = completion_lengths(completion_mask)  # [B]
    prompt_lengths = prompt_mask.sum(dim=1)
    device = completion_ids.device
    pieces, positions, logit_index, rows, cols, source = [], [], [], [], [], []
    width = prompt_ids.shape[1] + completion_ids.shape[1]
    offset = 0
    for i in range(completion_ids.shape[0]):
        n = int(lengths[i])
        if n == 0:
            continue
        p = int(prompt_lengths[i])
        if p == 0:
            raise ValueError(f"row {i} has a completion but no prompt token (prompt_mask is all 0)")
        prompt_cols = prompt_mask[i].nonzero().flatten()
        pieces += [prompt_ids[i, prompt_cols], completion_ids[i, :n]]
        positions.append(torch.arange(p + n, device=device))
        logit_index.append(torch.arange(offset + p - 1, offset + p + n - 1, device=device))
        rows.append(torch.full((n,), i, device=device, dtype=torch.long))
        cols.append(torch.arange(n, device=device))
        source += [i * width + prompt_cols, i * width + prompt_ids.shape[1] + torch.arange(n, device=device)]
        offset += p + n
    if not pieces:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return PackedBatch(empty[None], empty[None], empty, empty[None], empty, empty, empty[None])
    targets = torch.cat([completion_ids[r, c] for r, c in zip(rows, cols, strict=True)])
    return PackedBatch(
        input_ids=torch.cat(pieces)[None],
        position_ids=torch.cat(positions)[None],
        logit_index=torch.cat(logit_index),
        target_ids=targets[None],
        rows=torch.cat(rows),
        cols=torch.cat(cols),
        source=torch.cat(source)[None],
    )


def padded_source(batch_size: int, prompt_width: int, completion_width: int, device: torch.device) -> Tensor:
    """``(B, P + T)`` long: the padded layout's own positions (``row * (P + T) + column``), the ``source`` of a
    forward pass over ``[prompt_ids, completion_ids]`` as they are."""
    width = prompt_width + completion_width
    return torch.arange(batch_size * width, device=device).view(batch_size, width)


def arrange(prompt_values: Tensor, completion_values: Tensor, source: Tensor) -> Tensor:
    """Per-token values laid out like the input ids of a forward layout.

    ``prompt_values`` ``(B, P, ...)`` and ``completion_values`` ``(B, T, ...)`` are aligned with a batch's
    ``prompt_ids`` and ``completion_ids`` (a per-token field: :mod:`lightning_grpo.protocols.tokens`); ``source`` is a
    layout's map of its input positions into ``[prompt, completion]`` (``(B, P + T)`` for the padded layout,
    :func:`padded_source`; ``(1, L)`` for a packed or shared-prefix row, :attr:`PackedBatch.source`,
    :attr:`SharedPrefixRow.source`). Returns ``source.shape + (...)``: the value of the token at every input position,
    so ``arrange(prompt_ids, completion_ids, source)`` is the layout's ``input_ids`` exactly.
    """
    values = torch.cat([prompt_values, completion_values.to(prompt_values.dtype)], dim=1)
    flat = values.reshape(-1, *values.shape[2:])
    return flat[source.reshape(-1).to(flat.device)].reshape(*source.shape, *values.shape[2:])


def sequence_token_counts(prompt_mask: Tensor, completion_mask: Tensor) -> Tensor:
    """``(B,)`` long: real prompt plus completion tokens per row, the cost of a row in a padding-free forward."""
    return prompt_mask.sum(dim=1) + completion_mask.sum(dim=1)


def token_budget_partition(token_counts: list[int], max_tokens: int) -> list[list[int]]:
    """Split sequences into micro-batches of at most ``max_tokens`` tokens each, balanced.

    First-fit-decreasing fixes the number of micro-batches ``k`` (a sequence longer than the budget gets a
    micro-batch of its own); the sequences are then dealt longest first to the lightest of ``k`` micro-batches
    (LPT), which balances them, and that split is kept when it respects the budget (else the FFD one).
    Every index appears exactly once. Micro-batches are returned heaviest first, indices ascending within each.

    Args:
        token_counts: tokens of each sequence (>= 0).
        max_tokens: the budget (>= 1).

    Raises:
        ValueError: ``max_tokens < 1`` or a negative count.
    """
    if max_tokens < 1:
        raise ValueError(f"GRPOConfig.max_tokens_per_microbatch={max_tokens} must be >= 1")
    if any(c < 0 for c in token_counts):
        raise ValueError(f"token counts must be >= 0, got {token_counts}")
    if not token_counts:
        return []
    order = sorted(range(len(token_counts)), key=lambda i: (-token_counts[i], i))
    ffd: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        c = token_counts[i]
        for b, load in enumerate(loads):
            if load + c <= max_tokens:
                ffd[b].append(i)
                loads[b] += c
                break
        else:
            ffd.append([i])
            loads.append(c)
    k = len(ffd)
    lpt: list[list[int]] = [[] for _ in range(k)]
    lpt_loads = [0] * k
    for i in order:
        b = min(range(k), key=lambda j: (lpt_loads[j], j))
        lpt[b].append(i)
        lpt_loads[b] += token_counts[i]
    fits = all(load <= max_tokens or len(part) == 1 for part, load in zip(lpt, lpt_loads, strict=True))
    parts = lpt if fits else ffd
    parts = [sorted(p) for p in parts if p]
    return sorted(parts, key=lambda p: (-sum(token_counts[i] for i in p), p[0]))


@dataclass
class SharedPrefixRow:
    """One group of sequences with the same prompt as one row: the prompt once, then each completion.

    Attributes:
        input_ids: ``(1, L)`` long, ``[prompt, completion_1, ..., completion_k]`` (real tokens only).
        position_ids: ``(1, L)`` long, ``0 .. p-1`` for the prompt and ``p .. p + n_j - 1`` for each completion.
        attention_mask: ``(1, 1, L, L)`` float additive mask (0 = attend, -inf = not): causal, and a completion
            sees the prompt and its own earlier tokens, never another completion.
        logit_index, target_ids, rows, cols: as in :class:`PackedBatch` (the last prompt position predicts every
            completion's first token, so it may repeat).
        source: ``(1, L)`` long, as in :class:`PackedBatch` (the shared prompt's positions map to the first member's
            prompt).
    """

    input_ids: Tensor
    position_ids: Tensor
    attention_mask: Tensor
    logit_index: Tensor
    target_ids: Tensor
    rows: Tensor
    cols: Tensor
    source: Tensor


def shared_prefix_rows(
    prompt_ids: Tensor, prompt_mask: Tensor, completion_ids: Tensor, completion_mask: Tensor, dtype: torch.dtype,
    keys: Optional[Sequence[Hashable]] = None,
) -> list[SharedPrefixRow]:
    """Group the rows with loss tokens by identical prompt (a GRPO group shares its prompt) and lay each group out
    as one :class:`SharedPrefixRow`, so the prompt is computed once instead of once per completion. Exact: every
    completion token sees the same context as in its own padded row.

    Args:
        prompt_ids, prompt_mask, completion_ids, completion_mask: as in :func:`pack_sequences`.
        dtype: float dtype of the additive attention mask (the model's).
        keys: one more grouping key per row (a vision-language prompt's images: the same ids with other images are
            another prompt); None: the ids alone.

    Raises:
        ValueError: as :func:`pack_sequences`.
    """
    lengths = completion_lengths(completion_mask)
    device = completion_ids.device
    prompt_width = prompt_ids.shape[1]
    width = prompt_width + completion_ids.shape[1]
    groups: dict[tuple, list[int]] = {}
    for i in range(completion_ids.shape[0]):
        if int(lengths[i]) == 0:
            continue
        prompt = tuple(prompt_ids[i][prompt_mask[i].bool()].tolist())
        if not prompt:
            raise ValueError(f"row {i} has a completion but no prompt token (prompt_mask is all 0)")
        groups.setdefault((prompt, None if keys is None else keys[i]), []).append(i)
    out = []
    for (prompt, _), members in groups.items():
        p = len(prompt)
        pieces = [torch.tensor(prompt, dtype=torch.long, device=device)]
        positions = [torch.arange(p, device=device)]
        segment = [torch.zeros(p, dtype=torch.long, device=device)]
        logit_index, rows, cols = [], [], []
        source = [members[0] * width + prompt_mask[members[0]].nonzero().flatten()]
        offset = p
        for s, i in enumerate(members, start=1):
            n = int(lengths[i])
            pieces.append(completion_ids[i, :n])
            source.append(i * width + prompt_width + torch.arange(n, device=device))
            positions.append(torch.arange(p, p + n, device=device))
            segment.append(torch.full((n,), s, dtype=torch.long, device=device))
            # token 0 is predicted by the last prompt position, token j > 0 by the completion's token j - 1
            logit_index.append(
                torch.cat([torch.tensor([p - 1], device=device), torch.arange(offset, offset + n - 1, device=device)])
            )
            rows.append(torch.full((n,), i, dtype=torch.long, device=device))
            cols.append(torch.arange(n, device=device))
            offset += n
        seg = torch.cat(segment)
        index = torch.arange(seg.numel(), device=device)
        allowed = (index[None, :] <= index[:, None]) & ((seg[None, :] == seg[:, None]) | (seg[None, :] == 0))
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
        row_index, col_index = torch.cat(rows), torch.cat(cols)
        out.append(SharedPrefixRow(
            input_ids=torch.cat(pieces)[None],
            position_ids=torch.cat(positions)[None],
            attention_mask=mask[None, None],
            logit_index=torch.cat(logit_index),
            target_ids=completion_ids[row_index, col_index][None],
            rows=row_index,
            cols=col_index,
            source=torch.cat(source)[None],
        ))
    return out


def merge_rows(rows: list[SharedPrefixRow]) -> SharedPrefixRow:
    """Concatenate shared-prefix rows into one row (one forward pass): their masks go on the block diagonal, so no
    token attends across rows.

    Raises:
        ValueError: ``rows`` is empty.
    """
    if not rows:
        raise ValueError("merge_rows needs at least one row")
    if len(rows) == 1:
        return rows[0]
    sizes = [r.input_ids.shape[1] for r in rows]
    total = sum(sizes)
    first = rows[0].attention_mask
    mask = torch.full((total, total), torch.finfo(first.dtype).min, dtype=first.dtype, device=first.device)
    offsets, offset = [], 0
    for row, size in zip(rows, sizes, strict=True):
        mask[offset : offset + size, offset : offset + size] = row.attention_mask[0, 0]
        offsets.append(offset)
        offset += size
    return SharedPrefixRow(
        input_ids=torch.cat([r.input_ids for r in rows], dim=1),
        position_ids=torch.cat([r.position_ids for r in rows], dim=1),
        attention_mask=mask[None, None],
        logit_index=torch.cat([r.logit_index + o for r, o in zip(rows, offsets, strict=True)]),
        target_ids=torch.cat([r.target_ids for r in rows], dim=1),
        rows=torch.cat([r.rows for r in rows]),
        cols=torch.cat([r.cols for r in rows]),
        source=torch.cat([r.source for r in rows], dim=1),
    )
