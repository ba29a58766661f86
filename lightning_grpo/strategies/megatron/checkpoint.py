"""Optimizer states in HF names, independent of the tensor-, pipeline- and data-parallel layout.

A Megatron checkpoint holds the policy's weights under their HF names (``policy.model.embed_tokens.weight``, ...,
gathered by :func:`~lightning_grpo.strategies.megatron.convert.iter_hf_weights`: :func:`module_state_dict`, loaded
into any layout by :func:`load_module_state_dict`) and its optimizer state likewise:
``{"state": {hf_name: {"step": ..., "exp_avg": full tensor, ...}}, "param_groups": [...], "format": "megatron-hf"}``.
:func:`optimizer_state_to_hf` builds it: for each HF tensor, in HF order, the pipeline stage that holds it reads the
per-parameter state of its shard (:class:`ParamStates`: the torch optimizer's own, or the distributed optimizer's,
whose flat shards are first gathered over the data-parallel group), all-gathers the per-element tensors over the
tensor-parallel group (a mixture's experts over the expert-TP and expert-parallel groups, stacked in HF's
``(E, ...)`` layout), and broadcasts them over the pipeline group. :func:`optimizer_state_from_hf` loads it into any
layout: each rank cuts its own shards out of the full tensors (:func:`~lightning_grpo.strategies.megatron.convert.
shard`). So a checkpoint written at TP=1/PP=2 resumes at TP=2/PP=1, with or without the distributed optimizer.

The full state is assembled on every rank one tensor at a time and kept (on the CPU) by the rank that writes the
checkpoint (Lightning's rank 0): that rank needs host memory for the whole optimizer state.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Protocol

import torch
from torch import Tensor

from lightning_grpo.strategies.megatron.convert import (
    gather_map,
    load_hf_state_dict,
    param_maps,
    pipeline_param_maps,
    shard,
)
from lightning_grpo.strategies.megatron.experts import ExpertRanks
from lightning_grpo.strategies.megatron.model import Architecture, StageLayout

OPTIMIZER_FORMAT = "megatron-hf"
#: The LightningModule attribute of the policy: its weights are checkpointed as ``policy.<hf name>``.
POLICY_PREFIX = "policy."


def module_state_dict(module: torch.nn.Module, policy: Optional[Any]) -> dict[str, Any]:
    """``module.state_dict()`` with the ``MegatronPolicy`` ``policy``'s weights gathered into HF names
    (``policy.<hf name>``, on the CPU; :func:`~lightning_grpo.strategies.megatron.convert.iter_hf_weights`, a
    collective over the model-parallel group); ``policy`` None: the module's own state dict (not converted)."""
    if policy is None:
        return module.state_dict()
    state = {k: v for k, v in module.state_dict().items() if not k.startswith(POLICY_PREFIX)}
    for name, tensor in policy.iter_hf_weights():
        state[POLICY_PREFIX + name] = tensor.cpu().clone()
    return state


def load_module_state_dict(module: torch.nn.Module, policy: Optional[Any], state_dict: Mapping[str, Any],
                           strict: bool) -> None:
    """Load a state dict with the policy in HF names (a Megatron or a plain GRPOModule checkpoint): this rank's
    shards of ``policy.*`` into the ``MegatronPolicy`` ``policy`` (None: the whole state dict into ``module``, whose
    policy is the HF model), the rest into ``module``."""
    if policy is None:
        module.load_state_dict(state_dict, strict=strict)
        return
    prefix = len(POLICY_PREFIX)
    hf_state = {k[prefix:]: v for k, v in state_dict.items() if k.startswith(POLICY_PREFIX)}
    load_hf_state_dict(policy.model, hf_state, policy.arch)
    rest = {k: v for k, v in state_dict.items() if not k.startswith(POLICY_PREFIX)}
    own = {k: v for k, v in module.state_dict().items() if k.startswith(POLICY_PREFIX)}
    module.load_state_dict({**own, **rest}, strict=strict)


class ParamStates(Protocol):
    """Read and write the optimizer state of one model parameter as tensors of the parameter's (local TP shard)
    shape plus scalars (``step``)."""

    def get(self, param: Tensor) -> Optional[dict[str, Any]]:
        """The state of ``param``, or None before the first step. A collective over the data-parallel group for
        the distributed optimizer (every rank calls it for the same parameters, in order)."""
        ...

    def set(self, param: Tensor, values: dict[str, Any]) -> None:
        """Make ``values`` (from :meth:`get` of a run with the same local shapes) the state of ``param``."""
        ...


