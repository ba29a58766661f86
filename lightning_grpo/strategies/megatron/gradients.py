"""The gradients of a Megatron policy: averaged over the data-parallel group (without megatron-core's distributed
optimizer, which reduces them in its schedule), the two copies of a tied embedding summed, and the norm of the full,
unsharded gradient (for ``grad_norm`` and clipping by norm). Collectives over megatron-core's process groups."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor


@torch.no_grad()
def reduce_gradients(params: Sequence[Tensor], policy: Optional[Any], data_parallel_size: int,
                     pipeline_model_parallel_size: int) -> None:
    """Average the gradients of ``params`` over the data-parallel group (one flat all-reduce; a missing gradient
    counts as zeros), then sum the gradients of a tied embedding's two copies (first and last pipeline stage) over
    megatron-core's embedding group. ``policy``: the ``MegatronPolicy`` (None: no tied copies to sum)."""
    from megatron.core import parallel_state

    if data_parallel_size > 1:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        torch.distributed.all_reduce(flat, group=parallel_state.get_data_parallel_group())
        flat /= data_parallel_size
        offset = 0
        for p, g in zip(params, grads, strict=True):
            n = g.numel()
            p.grad = flat[offset : offset + n].view_as(g).clone()
            offset += n
    if policy is None or not (policy.arch.tie_word_embeddings and pipeline_model_parallel_size > 1):
        return
    if not parallel_state.is_rank_in_embedding_group():
        return
    shared = policy.model.shared_embedding_or_output_weight()
    if shared.grad is None:
        shared.grad = torch.zeros_like(shared)
    torch.distributed.all_reduce(shared.grad, group=parallel_state.get_embedding_group())


@torch.no_grad()
def full_grad_norm(params: Sequence[Tensor], tensor_model_parallel_size: int, pipeline_model_parallel_size: int,
                   device: torch.device) -> Tensor:
    """The 2-norm (0-dim float32) of the full, unsharded gradient of ``params``: squares of tensor-parallel
    shards (``param.tensor_model_parallel``) are summed over the TP group, replicated parameters (the norms)
    counted once, then everything summed over the PP group; the last stage's copy of a tied embedding
    (``param.shared``) is left out. ``device``: where the sums are reduced without a gradient here. A collective over
    the model-parallel group."""
    from megatron.core import parallel_state

    grads = [p for p in params if p.grad is not None and not getattr(p, "shared", False)]
    device = grads[0].grad.device if grads else device
    squares = torch.zeros(2, device=device)  # [sharded, replicated]
    for p in grads:
        squares[0 if getattr(p, "tensor_model_parallel", False) else 1] += p.grad.float().square().sum()
    sharded = squares[:1].clone()
    if tensor_model_parallel_size > 1:
        torch.distributed.all_reduce(sharded, group=parallel_state.get_tensor_model_parallel_group())
    total = sharded + squares[1:]
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
