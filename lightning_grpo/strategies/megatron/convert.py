"""Weights between Hugging Face Llama-family (and Qwen3-MoE / Mixtral) checkpoints and megatron-core ``GPTModel``
shards.

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
- ``fused_gate_up``: the same from one HF tensor ``[gate; up]`` (``(2 F, H)``: an expert of a mixture).

A mixture of experts (:mod:`~lightning_grpo.strategies.megatron.experts`) adds the router (``mlp.gate.weight`` ->
``mlp.router.weight``, replicated), the per-head q/k RMSNorms of Qwen3-MoE (``self_attn.q_norm`` / ``k_norm`` ->
``self_attention.q_layernorm`` / ``k_layernorm``, replicated) and the experts: transformers stores all ``E``
experts of a layer in two stacked tensors, ``mlp.experts.gate_up_proj`` ``(E, 2F, H)`` and ``mlp.experts.down_proj``
``(E, H, F)``; megatron-core's ``SequentialMLP`` holds each local expert ``j`` as ``mlp.experts.local_experts.{j}.
linear_fc1.weight`` (``fused_gate_up``) and ``linear_fc2.weight`` (``row``). An expert ``ParamMap`` (``experts=E``)
names the local experts with ``{}``; expert-parallel rank ``r`` holds experts ``[r E/EP, (r+1) E/EP)``, and each
expert's matrices split over the expert-tensor-parallel ranks (ETP) as the kind says.

The conversions only slice, reshape, stack and concatenate, so HF -> megatron-core -> HF is bit-exact.

Pipeline parallelism (PP): each stage holds the parameters of its layers (:func:`param_maps` with a
:class:`~lightning_grpo.strategies.megatron.model.StageLayout`; megatron-core numbers a stage's layers from 0, the
HF names keep the global index); with tied embeddings the last stage's ``output_layer.weight`` is a copy of the
embedding (``ParamMap.copy``: loaded from ``model.embed_tokens.weight``, never exported). :func:`iter_hf_weights`
gathers one HF tensor at a time over the TP group of the stage that owns it (an expert tensor over the expert-TP
and then the expert-parallel group) and broadcasts it over the PP group, so the HF names and values do not depend on
the TP, PP, EP and ETP sizes.
Names are those of megatron-core's local layer spec; with the Transformer Engine spec the two RMSNorms of a
layer live inside the following linear (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor

from lightning_grpo.strategies.megatron.experts import ExpertRanks
from lightning_grpo.strategies.megatron.model import Architecture, StageLayout, stage_layout

KINDS = ("replicated", "vocab", "row", "qkv", "gate_up", "fused_gate_up")


@dataclass(frozen=True)
class ParamMap:
    """One megatron-core parameter and the HF tensors it is made of.

    Attributes:
        mcore: the megatron-core name (``decoder.layers.0.self_attention.linear_qkv.weight``).
        hf: the HF names, in the order the kind concatenates them (q, k, v / gate, up).
        kind: one of :data:`KINDS`.
        copy: the last pipeline stage's copy of the tied embedding (``output_layer.weight`` with tied embeddings
            and PP > 1): loaded from the embedding, not exported (the first stage's embedding is).
        experts: the number of experts ``E`` stacked along dim 0 of the HF tensor (a mixture's expert weights), else
            0; ``mcore`` then holds ``{}`` for the local expert index and ``kind`` splits each expert over the
            expert-TP ranks.
    """

    mcore: str
    hf: tuple[str, ...]
    kind: str
    copy: bool = False
    experts: int = 0

    def local(self, experts: ExpertRanks) -> list[tuple[str, Optional[int]]]:
        """``(megatron-core name, global expert index)`` of each parameter this map names on a rank placed at
        ``experts``: the one parameter with None, or each local expert's."""
        if not self.experts:
            return [(self.mcore, None)]
        return [(self.mcore.format(j), e) for j, e in enumerate(experts.local_experts(self.experts))]

    def split(self, tp_rank: int, tp_size: int, experts: ExpertRanks) -> tuple[int, int]:
        """The rank and size this map's tensors are split over: the expert-TP ones for expert weights, else TP."""
        return (experts.etp_rank, experts.etp_size) if self.experts else (tp_rank, tp_size)


def param_maps(
    arch: Architecture, transformer_engine: bool = False, stage: Optional[StageLayout] = None
) -> list[ParamMap]:
    """Every megatron-core parameter of ``arch``'s ``GPTModel`` (of pipeline stage ``stage``; None = the whole
    model) with its HF source: the output layer when the embeddings are untied, or when they are tied on a last
    stage that is not also the first (a copy)."""
    stage = stage or stage_layout(arch)
    maps = []
    if stage.pre_process:
        maps.append(ParamMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"))
    input_norm = "self_attention.linear_qkv.layer_norm_weight" if transformer_engine else "input_layernorm.weight"
    mlp_norm = "mlp.linear_fc1.layer_norm_weight" if transformer_engine else "pre_mlp_layernorm.weight"
    for local, i in enumerate(stage.layers):
        m, h = f"decoder.layers.{local}.", f"model.layers.{i}."
        maps += [
            ParamMap(m + input_norm, (h + "input_layernorm.weight",), "replicated"),
            ParamMap(m + "self_attention.linear_qkv.weight",
                     tuple(h + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv"),
        ]
        if arch.qkv_bias:
            maps.append(ParamMap(m + "self_attention.linear_qkv.bias",
                                 tuple(h + f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv"))
        maps.append(ParamMap(m + "self_attention.linear_proj.weight", (h + "self_attn.o_proj.weight",), "row"))
        if arch.qk_layernorm:
            maps += [ParamMap(m + f"self_attention.{p}_layernorm.weight", (h + f"self_attn.{p}_norm.weight",),
                              "replicated") for p in "qk"]
        maps.append(ParamMap(m + mlp_norm, (h + "post_attention_layernorm.weight",), "replicated"))
        if arch.moe is not None and arch.moe.layers[i]:
            e = arch.moe.num_experts
            maps += [
                ParamMap(m + "mlp.router.weight", (h + "mlp.gate.weight",), "replicated"),
                ParamMap(m + "mlp.experts.local_experts.{}.linear_fc1.weight", (h + "mlp.experts.gate_up_proj",),
                         "fused_gate_up", experts=e),
                ParamMap(m + "mlp.experts.local_experts.{}.linear_fc2.weight", (h + "mlp.experts.down_proj",), "row",
                         experts=e),
            ]
        else:
            maps += [
                ParamMap(m + "mlp.linear_fc1.weight", (h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight"),
                         "gate_up"),
                ParamMap(m + "mlp.linear_fc2.weight", (h + "mlp.down_proj.weight",), "row"),
            ]
    if stage.post_process:
        maps.append(ParamMap("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated"))
        if not arch.tie_word_embeddings:
            maps.append(ParamMap("output_layer.weight", ("lm_head.weight",), "vocab"))
        elif not stage.pre_process:
            maps.append(ParamMap("output_layer.weight", ("model.embed_tokens.weight",), "vocab", copy=True))
    return maps


def pipeline_param_maps(
    arch: Architecture, transformer_engine: bool = False, pp_size: int = 1
) -> list[tuple[int, ParamMap]]:
    """``(owner stage, ParamMap)`` of every exported megatron-core parameter of all ``pp_size`` stages, in HF
    order (embedding, layers, final norm, output layer); copies are left out. The same list on every rank."""
    stages = [stage_layout(arch, pp_size, s) for s in range(pp_size)]
    return [(s.pp_rank, pm) for s in stages for pm in param_maps(arch, transformer_engine, s) if not pm.copy]


def hf_shapes(arch: Architecture) -> dict[str, tuple[int, ...]]:
    """The full shape of every HF tensor of ``arch`` (``lm_head.weight`` included, tied or not)."""
    h, v, f, d = arch.hidden_size, arch.vocab_size, arch.ffn_hidden_size, arch.head_dim
    q, kv = arch.num_attention_heads * d, arch.num_query_groups * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h),
                                          "model.norm.weight": (h,)}
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q)})
        if arch.qk_layernorm:
            shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
        moe = arch.moe
        if moe is not None and moe.layers[i]:
            e, fe = moe.num_experts, moe.ffn_hidden_size
            shapes.update({p + "mlp.gate.weight": (e, h), p + "mlp.experts.gate_up_proj": (e, 2 * fe, h),
                           p + "mlp.experts.down_proj": (e, h, fe)})
        else:
            shapes.update({p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
                           p + "mlp.down_proj.weight": (h, f)})
        if arch.qkv_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
    return shapes


def shard(pm: ParamMap, tensors: Sequence[Tensor], arch: Architecture, tp_rank: int, tp_size: int) -> Tensor:
    """This TP rank's megatron-core tensor made from the HF tensors ``tensors`` (in ``pm.hf`` order; of one expert,
    ``hf_tensor[e]``, for an expert map, split over the expert-TP ranks: :meth:`ParamMap.split`).

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
    if pm.kind in ("gate_up", "fused_gate_up"):
        gate, up = tensors if pm.kind == "gate_up" else tensors[0].chunk(2)
        return torch.cat([_chunk(gate, 0, tp_rank, tp_size, pm.hf[0]), _chunk(up, 0, tp_rank, tp_size, pm.hf[-1])])
    raise ValueError(f"ParamMap.kind={pm.kind!r}: choose one of {KINDS}")


def unshard(pm: ParamMap, shards: Sequence[Tensor], arch: Architecture) -> list[Tensor]:
    """The HF tensors (in ``pm.hf`` order; one expert's for an expert map) from the megatron-core tensors of all TP
    ranks (expert-TP ranks for an expert map), in rank order.

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
    if pm.kind in ("gate_up", "fused_gate_up"):
        halves = [s.chunk(2, dim=0) for s in shards]
        gate, up = torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])
        return [gate, up] if pm.kind == "gate_up" else [torch.cat([gate, up])]
    raise ValueError(f"ParamMap.kind={pm.kind!r}: choose one of {KINDS}")


def hf_to_mcore(
    hf_state: Mapping[str, Tensor],
    arch: Architecture,
    tp_rank: int = 0,
    tp_size: int = 1,
    transformer_engine: bool = False,
    experts: ExpertRanks = ExpertRanks(),  # noqa: B008 - immutable
) -> dict[str, Tensor]:
    """The megatron-core state dict of TP rank ``tp_rank`` (and, for a mixture of experts, of the expert-parallel
    place ``experts``) from an HF state dict (``lm_head.weight`` is not read when the embeddings are tied). The
    tensors are views/copies of the HF ones, same dtype.

    Raises:
        KeyError: an HF tensor the architecture needs is missing (named).
    """
    arch.check_tensor_parallel(tp_size)
    out = {}
    for pm in param_maps(arch, transformer_engine):
        _check_present(pm, hf_state)
        for name, expert in pm.local(experts):
            out[name] = shard(pm, _hf_tensors(pm, hf_state, expert), arch, *pm.split(tp_rank, tp_size, experts))
    return out


def mcore_to_hf(
    rank_states: Sequence[Mapping[str, Tensor]], arch: Architecture, transformer_engine: bool = False,
    expert_model_parallel_size: int = 1,
) -> dict[str, Tensor]:
    """The HF state dict from the megatron-core state dicts of all ranks in rank order: the TP ranks of a dense
    model; for a mixture of experts (TP = 1) the ``EP x ETP`` ranks of the expert groups, expert-TP rank fastest
    (megatron-core's order tp-ep), ``EP = expert_model_parallel_size``. With tied embeddings ``lm_head.weight`` is
    included (the embedding tensor), as in ``LlamaForCausalLM.state_dict()``."""
    ep = expert_model_parallel_size
    etp = len(rank_states) // ep
    dense = rank_states if arch.moe is None else rank_states[:1]
    out: dict[str, Tensor] = {}
    for pm in param_maps(arch, transformer_engine):
        if not pm.experts:
            out.update(zip(pm.hf, unshard(pm, [state[pm.mcore] for state in dense], arch), strict=True))
            continue
        stacked = []
        for r in range(ep):
            states = rank_states[r * etp:(r + 1) * etp]
            for name, _ in pm.local(ExpertRanks(r, ep, 0, etp)):
                stacked.append(unshard(pm, [state[name] for state in states], arch)[0])
        out[pm.hf[0]] = torch.stack(stacked)
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


def _check_present(pm: ParamMap, hf_state: Mapping[str, Tensor]) -> None:
    missing = [name for name in pm.hf if name not in hf_state]
    if missing:
        raise KeyError(f"HF state dict has no {missing} (needed for {pm.mcore})")


def _hf_tensors(pm: ParamMap, hf_state: Mapping[str, Tensor], expert: Optional[int]) -> list[Tensor]:
    """The HF tensors of ``pm`` (expert ``expert``'s slice of each for an expert map)."""
    return [hf_state[name] if expert is None else hf_state[name][expert] for name in pm.hf]


@torch.no_grad()
def load_hf_state_dict(
    model: torch.nn.Module,
    hf_state: Mapping[str, Tensor],
    arch: Architecture,
    tp_rank: Optional[int] = None,
    tp_size: Optional[int] = None,
    stage: Optional[StageLayout] = None,
    experts: Optional[ExpertRanks] = None,
) -> None:
    """Copy an HF state dict into this rank's megatron-core ``model`` (in place, casting to its dtype).

    ``tp_rank``/``tp_size``, ``stage`` and ``experts`` default to megatron-core's ``parallel_state``.

    Raises:
        KeyError: the model lacks a parameter the conversion produces, or has one it does not (named).
    """
    tp_rank, tp_size = _tp_rank_size(tp_rank, tp_size)
    experts = experts or ExpertRanks.current()
    params = _mcore_parameters(model)
    maps = param_maps(arch, transformer_engine=_uses_te(params), stage=stage or current_stage(arch))
    expected = {name for pm in maps for name, _ in pm.local(experts)}
    if set(params) != expected:
        raise KeyError(f"megatron-core parameters differ from the conversion's: missing "
                       f"{sorted(expected - set(params))}, unexpected {sorted(set(params) - expected)}")
    for pm in maps:
        _check_present(pm, hf_state)
        for name, expert in pm.local(experts):
            value = shard(pm, _hf_tensors(pm, hf_state, expert), arch, *pm.split(tp_rank, tp_size, experts))
            target = params[name]
            if value.shape != target.shape:
                raise ValueError(f"{name}: converted shape {tuple(value.shape)} != model shape {tuple(target.shape)}")
            target.copy_(value)


def gather_hf_tensors(
    pm: ParamMap, local: Tensor, arch: Architecture, group: Optional[object] = None
) -> list[Tensor]:
    """All-gather one megatron-core tensor (a parameter, its gradient or optimizer state) over the TP group (the
    expert-TP group for one expert of an expert map) and return the full HF tensors (``pm.hf`` order; one expert's
    for an expert map). A collective: every rank of ``group`` must call it, in the same order."""
    tp_size = torch.distributed.get_world_size(group) if group is not None else 1
    if pm.kind == "replicated" or tp_size == 1:
        return unshard(pm, [local.detach()], arch)
    shards = [torch.empty_like(local) for _ in range(tp_size)]
    torch.distributed.all_gather(shards, local.detach().contiguous(), group=group)
    return unshard(pm, shards, arch)


def gather_expert_tensors(pm: ParamMap, local: Sequence[Tensor], arch: Architecture,
                          expert_tp_group: Optional[object] = None,
                          expert_group: Optional[object] = None) -> list[Tensor]:
    """The full HF tensor ``(E, ...)`` of an expert map from this rank's tensors of its local experts (parameters,
    gradients or optimizer states, in local order): each expert all-gathered over the expert-TP group, the local
    experts stacked, the stacks all-gathered over the expert-parallel group (EP rank order is expert order). A
    collective over both groups."""
    stacked = torch.stack([gather_hf_tensors(pm, t, arch, expert_tp_group)[0] for t in local])  # [E/EP, ...]
    ep_size = torch.distributed.get_world_size(expert_group) if expert_group is not None else 1
    if ep_size == 1:
        return [stacked]
    parts = [torch.empty_like(stacked) for _ in range(ep_size)]
    torch.distributed.all_gather(parts, stacked.contiguous(), group=expert_group)
    return [torch.cat(parts)]


def gather_map(pm: ParamMap, local: Sequence[Tensor], arch: Architecture) -> list[Tensor]:
    """The full HF tensors of ``pm`` from this rank's tensors of it (one per :meth:`ParamMap.local` entry): gathered
    over the TP group, or for an expert map over the expert-TP and expert-parallel groups (megatron-core's
    ``parallel_state``; nothing to gather when it is not initialised). A collective over those groups."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return gather_expert_tensors(pm, local, arch) if pm.experts else gather_hf_tensors(pm, local[0], arch)
    if pm.experts:
        return gather_expert_tensors(pm, local, arch, ps.get_expert_tensor_parallel_group(),
                                     ps.get_expert_model_parallel_group())
    return gather_hf_tensors(pm, local[0], arch, ps.get_tensor_model_parallel_group())


def iter_hf_weights(model: torch.nn.Module, arch: Architecture) -> Iterator[tuple[str, Tensor]]:
    """Yield ``(hf_name, full_tensor)`` for every HF tensor of the whole model, on every rank, one parameter at a
    time (so at most one full parameter is gathered at once): each is all-gathered over the TP group of the
    pipeline stage that holds it (an expert tensor over the expert-TP and expert-parallel groups,
    :func:`gather_expert_tensors`) and broadcast from that stage over the PP group. With tied embeddings
    ``lm_head.weight`` comes last (as :func:`lightning_grpo.models.hf_weights.hf_weights` does, for vLLM's
    sake).

    A collective over the model-parallel (TP x PP) group, and the expert groups for a mixture of experts: every
    rank of them must iterate it to the end.
    """
    from megatron.core import parallel_state

    initialized = parallel_state.model_parallel_is_initialized()
    pp_size = parallel_state.get_pipeline_model_parallel_world_size() if initialized else 1
    pp_rank = parallel_state.get_pipeline_model_parallel_rank() if initialized else 0
    pp_group = parallel_state.get_pipeline_model_parallel_group() if pp_size > 1 else None
    experts = ExpertRanks.current()
    params = _mcore_parameters(model)
    local = next(iter(params.values()))
    shapes = hf_shapes(arch) if pp_size > 1 else {}
    embedding = None
    for owner, pm in pipeline_param_maps(arch, _uses_te(params), pp_size):
        if owner == pp_rank:
            tensors = gather_map(pm, [params[name] for name, _ in pm.local(experts)], arch)
        else:
            tensors = [torch.empty(shapes[name], dtype=local.dtype, device=local.device) for name in pm.hf]
        if pp_group is not None:
            tensors = [t.contiguous() for t in tensors]
            source = torch.distributed.get_process_group_ranks(pp_group)[owner]
            for tensor in tensors:
                torch.distributed.broadcast(tensor, src=source, group=pp_group)
        for name, tensor in zip(pm.hf, tensors, strict=True):
            if name == "model.embed_tokens.weight":
                embedding = tensor
            yield name, tensor
    if arch.tie_word_embeddings:
        assert embedding is not None
        yield "lm_head.weight", embedding


def current_stage(arch: Architecture) -> StageLayout:
    """This rank's pipeline stage from megatron-core's ``parallel_state`` (the whole model when it is not
    initialised)."""
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return stage_layout(arch)
    return stage_layout(arch, parallel_state.get_pipeline_model_parallel_world_size(),
                        parallel_state.get_pipeline_model_parallel_rank())


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


@contextlib.contextmanager
def default_tensor_init() -> Iterator[None]:
    """CPU and float32 as the default device and dtype of new tensors for the block: Lightning runs
    ``configure_model`` under the root device and the precision plugin's dtype, and the conversion builds on CPU."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device("cpu"):
            yield
    finally:
        torch.set_default_dtype(dtype)