class TorchParamStates:
    """:class:`ParamStates` of a torch optimizer (``optimizer.state[param]``), as ``load_state_dict`` does: floating
    point values are cast to the parameter's dtype and device, ``step`` is kept as it is."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def get(self, param: Tensor) -> Optional[dict[str, Any]]:
        state = self.optimizer.state.get(param)
        return dict(state) if state else None

    def set(self, param: Tensor, values: dict[str, Any]) -> None:
        self.optimizer.state[param] = {k: _like(v, param, k) for k, v in values.items()}


def _like(value: Any, param: Tensor, key: str) -> Any:
    if not torch.is_tensor(value):
        return value
    if key == "step":
        return value.clone()
    return value.to(device=param.device, dtype=param.dtype if value.is_floating_point() else value.dtype).clone()


def optimizer_state_to_hf(
    states: ParamStates,
    params: Mapping[str, Tensor],
    arch: Architecture,
    transformer_engine: bool,
    param_groups: list[dict[str, Any]],
    keep: bool = True,
) -> dict[str, Any]:
    """The optimizer state under HF names (see the module docstring). A collective over the model-parallel group
    (and the data-parallel group for the distributed optimizer): every rank calls it.

    Args:
        states: this rank's per-parameter states.
        params: this rank's megatron-core parameters by megatron-core name (``decoder.layers.0...``).
        arch: the architecture; transformer_engine: whether the layers are Transformer Engine's.
        param_groups: the optimizer's hyper-parameters (``lr``, ``betas``, ...; ``params`` are replaced by the HF
            names).
        keep: keep the gathered tensors (False on ranks that do not write the checkpoint: they only take part).

    Returns:
        ``{"state": {hf_name: {key: value}}, "param_groups": [...], "format": "megatron-hf"}`` (CPU tensors; empty
        ``state`` when ``keep`` is False).
    """
    from megatron.core import parallel_state

    pp_size = parallel_state.get_pipeline_model_parallel_world_size()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    experts = ExpertRanks.current()
    state: dict[str, dict[str, Any]] = {}
    names: list[str] = []
    for owner, pm in pipeline_param_maps(arch, transformer_engine, pp_size):
        names.extend(pm.hf)
        entry: Optional[dict[str, dict[str, Any]]] = None
        if owner == pp_rank:
            local = [params[name] for name, _ in pm.local(experts)]
            found = [states.get(param) for param in local]  # (the same steps on every rank: all or none)
            if found[0] is not None:
                values = [v for v in found if v is not None]
                entry = {h: {} for h in pm.hf}
                for key, value in sorted(values[0].items()):
                    if torch.is_tensor(value) and value.dim() > 0 and value.shape == local[0].shape:
                        gathered = gather_map(pm, [v[key] for v in values], arch)
                        for h, full in zip(pm.hf, gathered, strict=True):
                            entry[h][key] = full.cpu().clone()
                    else:
                        for h in pm.hf:
                            entry[h][key] = value.cpu().clone() if torch.is_tensor(value) else value
        if pp_size > 1:
            box = [entry]
            torch.distributed.broadcast_object_list(box, src=torch.distributed.get_process_group_ranks(pp_group)[owner],
                                                    group=pp_group)
            entry = box[0]
        if keep and entry is not None:
            state.update(entry)
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": names if i == 0 else []}
              for i, g in enumerate(param_groups)]
    return {"state": state, "param_groups": groups, "format": OPTIMIZER_FORMAT}


def optimizer_state_from_hf(
    saved: Mapping[str, Any],
    states: ParamStates,
    params: Mapping[str, Tensor],
    arch: Architecture,
    transformer_engine: bool,
    stage: StageLayout,
    tp_rank: int,
    tp_size: int,
    experts: ExpertRanks = ExpertRanks(),  # noqa: B008 - immutable
) -> None:
    """Load a state saved by :func:`optimizer_state_to_hf` into this rank's parameters: each per-element tensor is cut
    to this rank's TP shard (an expert's to its expert's expert-TP shard; the copy of a tied embedding on the last
    pipeline stage gets the embedding's state).

    Raises:
        ValueError: an optimizer state in another format (e.g. from a plain, non-Megatron run).
    """
    if saved.get("format") != OPTIMIZER_FORMAT:
        raise ValueError("the checkpoint's optimizer state was not saved by MegatronStrategy (no 'format': "
                         "'megatron-hf'); resume it with the strategy that saved it or load weights only")
    for pm in param_maps(arch, transformer_engine, stage):
        if pm.hf[0] not in saved["state"]:
            continue  # no state yet (saved before the first optimizer step)
        for name, expert in pm.local(experts):
            values: dict[str, Any] = {}
            for key, value in saved["state"][pm.hf[0]].items():
                if torch.is_tensor(value) and value.dim() > 0:
                    full = [saved["state"][h][key] if expert is None else saved["state"][h][key][expert] for h in pm.hf]
                    values[key] = shard(pm, full, arch, *pm.split(tp_rank, tp_size, experts))
                else:
                    values[key] = value
            states.set(params[name], values)


def load_hyperparameters(groups: list[dict[str, Any]], saved: Mapping[str, Any]) -> None:
    """Copy the saved param groups' hyper-parameters (all but ``params``) into ``groups`` (the optimizer's own).

    Raises:
        ValueError: the number of param groups differs.
    """
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(groups):
        raise ValueError(f"the checkpoint's optimizer has {len(saved_groups)} param groups, this one {len(groups)}")
    for group, saved_group in zip(groups, saved_groups, strict=True):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
