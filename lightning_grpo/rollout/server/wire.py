"""The rollout server's ``/generate`` wire format, both ways: the sampling fields a request sends and the per-token
lists an answer carries (the server builds the answer with :func:`completion_answer`, the trainer reads it back with
:func:`sampled_completions`).

An answer holds, for the ``B * G`` completions (prompt-major, unpadded), lists aligned token by token with
``token_ids``::

    {"token_ids": [[...], ...], "logprobs": [[...], ...], "versions": [[...], ...],
     "extra": {"<name>": [[...], ...], ...}, "version": <int>, "instance_id": "..."}

* ``logprobs``: the sampler's processed logprob of each token under the weights that sampled it;
* ``versions``: the weight version that produced each token (non-decreasing; two values or more when an in-flight
  update fell inside the completion: :mod:`lightning_grpo.rollout.server.async_engine`);
* ``extra``: any other per-token field by name, each a list per completion aligned with its ids, or with its prompt's
  ids when :class:`~lightning_grpo.protocols.rollout.RolloutOutput` declares the name as a prompt field
  (:data:`PROMPT_FIELDS`: the routed experts' ``prompt_routed_experts``, beside the completion-aligned
  ``completion_routed_experts``), carried as they are into
  :attr:`~lightning_grpo.protocols.streaming.SampledCompletion.extra`;
* ``version``: the oldest version of any token (the server's version when no token was sampled): the single
  version of an answer no update fell into, which is what a fixed schedule checks.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from lightning_grpo.protocols.rollout import RolloutOutput
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.protocols.streaming import SampledCompletion
from lightning_grpo.protocols.tokens import Layout, token_fields

#: The per-token fields aligned with a completion's prompt rather than its ids: those
#: :class:`~lightning_grpo.protocols.rollout.RolloutOutput` lays out like the prompt (the others are aligned with the
#: completion's ids).
PROMPT_FIELDS = frozenset(name for name, spec in token_fields(RolloutOutput) if spec.layout is Layout.PROMPT)


def sampling_fields(sampling: SamplingConfig) -> dict[str, Any]:
    """The ``sampling`` object of a ``/generate`` body: :class:`SamplingConfig`'s fields but ``seed`` (seeds travel
    per prompt); ``banned_token_ids`` only when set (servers before it refuse the field)."""
    fields: dict[str, Any] = dict(max_new_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
                                  top_p=sampling.top_p, top_k=sampling.top_k, min_p=sampling.min_p,
                                  greedy=sampling.greedy)
    if sampling.banned_token_ids:
        fields["banned_token_ids"] = list(sampling.banned_token_ids)
    return fields


def completion_answer(rows: Sequence[Sequence[Any]], version: int,
                      prompt_lengths: Optional[Sequence[int]] = None) -> dict[str, Any]:
    """The per-token part of a ``/generate`` answer from an engine's rows.

    Args:
        rows: one per completion, ``(token ids, logprobs)`` or ``(token ids, logprobs, fields)`` where ``fields``
            maps names to per-token lists, ``"versions"`` among them; rows without fields come from an engine whose
            weights cannot change during a call: their tokens carry ``version``. A field in :data:`PROMPT_FIELDS`
            is aligned with the row's prompt.
        version: the server's weight version now.
        prompt_lengths: each row's prompt length (the ids the engine ran), for the prompt-aligned fields.

    Raises:
        ValueError: a field not aligned with its row's ids (or its prompt's), a prompt-aligned field without
            ``prompt_lengths``, or rows that name different fields.
    """
    if prompt_lengths is not None and len(prompt_lengths) != len(rows):
        raise ValueError(f"{len(prompt_lengths)} prompt lengths for {len(rows)} completions")
    token_ids, logprobs, versions = [], [], []
    extra: dict[str, list[list[Any]]] = {}
    names = None
    for i, row in enumerate(rows):
        ids, lps, *more = row
        fields = dict(more[0]) if more else {"versions": [int(version)] * len(ids)}
        if names is None:
            names = sorted(fields)
            extra = {name: [] for name in names if name != "versions"}
        if sorted(fields) != names or "versions" not in fields:
            raise ValueError(f"completion {i} has per-token fields {sorted(fields)}, the first {names}: every "
                             "completion carries the same fields, 'versions' among them")
        for name, values in fields.items():
            _check_aligned(i, name, len(values), len(ids), None if prompt_lengths is None else prompt_lengths[i])
        token_ids.append([int(t) for t in ids])
        logprobs.append([float(x) for x in lps])
        versions.append([int(v) for v in fields.pop("versions")])
        for name, values in fields.items():
            extra[name].append(list(values))
    oldest = min((v[0] for v in versions if v), default=int(version))
    return dict(token_ids=token_ids, logprobs=logprobs, versions=versions, extra=extra, version=oldest)


def _check_aligned(row: int, name: str, count: int, num_ids: int, prompt_length: Optional[int]) -> None:
    """``count`` values of field ``name`` of completion ``row`` are one per token id, or one per prompt token for a
    field of :data:`PROMPT_FIELDS`.

    Raises:
        ValueError: they are not (or a prompt field's prompt length is unknown).
    """
    if name not in PROMPT_FIELDS:
        if count != num_ids:
            raise ValueError(f"completion {row}: {count} {name} for {num_ids} token ids")
    elif prompt_length is None:
        raise ValueError(f"completion {row} carries {name}, aligned with its prompt: give the prompt_lengths")
    elif count != prompt_length:
        raise ValueError(f"completion {row}: {count} {name} for a prompt of {prompt_length} token ids")


def sampled_completions(answer: dict[str, Any], eos_token_ids: Sequence[int]) -> list[SampledCompletion]:
    """The completions of a ``/generate`` answer as :class:`SampledCompletion` records (``finish_reason`` "stop"
    when the last token is an EOS id, else "length"), ``extra`` split per completion.

    Raises:
        ValueError: lists of other lengths than ``token_ids`` (the answer is malformed).
    """
    count = len(answer["token_ids"])
    extra = answer.get("extra") or {}
    for name, lists in [("logprobs", answer["logprobs"]), ("versions", answer["versions"]), *extra.items()]:
        if len(lists) != count:
            raise ValueError(f"the answer has {len(lists)} {name} lists for {count} completions")
    eos = set(int(t) for t in eos_token_ids)
    return [SampledCompletion(token_ids=list(ids), logprobs=list(lps), versions=list(vs),
                              finish_reason="stop" if ids and ids[-1] in eos else "length",
                              extra={name: list(lists[i]) for name, lists in extra.items()})
            for i, (ids, lps, vs) in enumerate(zip(answer["token_ids"], answer["logprobs"], answer["versions"],
                                                   strict=True))]
