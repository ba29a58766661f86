"""Routed experts as plain per-row fields and back (routing replay "R3" with an engine that holds its own weights: the
colocated vLLM engine, the rollout servers and their client): one completion's routing as two per-token fields,
``prompt_routed_experts`` aligned with its prompt's ids and ``completion_routed_experts`` aligned with its completion's
ids (``(length, moe_layers, top_k)`` int16, :data:`~lightning_grpo.protocols.routing.NO_EXPERT` where nothing was
computed), the names of :class:`~lightning_grpo.protocols.rollout.RolloutOutput`'s fields; a server's answer carries
them by those names among its per-token ``extra`` fields, as nested lists. :func:`with_routed_experts` lays them out
like the rollout's ids (prompts left-padded, completions right-padded, ``-1`` at every pad).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from lightning_grpo.protocols.rollout import RolloutOutput
from lightning_grpo.protocols.routing import NO_EXPERT, ROUTED_DTYPE, mask_routed

#: The per-token fields of a completion's routing: (name, aligned with the prompt).
ROUTED_FIELDS = (("prompt_routed_experts", True), ("completion_routed_experts", False))


def routing_fields(sequence: np.ndarray, prompt_length: int, completion_length: int) -> dict[str, np.ndarray]:
    """One completion's routing fields from its routing by sequence position (``(positions, moe_layers, top_k)``:
    the prompt's tokens, then the completion's; a completion's last token is never fed to the model, so it and any
    position past ``positions`` get :data:`NO_EXPERT`).

    Raises:
        ValueError: fewer positions than the prompt has tokens, or more than prompt and completion.
    """
    sequence = np.asarray(sequence, dtype=np.int16)
    if not prompt_length <= len(sequence) <= prompt_length + completion_length:
        raise ValueError(f"the routing covers {len(sequence)} positions for a prompt of {prompt_length} tokens and a "
                         f"completion of {completion_length}: it must cover the prompt and at most the completion")
    completion = np.full((completion_length, *sequence.shape[1:]), NO_EXPERT, dtype=np.int16)
    fed = sequence[prompt_length:]
    completion[: len(fed)] = fed
    return {"prompt_routed_experts": sequence[:prompt_length], "completion_routed_experts": completion}


def with_routed_experts(output: RolloutOutput, fields: Sequence[Mapping[str, Any]]) -> RolloutOutput:
    """``output`` with its ``prompt_routed_experts`` ``(N, P, moe_layers, top_k)`` and ``completion_routed_experts``
    ``(N, T, moe_layers, top_k)`` :data:`ROUTED_DTYPE` from each row's fields (arrays or nested lists, aligned with
    the row's unpadded prompt and completion ids), :data:`NO_EXPERT` at every pad.

    Raises:
        ValueError: not one entry per row, a row without both fields, or a field not aligned with its ids (the row is
            named).
    """
    n = len(output)
    if len(fields) != n:
        raise ValueError(f"{len(fields)} rows of routed experts for a rollout of {n} rows")
    prompt_lengths = output.prompt_mask.sum(dim=1).tolist()
    completion_lengths = output.completion_mask.sum(dim=1).tolist()
    shape = None
    values: dict[str, list[np.ndarray]] = {name: [] for name, _ in ROUTED_FIELDS}
    for row, row_fields in enumerate(fields):
        for name, on_prompt in ROUTED_FIELDS:
            if name not in row_fields:
                raise ValueError(f"row {row} has no {name}")
            value = np.asarray(row_fields[name], dtype=np.int16)
            length = int(prompt_lengths[row] if on_prompt else completion_lengths[row])
            if value.ndim != 3 or len(value) < length or (on_prompt and len(value) != length) \
                    or (shape is not None and value.shape[1:] != shape):
                raise ValueError(f"row {row}: {name} has shape {value.shape}, expected ({length}, moe_layers, top_k) "
                                 "aligned with its ids")
            shape = value.shape[1:]
            values[name].append(value[:length] if not on_prompt else value)
    assert shape is not None
    prompt_width, completion_width = output.prompt_ids.shape[1], output.completion_ids.shape[1]
    prompt = torch.full((n, prompt_width, *shape), NO_EXPERT, dtype=ROUTED_DTYPE)
    completion = torch.full((n, completion_width, *shape), NO_EXPERT, dtype=ROUTED_DTYPE)
    for row in range(n):
        p = values["prompt_routed_experts"][row]
        c = values["completion_routed_experts"][row]
        if len(p):
            prompt[row, prompt_width - len(p):] = torch.from_numpy(p)
        completion[row, : len(c)] = torch.from_numpy(c)
    return replace(output, prompt_routed_experts=mask_routed(prompt, output.prompt_mask),
                   completion_routed_experts=mask_routed(completion, output.completion_mask))


def routing_extra(fields: Sequence[Mapping[str, np.ndarray]]) -> dict[str, list]:
    """The routing of a server's completions as per-token ``extra`` fields of its answer: ``{name: [one nested list
    per completion]}``."""
    return {name: [np.asarray(f[name]).tolist() for f in fields] for name, _ in ROUTED_FIELDS}


def routing_from_extra(extra: Mapping[str, Sequence[Any]], count: int) -> list[dict[str, Any]]:
    """Each of ``count`` completions' routing fields from an answer's ``extra``.

    Raises:
        ValueError: a routing field missing or not one entry per completion.
    """
    for name, _ in ROUTED_FIELDS:
        if len(extra.get(name, ())) != count:
            raise ValueError(f"the answer's extra.{name} has {len(extra.get(name, ()))} entries for {count} "
                             "completions")
    return [{name: extra[name][i] for name, _ in ROUTED_FIELDS} for i in range(count)]
