"""The policy's weights as ``(hf_name, full_tensor)`` pairs, the form vLLM's checkpoint loader reads.

The backends stream them to the engines that hold their own copy of the weights (colocated vLLM, the rollout servers:
:class:`lightning_grpo.strategies.module_weights.ModuleWeights`, a
:class:`~lightning_grpo.protocols.weights.PolicyWeights`). Names are the Hugging Face checkpoint names
(``model.layers.0.self_attn.q_proj.weight``, ``lm_head.weight``), which vLLM's ``load_weights`` maps onto its fused
layers (qkv, gate_up) itself.

A PEFT LoRA policy (:mod:`lightning_grpo.models.lora`) is sent merged: each LoRA-adapted linear layer as
``W0 + scaling * B @ A`` (Hu et al. 2021, "LoRA", arXiv:2106.09685, eq. 3), computed from the weights without
touching the trained module (:func:`merge_lora`), under the base model's names; the adapters' own tensors are not
sent. The same function gives the merged HF export.

A model whose tensors transformers converts at load (its weight converters: the experts of a mixture-of-experts
family, fused in memory as ``mlp.experts.gate_up_proj`` ``(E, 2I, H)`` and ``mlp.experts.down_proj`` ``(E, H, I)``
where the checkpoint has ``mlp.experts.<e>.gate_proj.weight`` etc., or Mixtral's ``block_sparse_moe.experts.<e>.w1``)
is sent in its checkpoint layout: each tensor through transformers' own reversal of that conversion
(:func:`checkpoint_layout`, what ``save_pretrained`` writes), the layout every vLLM loader reads: vLLM 0.32's
Qwen3-MoE and OLMoE loaders also take the fused tensors, but its Mixtral loader refuses the in-memory ``mlp`` names
(``There is no module or parameter named 'layers.0.mlp' in MixtralModel``).
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator, Mapping, Optional

import torch
from torch import Tensor, nn

from lightning_grpo.protocols.weights import TIED_HEAD_ERROR

#: Name pieces added by wrappers around the HF module, removed so names match the checkpoint:
#: ``torch.compile`` (``_orig_mod``), activation checkpointing (``_checkpoint_wrapped_module``),
#: FSDP1 (``_fsdp_wrapped_module``) and DDP / DataParallel (leading ``module``).
WRAPPER_NAME_PARTS = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
#: Name pieces of PEFT's tensors that a merged model does not have: the adapters and the frozen original of a
#: ``modules_to_save`` module (its trained copy is ``<module>.modules_to_save.<adapter>``).
ADAPTER_NAME_PARTS = frozenset(
    {"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector", "original_module"}
)
#: Prefix of a ``peft.PeftModel``'s names in front of the base model's own.
PEFT_PREFIX = "base_model.model."


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


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The PEFT LoRA layers of ``model`` (``peft.tuners.lora.LoraLayer``: modules with ``base_layer``, ``lora_A``,
    ``lora_B`` and ``scaling``) by :func:`checkpoint_name` of their module name; empty for a plain model."""
    keys = ("base_layer", "lora_A", "lora_B", "scaling")
    return {checkpoint_name(n): m for n, m in model.named_modules() if all(hasattr(m, k) for k in keys)}


def lora_delta(name: str, layer: nn.Module, value: Callable[[str], Tensor]) -> Tensor | None:
    """``sum over active adapters a of scaling[a] * B_a @ A_a`` (float32, ``(out, in)``; transposed for
    ``fan_in_fan_out``) of the LoRA layer ``name``, reading ``A_a``, ``B_a`` with ``value(tensor name)``; None when
    its adapters are disabled (the layer computes ``W0 x`` only).

    Raises:
        ValueError: the layer's adapters are merged into ``W0`` already (``merge_adapter``).
        NotImplementedError: an adapter that is not plain LoRA on a linear layer (DoRA and other variants,
            ``lora_bias``, embedding or convolution LoRA): name and reason in the message.
    """
    if getattr(layer, "disable_adapters", False):
        return None
    if getattr(layer, "merged", False):
        raise ValueError(f"LoRA layer {name}: its adapters are merged into the base weight (merge_adapter); unmerge")
    delta = None
    for adapter in layer.active_adapters:
        if adapter in getattr(layer, "lora_embedding_A", {}) or adapter in getattr(layer, "lora_variant", {}) \
                or getattr(layer, "lora_bias", {}).get(adapter, False) or adapter not in layer.lora_A:
            raise NotImplementedError(f"LoRA layer {name} ({type(layer).__name__}), adapter {adapter!r}: merged "
                                      "weights are computed for plain LoRA on linear layers only (no DoRA or other "
                                      "variants, no lora_bias, no embedding or convolution LoRA)")
        a = value(f"{name}.lora_A.{adapter}.weight").float()  # (r, in)
        b = value(f"{name}.lora_B.{adapter}.weight").float()  # (out, r)
        term = (b @ a) * layer.scaling[adapter]
        term = term.T if getattr(layer, "fan_in_fan_out", False) else term
        delta = term if delta is None else delta + term
    return delta


