"""Weights between Hugging Face Llama-family checkpoints and megatron-core ``GPTModel`` shards.

Each megatron-core parameter is made from one or more HF tensors (:class:`ParamMap`), split for tensor
parallelism (TP) in one of five ways:

- ``replicated``: RMSNorm weights, the same on every TP rank.
- ``vocab``: the embedding and the untied output layer, split along the vocabulary (dim 0): rank r holds
  rows ``[r V/TP, (r+1) V/TP)`` (``VocabParallelEmbedding`` / ``ColumnParallelLinear``).
- ``row``: ``o_proj`` -> ``linear_proj`` and ``down_proj`` -> ``linear_fc2`` (``RowParallelLinear``), split along
  the input features (dim 1).
- ``qkv``: ``q_proj``, ``k_proj``, ``v_proj`` -> one fused ``linear_qkv`` (weight ``((nq + 2 nkv) d / TP, H)``,
  and bias for Qwen2). megatron-core orders the rows by query group: for each of the ``nkv`` groups, its
  ``nq / nkv`` query heads, then its key head, then its value head (``d`` rows each); rank r holds whole
  groups ``[r nkv/TP, (r+1) nkv/TP)``.
- ``gate_up``: ``gate_proj``, ``up_proj`` -> ``linear_fc1`` (weight ``(2 F / TP, H)``): rank r holds
  ``[gate rows of r; up rows of r]`` (the SwiGLU applies silu to the first half).

The conversions only slice, reshape and concatenate, so HF -> megatron-core -> HF is bit-exact.
Names are those of megatron-core's local layer spec; with the Transformer Engine spec the two RMSNorms of a
layer live inside the following linear (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor

from lightning_grpo.strategies.megatron.model import Architecture

KINDS = ("replicated", "vocab", "row", "qkv", "gate_up")


@dataclass(frozen=True)
class ParamMap:
    """One megatron-core parameter and the HF tensors it is made of.

    Attributes:
        mcore: the megatron-core name (``decoder.layers.0.self_attention.linear_qkv.weight``).
        hf: the HF names, in the order the kind concatenates them (q, k, v / gate, up).
        kind: one of :data:`KINDS`.
    """

    mcore: str
    hf: tuple[str, ...]
    kind: str


def param_maps(arch: Architecture, transformer_engine: bool = False) -> list[ParamMap]:
    """Every megatron-core parameter of ``arch``'s ``GPTModel`` with its HF source (output layer only when
    the embeddings are untied)."""
    maps = [ParamMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")]
    input_norm = "self_attention.linear_qkv.layer_norm_weight" if transformer_engine else "input_layernorm.weight"
    mlp_norm = "mlp.linear_fc1.layer_norm_weight" if transformer_engine else "pre_mlp_layernorm.weight"
    for i in range(arch.num_layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        maps += [
            ParamMap(m + input_norm, (h + "input_layernorm.weight",), "replicated"),
            ParamMap(m + "self_attention.linear_qkv.weight",
                     tuple(h + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv"),
        ]
        if arch.qkv_bias:
            maps.append(ParamMap(m + "self_attention.linear_qkv.bias",
                                 tuple(h + f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv"))
        maps += [
            ParamMap(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), "row"),
            ParamMap(m + mlp_norm, (h + "post_attention_layernorm.weight",), "replicated"),
            ParamMap(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"), "gate_up"),
            ParamMap(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "row"),
        ]
    maps.append(ParamMap("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
    if not arch.tie_word_embeddings:
        maps.append(ParamMap("output_layer.weight", ("lm_head.weight",), "vocab"))
    return maps


def shard(pm: ParamMap, tensors: Sequence[Tensor], arch: Architecture, tp_rank: int, tp_size: int) -> Tensor:
    """This TP rank's megatron-core tensor made from the HF tensors ``tensors`` (in ``pm.hf`` order).

    Raises:
        ValueError: wrong number of tensors, or a shape that does not split evenly.
    """
    if len(tensors) != len(pm.hf):
        raise ValueError(f"{pm.mcore} is made of {len(pm.hf)} HF tensors {pm.hf}, got {len(tensors)}")
    if pm.kind == "replicated":
        return tensors[0]
    if pm.kind == "vocab":
        return _chunk(tensors[0], 0, tp_rank, tp_size, pm.hf[0])
    if pm.kind == "row":
        return _chunk(tensors[0], 1, tp_rank, tp_size, pm.hf[0])
    if pm.kind == "qkv":
        q, k, v = tensors
        d, groups = arch.head_dim, arch.num_query_groups
        rest = q.shape[1:]  # (H,) for weights, () for biases
        fused = torch.cat([q.reshape(groups, arch.heads_per_group * d, *rest), k.reshape(groups, d, *rest),
                           v.reshape(groups, d, *rest)], dim=1)  # [nkv, (nq/nkv + 2) d, *rest]
        return _chunk(fused, 0, tp_rank, tp_size, pm.mcore).reshape(-1, *rest)
    if pm.kind == "gate_up":
        gate, up = tensors
        return torch.cat([_chunk(gate, 0, tp_rank, tp_size, pm.hf[0]), _chunk(up, 0, tp_rank, tp_size, pm.hf[1])])
    raise ValueError(f"ParamMap.kind={pm.kind!r}: choose one of {KINDS}")


def unshard(pm: ParamMap, shards: Sequence[Tensor], arch: Architecture) -> list[Tensor]:
    """The HF tensors (in ``pm.hf`` order) from the megatron-core tensors of all TP ranks (rank order).

    The inverse of :func:`shard`: ``unshard(pm, [shard(pm, t, arch, r, n) for r in range(n)], arch) == t``.
    """
    if pm.kind == "replicated":
        return [shards[0]]
    if pm.kind == "vocab":
        return [torch.cat(list(shards), dim=0)]
    if pm.kind == "row":
        return [torch.cat(list(shards), dim=1)]
    if pm.kind == "qkv":
        d, groups, per_group = arch.head_dim, arch.num_query_groups, arch.heads_per_group
        rest = shards[0].shape[1:]
        fused = torch.cat(list(shards), dim=0).reshape(groups, (per_group + 2) * d, *rest)
        q, k, v = fused.split([per_group * d, d, d], dim=1)
        return [q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]
    if pm.kind == "gate_up":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    raise ValueError(f"ParamMap.kind={pm.kind!r}: choose one of {KINDS}")


def hf_to_mcore(
    hf_state: Mapping[str, Tensor],
    arch: Architecture,
    tp_rank: int = 0,
    tp_size: int = 1,
    transformer_engine: bool = False,
) -> dict[str, Tensor]:
    """The megatron-core state dict of TP rank ``tp_rank`` from an HF state dict (``lm_head.weight`` is not read
    when the embeddings are tied). The tensors are views/copies of the HF ones, same dtype.

    Raises:
        KeyError: an HF tensor the architecture needs is missing (named).
    """
    arch.check_tensor_parallel(tp_size)
    out = {}
    for pm in param_maps(arch, transformer_engine):
        missing = [name for name in pm.hf if name not in hf_state]
        if missing:
            raise KeyError(f"HF state dict has no {missing} (needed for {pm.mcore})")
        out[pm.mcore] = shard(pm, [hf_state[name] for name in pm.hf], arch, tp_rank, tp_size)
    return out


def mcore_to_hf(
    rank_states: Sequence[Mapping[str, Tensor]], arch: Architecture, transformer_engine: bool = False
) -> dict[str, Tensor]:
    """The HF state dict from the megatron-core state dicts of all TP ranks (in rank order). With tied
    embeddings ``lm_head.weight`` is included (the embedding tensor), as in ``LlamaForCausalLM.state_dict()``."""
    out: dict[str, Tensor] = {}
    for pm in param_maps(arch, transformer_engine):
        out.update(zip(pm.hf, unshard(pm, [state[pm.mcore] for state in rank_states], arch), strict=True))
    if arch.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


# ----------------------------------------------------------------------- on a live (distributed) model
def _mcore_parameters(model: torch.nn.Module) -> dict[str, Tensor]:
    """``model``'s parameters by megatron-core name (``module.`` prefixes of wrappers removed)."""
    params = {}
    for name, param in model.named_parameters():
        while name.startswith("module."):
            name = name[len("module."):]
        params[name] = param
    return params


