"""The weight-source protocol: a policy that gives its weights as ``(hf_name, full_tensor)`` pairs instead of being a
transformers module (the Megatron policy), for the engines that load weights by name."""

from __future__ import annotations

import abc
from typing import Iterator, Sequence

from torch import Tensor


class HFWeightSource(abc.ABC):
    """A policy that is not a transformers module but gives its weights under HF checkpoint names (the Megatron
    policy, whose tensor- and pipeline-parallel shards are gathered one tensor at a time). The engines that load
    weights by name (colocated vLLM, the rollout servers) take such a policy wherever they take an HF model: they
    iterate :meth:`hf_weights` instead of the module's parameters, and the servers' post-sync check scores its
    probe batch with :meth:`teacher_forced_logprobs`.

    Both methods are collectives over the policy's model-parallel group: every rank of it calls them, in the same
    order (so the rollout server engine makes every rank iterate the weights while rank 0 sends them).
    """

    @abc.abstractmethod
    def hf_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Yield ``(hf_name, full_tensor)`` for every tensor of the HF checkpoint, one at a time, with
        ``lm_head.weight`` (the embedding's value) last when the embeddings are tied. Iterate it to the end."""

    @abc.abstractmethod
    def teacher_forced_logprobs(self, sequences: Sequence[Sequence[int]]) -> Tensor:
        """``(S, L - 1)`` float32 CPU logprobs (temperature 1, no truncation) of each token of the ``S`` sequences of
        ``L`` token ids given the tokens before it: what ``policy(ids).logits`` gives an HF model."""
