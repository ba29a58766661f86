"""Token logprobs and entropy from vocab-parallel logits, without gathering the full vocabulary on any rank.

With tensor parallelism (TP) each rank's output layer produces logits for its slice of the vocabulary,
``(N, T, V / TP)``. ``log p(y) = z_y - logsumexp(z)`` needs only three all-reduces of ``(N, T)`` tensors over
the TP group (the max, the sum of exponentials, and ``z_y`` from the rank that holds ``y``): megatron-core's
``vocab_parallel_cross_entropy`` does exactly that (Megatron-LM, Shoeybi et al. 2019, sec. 3) and returns
``-log p(y)`` with its own backward, ``softmax(z) - onehot(y)`` on the local slice.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def vocab_parallel_logprobs(
    logits: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Optional[Tensor]]:
    """Log-probabilities of ``labels`` under ``softmax(logits / temperature)`` over the whole vocabulary, where
    ``logits`` is this TP rank's vocabulary slice. The vocab-parallel counterpart of
    :func:`lightning_grpo.functional.token_logprobs` (same values, same gradient).

    Needs ``megatron.core.parallel_state`` initialised (its TP group is used; TP = 1 works too). Every TP rank
    must call it with its slice of the same rows (it is a collective).

    Args:
        logits: ``(N, T, V / TP)`` float (any float dtype) logits of this rank's vocabulary slice
            (rank r holds ids ``[r V/TP, (r+1) V/TP)``).
        labels: ``(N, T)`` long token ids in ``[0, V)``.
        temperature: the sampling temperature (> 0).
        with_entropy: also return the entropy (nats) of the tempered distribution, without grad.

    Returns:
        ``(logprobs, entropy)``: ``(N, T)`` float32 logprobs (differentiable w.r.t. ``logits``) and ``(N, T)``
        float32 entropy or None.

    Raises:
        ValueError: shape mismatch or temperature <= 0.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    z = logits.float() / temperature  # [N, T, V/TP], a new tensor: the cross-entropy below works in place on it
    entropy = None
    if with_entropy:
        entropy = _vocab_parallel_entropy(z.detach(), parallel_state.get_tensor_model_parallel_group())
    logprobs = -vocab_parallel_cross_entropy(z, labels)  # [N, T]
    return logprobs, entropy


@torch.no_grad()
def _vocab_parallel_entropy(z: Tensor, group: object) -> Tensor:
    """``H = logsumexp(z) - sum_v softmax(z)_v z_v`` over the full vocabulary from vocab slices ``z``
    ``(N, T, V/TP)`` float32; three all-reduces of ``(N, T)``. Returns ``(N, T)`` float32."""
    dist = torch.distributed
    local_max = z.amax(dim=-1)  # [N, T]
    dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
    shifted = z - local_max.unsqueeze(-1)  # [N, T, V/TP]
    exp = shifted.exp()
    sums = torch.stack([exp.sum(dim=-1), (exp * shifted).sum(dim=-1)])  # [2, N, T]
    dist.all_reduce(sums, group=group)
    sum_exp, weighted = sums
    # H = log S - sum(e^s s) / S with s = z - max (the shift cancels)
    return sum_exp.log() - weighted / sum_exp