@torch.no_grad()
def load_hf_state_dict(
    model: torch.nn.Module,
    hf_state: Mapping[str, Tensor],
    arch: Architecture,
    tp_rank: Optional[int] = None,
    tp_size: Optional[int] = None,
) -> None:
    """Copy an HF state dict into this rank's megatron-core ``model`` (in place, casting to its dtype).

    ``tp_rank``/``tp_size`` default to megatron-core's ``parallel_state``.

    Raises:
        KeyError: the model lacks a parameter the conversion produces, or has one it does not (named).
    """
    tp_rank, tp_size = _tp_rank_size(tp_rank, tp_size)
    params = _mcore_parameters(model)
    maps = param_maps(arch, transformer_engine=_uses_te(params))
    expected = {pm.mcore for pm in maps}
    if set(params) != expected:
        raise KeyError(f"megatron-core parameters differ from the conversion's: missing "
                       f"{sorted(expected - set(params))}, unexpected {sorted(set(params) - expected)}")
    for pm in maps:
        missing = [name for name in pm.hf if name not in hf_state]
        if missing:
            raise KeyError(f"HF state dict has no {missing} (needed for {pm.mcore})")
        value = shard(pm, [hf_state[name] for name in pm.hf], arch, tp_rank, tp_size)
        target = params[pm.mcore]
        if value.shape != target.shape:
            raise ValueError(f"{pm.mcore}: converted shape {tuple(value.shape)} != model shape {tuple(target.shape)}")
        target.copy_(value)