def merge_lora(names: Iterable[str], layers: Mapping[str, nn.Module],
               value: Callable[[str], Tensor]) -> Iterator[tuple[str, Tensor]]:
    """The tensors ``names`` (in :func:`checkpoint_name` form) of a model under the names of its plain HF model, with
    LoRA merged: ``<layer>.base_layer.weight`` of each layer in ``layers`` becomes ``<layer>.weight`` =
    ``W0 + lora_delta`` (added in float32, returned in ``W0``'s dtype), ``<module>.modules_to_save.<adapter>.*``
    becomes ``<module>.*``, the adapters' tensors and ``original_module`` copies are skipped and the PEFT prefix
    ``base_model.model.`` is removed. Without LoRA layers every name passes unchanged. ``value(name)`` is called
    once per kept tensor, in order (a collective for FSDP2 ``DTensor`` shards: every rank calls in the same order),
    and for the ``A``, ``B`` of each merged layer.

    Raises:
        ValueError: a LoRA layer's base weight is not floating point (a 4/8-bit quantized base); see also
            :func:`lora_delta`.
        NotImplementedError: LoRA on a parameter rather than a linear layer (PEFT's ``target_parameters``: what
            ``target_modules="all-linear"`` makes of a mixture-of-experts' fused experts and router), whose merged
            tensors are not computed here (they would be streamed unmerged, under the wrong names).
    """
    on_parameters = sorted(n for n, layer in layers.items() if getattr(layer, "parameter_name", None))
    if on_parameters:
        more = " ..." if len(on_parameters) > 3 else ""
        raise NotImplementedError(
            f"LoRA adapts parameters, not linear layers, at {on_parameters[:3]}{more} (PEFT target_parameters, "
            "e.g. a mixture-of-experts' experts and router under target_modules='all-linear'): their merged weights "
            "for an engine with its own copy are not computed; use engine.name='hf', or name the attention "
            "projections in target_modules")
    for name in names:
        parts = name.split(".")
        if not layers:
            yield name, value(name)
            continue
        if ADAPTER_NAME_PARTS.intersection(parts):
            continue
        if "modules_to_save" in parts:  # <module>.modules_to_save.<adapter>.<tensor>
            i = parts.index("modules_to_save")
            parts = parts[:i] + parts[i + 2 :]
        tensor = value(name)
        if "base_layer" in parts:  # <layer>.base_layer.<tensor>
            i = parts.index("base_layer")
            owner, parts = ".".join(parts[:i]), parts[:i] + parts[i + 1 :]
            if name.endswith(".base_layer.weight") and owner in layers:
                if not tensor.is_floating_point():
                    raise ValueError(f"{name} has dtype {tensor.dtype}: merged weights of a quantized base "
                                     "(GRPOModule quantization) are not computed")
                delta = lora_delta(owner, layers[owner], value)
                if delta is not None:
                    tensor = (tensor.float() + delta.to(tensor.device)).to(tensor.dtype)
        yield ".".join(parts).removeprefix(PEFT_PREFIX), tensor


