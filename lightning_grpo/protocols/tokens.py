"""Per-token fields: tensors laid out like a rollout's token ids, declared once on the records that hold them, so that
every cut, join, move and save of a rollout carries all of them the same way.

A record (:class:`~lightning_grpo.protocols.rollout.RolloutOutput`, the scored rollout of dynamic sampling, the
training :class:`~lightning_grpo.training.experience.Experience`) declares each of its token-aligned tensors with
:func:`token_meta` (``field(default=None, metadata=token_meta(layout, pad))``): which ids it is aligned with
(:class:`Layout`: the left-padded prompt or the right-padded completion) and the value of its padded positions (a
sentinel: ``-1`` for expert indices and policy versions, never a real value, so a value can never drift onto another
token: google/tunix PR #2046 is the failure this prevents). Its row-aligned tensors (one value per row) are declared
with :data:`ROW_META`. The generic operations here (select rows, concatenate rows, trim padding columns, move to a
device) then apply to every declared field, and a new per-token field (the sampler's logprobs, the policy version of
each token, the experts each token was routed to) is one declaration on each record that carries it, nothing more. The
trainer's forward layouts (padded, packed, shared prefix) arrange such values position by position like their input
ids (:func:`lightning_grpo.training.packing.arrange`).

Trailing dimensions are allowed: a field is ``(N, P, *trailing)`` or ``(N, T, *trailing)``; routed experts are
``(N, T, layers, top_k)``.

A field every record carries, whoever made it (``env_mask``: all 0 for a single-turn rollout), defaults to
:data:`UNSET`, and the record's ``__post_init__`` fills it (:func:`fill_unset`), so no reader asks whether it is
there.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import torch
from torch import Tensor

#: The metadata keys :func:`token_meta` and :data:`ROW_META` declare under.
TOKEN_FIELD = "lightning_grpo.token_field"
ROW_FIELD = "lightning_grpo.row_field"
#: A ``pad`` that means "the rollout's pad token id" (token ids are padded with the tokenizer's pad id).
PAD_ID = "pad_token_id"

Pad = Union[int, float, str]


class Layout(str, enum.Enum):
    """Which ids a per-token field is aligned with."""

    #: ``(N, P, ...)``: column ``j`` is prompt token ``j``; left-padded (the real tokens are the last ones).
    PROMPT = "prompt"
    #: ``(N, T, ...)``: column ``j`` is completion token ``j``; right-padded (the real tokens are the first ones).
    COMPLETION = "completion"


@dataclass(frozen=True)
class TokenField:
    """How one per-token field is laid out.

    Attributes:
        layout: the ids it is aligned with.
        pad: the value of padded positions: a number, or :data:`PAD_ID` for the rollout's pad token id.
        dtype: the field's dtype when it is built from plain values (a streaming engine's per-token ``extra`` lists);
            None: inferred from the values.
    """

    layout: Layout
    pad: Pad
    dtype: Optional[torch.dtype] = None

    def pad_value(self, pad_token_id: Optional[int]) -> Union[int, float]:
        """The padding value as a number.

        Raises:
            ValueError: the field pads with the pad token id and none is given.
        """
        if self.pad == PAD_ID:
            if pad_token_id is None:
                raise ValueError("this field is padded with the pad token id: pass pad_token_id")
            return pad_token_id
        assert not isinstance(self.pad, str)
        return self.pad


def token_meta(layout: Layout, pad: Pad, dtype: Optional[torch.dtype] = None) -> dict[str, TokenField]:
    """The ``metadata`` of a dataclass field that holds a per-token field:
    ``dataclasses.field(default=None, metadata=token_meta(Layout.COMPLETION, -1))`` (``dtype``:
    :attr:`TokenField.dtype`)."""
    return {TOKEN_FIELD: TokenField(layout, pad, dtype)}


#: The ``metadata`` of a dataclass field that holds a row-aligned tensor (``(N, ...)``: one value per row).
ROW_META: dict[str, bool] = {ROW_FIELD: True}

#: The default of a per-token field that every record carries, whoever made it
#: (``field(default=UNSET, metadata=token_meta(...))``, e.g. ``env_mask``): left unset, or given as None, it is filled
#: with its padding value by :func:`fill_unset` (the record's ``__post_init__``). Never a value itself.
UNSET: Tensor = torch.empty(0, dtype=torch.long)


def token_fields(record: Any) -> list[tuple[str, TokenField]]:
    """The per-token fields ``record`` (a dataclass or its class) declares (:func:`token_meta`), in declaration
    order."""
    return [(f.name, f.metadata[TOKEN_FIELD]) for f in dataclasses.fields(record) if TOKEN_FIELD in f.metadata]


def row_fields(record: Any) -> list[str]:
    """The row-aligned tensor fields ``record`` (a dataclass or its class) declares (:data:`ROW_META`), in
    declaration order."""
    return [f.name for f in dataclasses.fields(record) if ROW_FIELD in f.metadata]


def fill_unset(record: Any) -> None:
    """Fill each per-token field of ``record`` whose default is :data:`UNSET` and that was left unset or given as None:
    its padding value at every position of the ids it is aligned with (``(N, P)`` or ``(N, T)`` long, on their device),
    e.g. an all-zero ``env_mask`` for a single-turn rollout, which has no environment token."""
    for f in dataclasses.fields(record):
        spec = f.metadata.get(TOKEN_FIELD)
        if spec is None or f.default is not UNSET:
            continue
        value = getattr(record, f.name)
        if value is UNSET or value is None:
            ids = record.prompt_ids if spec.layout is Layout.PROMPT else record.completion_ids
            setattr(record, f.name, torch.full(tuple(ids.shape[:2]), spec.pad_value(None), dtype=torch.long,
                                               device=ids.device))


def pad_columns(tensor: Tensor, width: int, spec: TokenField, pad_token_id: Optional[int] = None) -> Tensor:
    """``tensor`` (``(N, W, ...)``) padded to ``width`` columns on its layout's padded side (left for a prompt
    field, right for a completion field) with the field's padding value.

    Raises:
        ValueError: ``width`` is smaller than ``W``.
    """
    missing = width - tensor.shape[1]
    if missing < 0:
        raise ValueError(f"cannot pad {tuple(tensor.shape)} to {width} columns: it is wider")
    if missing == 0:
        return tensor
    filler = torch.full((tensor.shape[0], missing, *tensor.shape[2:]), spec.pad_value(pad_token_id),
                        dtype=tensor.dtype, device=tensor.device)
    return torch.cat([filler, tensor] if spec.layout is Layout.PROMPT else [tensor, filler], dim=1)


def cat_rows(name: str, values: Sequence[Optional[Tensor]], spec: TokenField,
             pad_token_id: Optional[int] = None) -> Optional[Tensor]:
    """The rows of ``values`` (one field of several records) in order, each padded to the widest on its layout's
    side; None when every value is None.

    Raises:
        ValueError: some values are None and some are not (naming ``name``): a field cannot be dropped silently.
    """
    present = [v is not None for v in values]
    if not any(present):
        return None
    if not all(present):
        raise ValueError(f"{name}: some of the rollouts joined have it and some do not "
                         f"({sum(present)} of {len(values)}): it cannot be dropped or invented for the others")
    tensors = [v for v in values if v is not None]
    width = max(t.shape[1] for t in tensors)
    return torch.cat([pad_columns(t, width, spec, pad_token_id) for t in tensors])


def cat_row_values(name: str, values: Sequence[Optional[Tensor]]) -> Optional[Tensor]:
    """Row-aligned tensors of several records joined in order; None when every value is None.

    Raises:
        ValueError: some values are None and some are not (naming ``name``).
    """
    present = [v is not None for v in values]
    if not any(present):
        return None
    if not all(present):
        raise ValueError(f"{name}: some of the rollouts joined have it and some do not "
                         f"({sum(present)} of {len(values)})")
    return torch.cat([v for v in values if v is not None])


def select_rows(record: Any, rows: Tensor) -> dict[str, Any]:
    """The declared token and row fields of ``record`` restricted to ``rows`` (``(M,)`` long indices, in that order),
    as ``{name: tensor}`` for :func:`dataclasses.replace` (None fields left out)."""
    names = [name for name, _ in token_fields(record)] + row_fields(record)
    out: dict[str, Any] = {}
    for name in names:
        value = getattr(record, name)
        if value is not None:
            out[name] = value[rows.to(value.device)]
    return out


def trim_columns(record: Any, prompt_start: int, completion_end: int) -> dict[str, Any]:
    """The declared token fields of ``record`` with the prompt columns before ``prompt_start`` and the completion
    columns from ``completion_end`` on cut away (padding in every row), as ``{name: tensor}`` for
    :func:`dataclasses.replace`."""
    out: dict[str, Any] = {}
    for name, spec in token_fields(record):
        value = getattr(record, name)
        if value is not None:
            out[name] = value[:, prompt_start:] if spec.layout is Layout.PROMPT else value[:, :completion_end]
    return out


def fields_to(record: Any, device: torch.device) -> dict[str, Any]:
    """The declared token and row fields of ``record`` on ``device``, as ``{name: tensor}`` for
    :func:`dataclasses.replace`."""
    names = [name for name, _ in token_fields(record)] + row_fields(record)
    return {name: getattr(record, name).to(device) for name in names if getattr(record, name) is not None}


def check_aligned(record: Any, name: str = "rollout") -> None:
    """Check that every declared token field of ``record`` has the shape of the ids it is aligned with (its first two
    dimensions) and every row field one value per row.

    Raises:
        ValueError: naming the field, its shape and the expected one.
    """
    prompt = record.prompt_ids.shape[:2]
    completion = record.completion_ids.shape[:2]
    for field_name, spec in token_fields(record):
        value = getattr(record, field_name)
        if value is None:
            continue
        expected = prompt if spec.layout is Layout.PROMPT else completion
        if tuple(value.shape[:2]) != tuple(expected):
            raise ValueError(f"{name}.{field_name} has shape {tuple(value.shape)}: it must start with "
                             f"{tuple(expected)}, the shape of the {spec.layout.value} ids it is aligned with")
    for field_name in row_fields(record):
        value = getattr(record, field_name)
        if value is not None and value.shape[0] != completion[0]:
            raise ValueError(f"{name}.{field_name} has {value.shape[0]} rows, the rollout {completion[0]}")
