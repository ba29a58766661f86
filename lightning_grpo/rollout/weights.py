"""The policy's weights as ``(hf_name, full_tensor)`` pairs, the form vLLM's checkpoint loader reads.

Used by :meth:`lightning_grpo.rollout.vllm.VLLMRolloutEngine.sync_weights` to push trained weights into a
running engine. Names are the Hugging Face checkpoint names (``model.layers.0.self_attn.q_proj.weight``,
``lm_head.weight``), which vLLM's ``load_weights`` maps onto its fused layers (qkv, gate_up) itself.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import Tensor

#: Name pieces added by wrappers around the HF module, removed so names match the checkpoint:
#: ``torch.compile`` (``_orig_mod``), activation checkpointing (``_checkpoint_wrapped_module``),
#: FSDP1 (``_fsdp_wrapped_module``) and DDP / DataParallel (leading ``module``).
WRAPPER_NAME_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def checkpoint_name(name: str) -> str:
    """The HF checkpoint name of a parameter of a (possibly wrapped) HF model.

    Example: ``module._orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight`` ->
    ``model.layers.0.mlp.up_proj.weight``.
    """
    parts = [part for part in name.split(".") if part not in WRAPPER_NAME_PARTS]
    if parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)


def full_tensor(tensor: Tensor) -> Tensor:
    """The whole, unsharded value of a parameter, detached.

    FSDP2 (``fully_shard``) parameters are ``DTensor`` shards: ``DTensor.full_tensor()`` all-gathers them,
    which is a collective, so every rank must call it in the same order. Plain tensors are returned as is
    (no copy).
    """
    full = getattr(tensor, "full_tensor", None)
    return (full() if callable(full) else tensor).detach()


def hf_weights(model: torch.nn.Module, tie_word_embeddings: bool) -> Iterator[tuple[str, Tensor]]:
    """Yield every parameter and persistent buffer of ``model`` as ``(hf_name, tensor)``, one at a time (so
    FSDP2 gathers one parameter at a time, never the whole model at once).

    Tied parameters appear once in ``named_parameters`` (as ``model.embed_tokens.weight``). When the
    checkpoint ties embeddings, ``lm_head.weight`` is yielded explicitly as well, with the embedding's
    value: vLLM's CPU backend keeps a pre-packed copy of the lm_head GEMM weight that is only rebuilt when
    ``lm_head.weight`` itself is loaded, so leaving it out would make the engine sample from the old head.

    Args:
        model: the Hugging Face causal LM being trained (``transformers.PreTrainedModel``), possibly wrapped
            by FSDP2, ``torch.compile``, activation checkpointing or DDP.
        tie_word_embeddings: whether the engine's model ties ``lm_head`` to the input embedding.

    Yields:
        ``(name, tensor)`` with the checkpoint name and the full, detached tensor (dtype and device of the
        model; vLLM casts on load).

    Raises:
        ValueError: if ``tie_word_embeddings`` is set and the model has no ``model.embed_tokens.weight``.
    """
    persistent = set(model.state_dict().keys())
    embedding: Tensor | None = None
    has_lm_head = False
    for name, param in model.named_parameters():
        hf_name = checkpoint_name(name)
        value = full_tensor(param)
        if hf_name == "model.embed_tokens.weight":
            embedding = value
        has_lm_head = has_lm_head or hf_name == "lm_head.weight"
        yield hf_name, value
    for name, buffer in model.named_buffers():
        if name in persistent:
            yield checkpoint_name(name), full_tensor(buffer)
    if tie_word_embeddings and not has_lm_head:
        if embedding is None:
            raise ValueError(
                "tie_word_embeddings=True but the model has no parameter named 'model.embed_tokens.weight'; "
                "cannot refresh lm_head.weight"
            )
        yield "lm_head.weight", embedding