def merged_state_dict(model: nn.Module, state_dict: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
    """The plain HF state dict of a LoRA ``model`` with the adapters merged (:func:`merge_lora`), from
    ``state_dict`` (its full state dict, e.g. gathered from FSDP shards) or ``model.state_dict()``."""
    state = {checkpoint_name(k): v for k, v in (model.state_dict() if state_dict is None else state_dict).items()}
    return dict(merge_lora(state, lora_layers(model), state.__getitem__))


def has_separate_head(model: nn.Module) -> bool:
    """Whether ``model`` has an ``lm_head.weight`` of its own under its plain HF names (a parameter that is not the
    input embedding's tensor, e.g. the trained copy of LoRA's ``modules_to_save=["lm_head"]``); a tied head is the
    embedding's parameter, listed once."""
    for name, _ in model.named_parameters():
        parts = checkpoint_name(name).removeprefix(PEFT_PREFIX).split(".")
        if "original_module" in parts:
            continue
        if "modules_to_save" in parts:
            i = parts.index("modules_to_save")
            parts = parts[:i] + parts[i + 2 :]
        if ".".join(parts) == "lm_head.weight":
            return True
    return False


def check_syncable(model: nn.Module, tie_word_embeddings: bool) -> None:
    """Refuse weights that an engine with ``tie_word_embeddings`` cannot hold exactly.

    Raises:
        ValueError: :data:`TIED_HEAD_ERROR` when the engine ties and ``model`` has a separate head.
    """
    if tie_word_embeddings and has_separate_head(model):
        raise ValueError(TIED_HEAD_ERROR)


def checkpoint_layout(model: nn.Module) -> Optional[Callable[[str, Tensor], dict[str, Tensor]]]:
    """How a tensor of ``model`` (by its name in the plain HF model's state dict) is laid out in the model's
    checkpoint: a function ``(name, tensor) -> {checkpoint name: tensor}`` (transformers'
    ``revert_weight_conversion`` of that one tensor: a fused experts tensor becomes one tensor per expert and
    projection, views of it), or None when transformers converts no tensor of this model at load (only renamings,
    if any: the names are kept, as vLLM's loaders map them).

    ``model`` may be wrapped (PEFT, FSDP, DDP): its first ``transformers.PreTrainedModel`` module is the one whose
    conversions apply."""
    from transformers import PreTrainedModel
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, revert_weight_conversion

    pretrained = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    if pretrained is None:
        return None
    conversions = getattr(pretrained, "_weight_conversions", None)  # set by from_pretrained
    if conversions is None:
        conversions = get_model_conversion_mapping(pretrained, add_legacy=False)
    if not any(isinstance(c, WeightConverter) for c in conversions):
        return None
    return lambda name, tensor: revert_weight_conversion(pretrained, {name: tensor})


def hf_weights(model: torch.nn.Module, tie_word_embeddings: bool) -> Iterator[tuple[str, Tensor]]:
    """Yield every parameter and persistent buffer of ``model`` as ``(hf_name, tensor)``, one at a time (so
    FSDP2 gathers one parameter at a time, never the whole model at once).

    A PEFT LoRA model is yielded merged, under the base model's names (:func:`merge_lora`).

    A model whose tensors transformers converts at load (the fused experts of a mixture of experts) is yielded in its
    checkpoint layout (:func:`checkpoint_layout`: one tensor per expert and projection, under the checkpoint's names).

    Tied parameters appear once in ``named_parameters`` (as ``model.embed_tokens.weight``). When the
    checkpoint ties embeddings, ``lm_head.weight`` is yielded explicitly as well, with the embedding's
    value: vLLM's CPU backend keeps a pre-packed copy of the lm_head GEMM weight that is only rebuilt when
    ``lm_head.weight`` itself is loaded, so leaving it out would make the engine sample from the old head.

    Args:
        model: the Hugging Face causal LM being trained (``transformers.PreTrainedModel``), possibly wrapped
            by FSDP2, ``torch.compile``, activation checkpointing or DDP.
        tie_word_embeddings: whether the model ties ``lm_head`` to the input embedding (its checkpoint's config;
            an engine loaded from that checkpoint ties them too).

    Yields:
        ``(name, tensor)`` with the checkpoint name and the full, detached tensor (dtype and device of the
        model; vLLM casts on load).

    Raises:
        ValueError: if ``tie_word_embeddings`` is set and the model has no ``model.embed_tokens.weight``, or has a
            separately trained ``lm_head`` (:func:`check_syncable`; raised before anything is yielded).
    """
    check_syncable(model, tie_word_embeddings)
    persistent = set(model.state_dict().keys())
    tensors = {checkpoint_name(name): param for name, param in model.named_parameters()}
    tensors.update({checkpoint_name(name): b for name, b in model.named_buffers() if name in persistent})
    embedding: Tensor | None = None
    has_lm_head = False
    layout = checkpoint_layout(model)
    for hf_name, value in merge_lora(tensors, lora_layers(model), lambda name: full_tensor(tensors[name])):
        if hf_name == "model.embed_tokens.weight":
            embedding = value
        has_lm_head = has_lm_head or hf_name == "lm_head.weight"
        if layout is None:
            yield hf_name, value
        else:
            yield from layout(hf_name, value).items()
    if tie_word_embeddings and not has_lm_head:
        if embedding is None:
            raise ValueError(
                "tie_word_embeddings=True but the model has no parameter named 'model.embed_tokens.weight'; "
                "cannot refresh lm_head.weight"
            )
        yield "lm_head.weight", embedding
