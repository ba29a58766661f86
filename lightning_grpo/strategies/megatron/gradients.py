"""The gradients of a Megatron policy: averaged over the data-parallel group (without megatron-core's distributed
optimizer, which reduces them in its schedule), the two copies of a tied embedding summed, and the norm of the full,
unsharded gradient (for ``grad_norm`` and clipping by norm). Collectives over megatron-core's process groups.

A mixture of experts split over ranks (EP x ETP > 1) has expert weights whose gradient already holds the
contributions of every rank of its expert groups (the tokens of all of them went through it, by the all-to-all):
megatron-core marks them ``allreduce = False`` and reduces them over the expert-data-parallel group (the other copies
of the same expert shard) with the same ``1 / DP`` scale as the dense ones, summing there instead of averaging
(``DistributedDataParallel``'s ``expert_gradient_scaling_factor``); :func:`reduce_gradients` does the same."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor


@torch.no_grad()
def reduce_gradients(params: Sequence[Tensor], policy: Optional[Any], data_parallel_size: int,
                     pipeline_model_parallel_size: int) -> None:
    """Average the gradients of ``params`` over the data-parallel group (one flat all-reduce; a missing gradient
    counts as zeros; experts split over ranks: summed over the expert-data-parallel group and divided by the DP size,
    see the module docstring), then sum the gradients of a tied embedding's two copies (first and last pipeline stage)
    over megatron-core's embedding group. ``policy``: the ``MegatronPolicy`` (None: no tied copies to sum)."""
    from megatron.core import parallel_state

    if data_parallel_size > 1:
        dense = [p for p in params if getattr(p, "allreduce", True)]
        experts = [p for p in params if not getattr(p, "allreduce", True)]
        _reduce(dense, parallel_state.get_data_parallel_group(), data_parallel_size)
        _reduce(experts, parallel_state.get_expert_data_parallel_group(), data_parallel_size)
    if policy is None or not (policy.arch.tie_word_embeddings and pipeline_model_parallel_size > 1):
        return
    if not parallel_state.is_rank_in_embedding_group():
        return
    shared = policy.model.shared_embedding_or_output_weight()
    if shared.grad is None:
        shared.grad = torch.zeros_like(shared)
    torch.distributed.all_reduce(shared.grad, group=parallel_state.get_embedding_group())


def _reduce(params: Sequence[Tensor], group: Any, divisor: int) -> None:
    """Sum the gradients of ``params`` over ``group`` (one flat all-reduce; a missing gradient counts as zeros) and
    divide them by ``divisor``."""
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    if torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(flat, group=group)
    flat /= divisor
    offset = 0
    for p, g in zip(params, grads, strict=True):
        n = g.numel()
        p.grad = flat[offset : offset + n].view_as(g).clone()
        offset += n


@torch.no_grad()
def full_grad_norm(params: Sequence[Tensor], tensor_model_parallel_size: int, pipeline_model_parallel_size: int,
                   device: torch.device) -> Tensor:
    """The 2-norm (0-dim float32) of the full, unsharded gradient of ``params``: squares of tensor-parallel
    shards (``param.tensor_model_parallel``) are summed over the TP group, replicated parameters (the norms)
    counted once, the experts split over ranks (``param.allreduce`` False) summed over the expert tensor-and-model
    parallel group (every rank of it holds other experts or other shards), then everything summed over the PP group;
    the last stage's copy of a tied embedding (``param.shared``) is left out. ``device``: where the sums are reduced
    without a gradient here. A collective over the model-parallel group (and the expert groups)."""
    from megatron.core import parallel_state

    grads = [p for p in params if p.grad is not None and not getattr(p, "shared", False)]
    device = grads[0].grad.device if grads else device
    squares = torch.zeros(3, device=device)  # [sharded, replicated, experts split over ranks]
    for p in grads:
        kind = 2 if not getattr(p, "allreduce", True) else 0 if getattr(p, "tensor_model_parallel", False) else 1
        squares[kind] += p.grad.float().square().sum()
    sharded, experts = squares[:1].clone(), squares[2:].clone()
    if tensor_model_parallel_size > 1:
        torch.distributed.all_reduce(sharded, group=parallel_state.get_tensor_model_parallel_group())
    expert_group = parallel_state.get_expert_tensor_and_model_parallel_group()
    if torch.distributed.get_world_size(expert_group) > 1:
        torch.distributed.all_reduce(experts, group=expert_group)
    total = sharded + squares[1:2] + experts
    if pipeline_model_parallel_size > 1:
        torch.distributed.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
    return total[0].sqrt()


@torch.no_grad()
def clip_by_norm(params: Sequence[Tensor], max_norm: float, norm: Callable[[Sequence[Tensor]], Tensor]) -> Tensor:
    """Scale the gradients of ``params`` by ``min(1, max_norm / (total + 1e-6))``, ``total = norm(params)`` (the
    full gradient's: :func:`full_grad_norm`, a collective), as ``torch.nn.utils.clip_grad_norm_`` does. Returns
    ``total``."""
    total = norm(params)
    coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.mul_(coefficient.to(p.grad.dtype))
    return total
