"""What a rollout engine with its own copy of the weights is given at each sync: :class:`PolicyWeights`, the trained
policy's weights as ``(hf_name, full_tensor)`` pairs, never the model (verl's ``update_weights(weights)`` is the
model of it).

The trainer's backend makes it (``ParallelBackend.configure`` -> ``GRPOModels.weights``): a LoRA policy's adapters
merged, FSDP2 ``DTensor`` shards gathered one tensor at a time, FSDP1's flat shards summoned, Megatron's tensor- and
pipeline-parallel shards gathered and converted to HF names. An engine reads the stream; it needs to know nothing of
PEFT, DTensor or megatron-core.
"""

from __future__ import annotations

import abc
from typing import Iterator, Sequence

import torch
from torch import Tensor

#: Why a separately trained head cannot be synced into an engine that ties it.
TIED_HEAD_ERROR = (
    "the engine's model ties lm_head to the input embedding (tie_word_embeddings=True, one matrix) but the policy "
    "trains a separate lm_head (e.g. LoRA modules_to_save=['lm_head'] on a tied checkpoint): the engine would "
    "sample from a head that is not the one trained. Keep the head tied (LoraConfig(ensure_weight_tying=True) or "
    "leave lm_head out of modules_to_save), or generate with the policy itself (GRPOConfig.engine.name='hf')"
)


class PolicyWeights(abc.ABC):
    """The trained policy's current weights, as an engine that loads weights by name reads them.

    :meth:`tensors` and :meth:`probe_logprobs` read the weights as they are when called (an engine that keeps a
    ``PolicyWeights`` to re-send them later, e.g. to a rollout server that restarted, sends the newer ones). When
    :attr:`collective` they are collectives over the trainer's processes (the backend gathers shards): every process
    calls them, in the same order, and reads :meth:`tensors` to the end, also those that send nothing (the rollout
    servers' client on ranks other than 0).
    """

    @abc.abstractmethod
    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        """Yield ``(hf_name, full_tensor)`` for every parameter and persistent buffer of the policy's HF checkpoint
        (``model.layers.0.self_attn.q_proj.weight``, ...), one at a time, detached, on the policy's device and in
        its dtype; with tied embeddings ``lm_head.weight`` is yielded as well, with the embedding's value (an engine
        that caches the head, such as vLLM's CPU backend, refreshes it only when that name is loaded).

        Raises:
            ValueError: the policy's weights cannot be given as an HF checkpoint (named in the message).
        """

    @abc.abstractmethod
    def probe_logprobs(self, sequences: Sequence[Sequence[int]]) -> Tensor:
        """``(S, L - 1)`` float32 CPU logprobs (temperature 1, no truncation, the full vocabulary) of each token of
        the ``S`` equal-length sequences of ``L`` token ids given the ones before it, under the policy: what the
        post-sync check (``engine.weight_sync_check``) compares an engine's teacher-forced logprobs with."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Token ids the policy's embedding knows (the probe batch draws below it)."""

    @property
    def separate_head(self) -> bool:
        """Whether the policy trains an ``lm_head`` of its own (not the input embedding's tensor): such weights
        cannot be synced into an engine whose model ties the two (:func:`check_tied_engine`)."""
        return False

    @property
    def collective(self) -> bool:
        """Whether reading them is a collective over the trainer's processes (sharded weights)."""
        return False

    @property
    def device(self) -> torch.device:
        """Where :meth:`tensors` are (a weight transfer over NCCL sends from there)."""
        return torch.device("cpu")


def check_tied_engine(weights: PolicyWeights, tie_word_embeddings: bool) -> None:
    """Refuse weights that an engine with ``tie_word_embeddings`` cannot hold exactly (called before any tensor is
    read: a reload that fails half-way leaves the engine broken).

    Raises:
        ValueError: :data:`TIED_HEAD_ERROR` when the engine ties and the policy has a separate head.
    """
    if tie_word_embeddings and weights.separate_head:
        raise ValueError(TIED_HEAD_ERROR)
