"""A transformers causal LM's forward pass that returns token logprobs (and entropy) instead of logits: the output
layer is bypassed by two hooks and :func:`lightning_grpo.training.lm_head.chunked_token_logprobs` runs on its input,
so the ``[K, V]`` logits of the scored positions never exist at once (forward or backward).

The hooks run inside the model's own forward call, so every wrapper that acts there keeps working: FSDP2/FSDP1
(the output layer's weight is read while the wrapper has gathered it; its gradient reaches the sharded parameter),
autocast, PEFT adapters of the decoder layers, gradient checkpointing of the decoder layers. The forward-pre hook
stashes the hidden states and hands the layer an empty ``(B, 0, H)`` input (no matmul); the forward hook returns
``(B, S, 2)`` float32 ``[logprob, entropy]`` per position as the model's "logits".

This is exact only for models whose forward applies nothing after the output layer (no logit soft-capping or
scaling): :data:`PLAIN_HEAD_MODEL_TYPES` lists the ``config.model_type`` values checked in transformers' sources
(``logits = self.lm_head(hidden_states[:, slice_indices, :])`` then ``loss = None``; a test re-checks them).
Other models, and an output layer that is not a plain ``nn.Linear`` (a LoRA-adapted lm_head), keep the full logits.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import Tensor, nn

from lightning_grpo.training.lm_head import chunked_token_logprobs

log = logging.getLogger(__name__)

#: ``config.model_type`` values whose causal-LM forward returns ``lm_head(hidden)`` unchanged (transformers 5.x).
#: Not here (they scale or soft-cap the logits): gemma2/3, cohere, granite, ...
PLAIN_HEAD_MODEL_TYPES = frozenset({
    "llama", "mistral", "mixtral", "ministral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi", "phi3", "olmo",
    "olmo2", "olmo3", "olmoe", "gemma", "smollm3", "deepseek_v3", "glm", "glm4", "starcoder2", "stablelm", "gpt_neox",
    "seed_oss", "exaone4", "ernie4_5", "apertus", "arcee", "gpt_oss", "qwen3_5_text",
    "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava",  # vision-language: the same head after the language model
})

_warned: set[str] = set()


@dataclass
class Truncation:
    """The sampling distribution the logprobs are of: banned tokens removed, temperature, then min-p / top-k / top-p
    (vLLM's order)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    banned_token_ids: tuple[int, ...] = ()


def plain_output_layer(model: nn.Module) -> Optional[nn.Linear]:
    """The output layer of ``model`` when the chunked logprobs are exact for it (a plain ``nn.Linear`` of a model
    type in :data:`PLAIN_HEAD_MODEL_TYPES`), else None (logged once per model type)."""
    config = getattr(model, "config", None)
    model_type = str(getattr(config, "model_type", ""))
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if model_type in PLAIN_HEAD_MODEL_TYPES and type(head) is nn.Linear:
        return head
    if model_type not in _warned:
        _warned.add(model_type)
        log.warning("chunked lm_head logprobs are off for %s (model_type %r, output layer %s): its logits are "
                    "computed in full (GRPOConfig.lm_head_chunk_size)", type(model).__name__, model_type,
                    type(head).__name__)
    return None


@contextlib.contextmanager
def scoring_head(head: nn.Linear, targets: Tensor, select: Tensor, truncation: Truncation, with_entropy: bool,
                 entropy_grad: bool, chunk_size: int) -> Iterator[None]:
    """While active, ``head`` (the model's output layer) returns ``(B, S, 2)`` float32 ``[logprob, entropy]`` of
    ``targets`` at the positions ``select`` (zeros elsewhere; entropy 0 without ``with_entropy``) instead of its
    ``(B, S, V)`` logits.

    Args:
        head: the output layer (:func:`plain_output_layer`).
        targets: ``(B, S)`` long, the token each input position of ``head`` predicts.
        select: ``(B, S)`` bool, the positions to score.
        truncation: temperature and truncation of the distribution.
        with_entropy, entropy_grad, chunk_size: see :func:`~lightning_grpo.training.lm_head.chunked_token_logprobs`.

    Raises:
        ValueError: (at the forward call) the output layer's input is not ``(B, S, H)`` with ``(B, S)`` of
            ``targets``.
    """
    stash: list[Tensor] = []

    def keep_input(module: nn.Module, args: tuple) -> tuple:
        hidden = args[0]  # [B, S, H]
        if hidden.shape[:-1] != targets.shape:
            raise ValueError(f"the output layer's input {tuple(hidden.shape)} does not match the scored targets "
                             f"{tuple(targets.shape)}")
        stash.append(hidden)
        return (hidden[..., :0, :],) + tuple(args[1:])  # an empty matmul

    def score(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        hidden = stash.pop()  # [B, S, H]
        rows, cols = select.nonzero(as_tuple=True)  # [M]
        logprobs, entropy = chunked_token_logprobs(
            hidden[rows, cols], module.weight, targets[rows, cols], module.bias, truncation.temperature,
            top_k=truncation.top_k, top_p=truncation.top_p, min_p=truncation.min_p, with_entropy=with_entropy,
            entropy_grad=entropy_grad, chunk_size=chunk_size, banned_token_ids=truncation.banned_token_ids,
        )  # [M], [M]
        values = torch.stack([logprobs, entropy if entropy is not None else torch.zeros_like(logprobs)], dim=-1)
        scores = hidden.new_zeros((*targets.shape, 2), dtype=torch.float32)  # [B, S, 2]
        return scores.index_put((rows, cols), values)

    handles = [head.register_forward_pre_hook(keep_input), head.register_forward_hook(score)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        stash.clear()