def gather_hf_tensors(
    pm: ParamMap, local: Tensor, arch: Architecture, group: Optional[object] = None
) -> list[Tensor]:
    """All-gather one megatron-core tensor (a parameter, its gradient or optimizer state) over the TP group and
    return the full HF tensors (``pm.hf`` order). A collective: every TP rank must call it, in the same order."""
    tp_size = torch.distributed.get_world_size(group) if group is not None else 1
    if pm.kind == "replicated" or tp_size == 1:
        return unshard(pm, [local.detach()], arch)
    shards = [torch.empty_like(local) for _ in range(tp_size)]
    torch.distributed.all_gather(shards, local.detach().contiguous(), group=group)
    return unshard(pm, shards, arch)


def iter_hf_weights(model: torch.nn.Module, arch: Architecture) -> Iterator[tuple[str, Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for every HF tensor of the megatron-core ``model``, one parameter at a
    time (so at most one full parameter is gathered at once); with tied embeddings ``lm_head.weight`` comes last
    (as :func:`lightning_grpo.rollout.engines.hf_weights.hf_weights` does, for vLLM's sake).

    A collective over the tensor-parallel group: every TP rank must iterate it to the end.
    """
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group() if parallel_state.model_parallel_is_initialized() else None
    params = _mcore_parameters(model)
    embedding = None
    for pm in param_maps(arch, transformer_engine=_uses_te(params)):
        for name, tensor in zip(pm.hf, gather_hf_tensors(pm, params[pm.mcore], arch, group), strict=True):
            if name == "model.embed_tokens.weight":
                embedding = tensor
            yield name, tensor
    if arch.tie_word_embeddings:
        assert embedding is not None
        yield "lm_head.weight", embedding


OPTIMIZER_FORMAT = "megatron-hf"


def optimizer_state_to_hf(
    raw: Mapping[str, Any],
    params: Sequence[Tensor],
    names: Sequence[str],
    maps: Mapping[str, ParamMap],
    arch: Optional[Architecture],
    group: Any,
) -> dict[str, Any]:
    """An optimizer ``state_dict()`` with the per-parameter tensors of megatron-core parameters gathered into HF
    names: ``{"state": {name: {...}}, "param_groups": [{..., "params": [name, ...]}], "format": "megatron-hf"}``.
    A collective over the TP group ``group``.

    Args:
        raw: ``optimizer.state_dict()`` (states by index, numbered across param groups).
        params: the optimizer's parameters in that numbering.
        names: their names; a name in ``maps`` is a megatron-core parameter, any other is kept as it is.
        maps: :class:`ParamMap` by parameter name.
        arch: the architecture (used for the names in ``maps``).
        group: the tensor-parallel process group.
    """
    state: dict[str, dict[str, Any]] = {}
    for index, values in sorted(raw["state"].items()):
        name, param = names[index], params[index]
        pm = maps.get(name)
        hf_names = pm.hf if pm is not None else (name,)
        per_name: dict[str, dict[str, Any]] = {h: {} for h in hf_names}
        for key, value in values.items():
            if pm is not None and torch.is_tensor(value) and value.shape == param.shape and value.dim() > 0:
                assert arch is not None
                for h, full in zip(hf_names, gather_hf_tensors(pm, value, arch, group), strict=True):
                    per_name[h][key] = full.cpu().clone()
            else:
                for h in hf_names:
                    per_name[h][key] = value
        state.update(per_name)
    groups = []
    for g in raw["param_groups"]:
        group_names: list[str] = []
        for index in g["params"]:
            pm = maps.get(names[index])
            group_names.extend(pm.hf if pm is not None else (names[index],))
        groups.append({**g, "params": group_names})
    return {"state": state, "param_groups": groups, "format": OPTIMIZER_FORMAT}


def optimizer_state_from_hf(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    params: Sequence[Tensor],
    names: Sequence[str],
    maps: Mapping[str, ParamMap],
    arch: Optional[Architecture],
    tp_rank: int,
    tp_size: int,
) -> dict[str, Any]:
    """The ``state_dict`` to load into an optimizer from one saved by :func:`optimizer_state_to_hf`, with this
    rank's shards (on each parameter's device).

    Args:
        saved: the saved optimizer state (``"format": "megatron-hf"``).
        current: the optimizer's own ``state_dict()`` (its param-group numbering is kept).
        params, names, maps, arch: as for :func:`optimizer_state_to_hf`.
        tp_rank, tp_size: this rank's tensor-parallel rank and the TP size.

    Raises:
        ValueError: an optimizer state in another format (e.g. from a plain, non-Megatron run).
    """
    if saved.get("format") != OPTIMIZER_FORMAT:
        raise ValueError("the checkpoint's optimizer state was not saved by MegatronStrategy (no 'format': "
                         "'megatron-hf'); resume it with the strategy that saved it or load weights only")
    state: dict[int, dict[str, Any]] = {}
    for index, name in enumerate(names):
        pm = maps.get(name)
        hf_names = pm.hf if pm is not None else (name,)
        if hf_names[0] not in saved["state"]:
            continue
        entry: dict[str, Any] = {}
        for key, value in saved["state"][hf_names[0]].items():
            if pm is not None and torch.is_tensor(value) and value.dim() > 0:
                assert arch is not None
                parts = [saved["state"][h][key] for h in hf_names]
                entry[key] = shard(pm, parts, arch, tp_rank, tp_size).to(params[index].device).clone()
            else:
                entry[key] = value
        state[index] = entry
    groups = [{**saved_group, "params": group["params"]}
              for saved_group, group in zip(saved["param_groups"], current["param_groups"], strict=False)]
    return {"state": state, "param_groups": groups}


def _uses_te(params: Mapping[str, Tensor]) -> bool:
    return any(name.endswith("layer_norm_weight") for name in params)


def _tp_rank_size(tp_rank: Optional[int], tp_size: Optional[int]) -> tuple[int, int]:
    if tp_rank is not None and tp_size is not None:
        return tp_rank, tp_size
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def _chunk(tensor: Tensor, dim: int, rank: int, size: int, name: str) -> Tensor:
    if tensor.shape[dim] % size != 0:
        raise ValueError(f"{name}: dimension {dim} of shape {tuple(tensor.shape)} does not split into {size} TP ranks")
    return tensor.chunk(size, dim=dim)[rank]
