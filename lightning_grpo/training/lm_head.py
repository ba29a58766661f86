"""Token logprobs (and entropy) straight from the final hidden states and the output layer, chunk by chunk, so that
the ``[K, V]`` logits of the K scored tokens never exist at once, neither in the forward pass nor in backward.

For each chunk of C tokens: ``logits = h W^T (+ b)`` -> ``z = logits.float() / temperature`` -> min-p / top-k /
top-p truncation (:func:`lightning_grpo.protocols.sampling.sampling_removed`, the label kept) -> ``log p(y) = z_y -
logsumexp(z)`` and ``H = logsumexp(z) - sum_v p_v z_v``. Only ``h`` (``[K, H]``), the weight and the targets are
saved for backward, which recomputes each chunk's logits and accumulates

    dL/dz_v = g_lp (1[v = y] - p_v) - g_H p_v (log p_v + H)        (0 where truncation removed v)

into ``dL/dh = (dL/dz / T) W`` and ``dL/dW = (dL/dz / T)^T h``. Peak memory of the head: a few ``[C, V]`` float32
buffers instead of ``[K, V]`` logits plus their float32 copy and gradient (49,152-token vocabulary, K = 8,192:
1.6 GB each; C = 1,024: 0.2 GB). The values and gradients are those of
:func:`lightning_grpo.functional.token_logprobs` on the full logits (tests assert 1e-5), the technique of Unsloth's
"memory-efficient linear" GRPO loss and prime-rl's / NeMo-RL's chunked LM-head logprobs.

Pure torch (layer 0): the model-side hooks that feed it are in :mod:`lightning_grpo.training.logprobs`.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from torch import Tensor
from torch.nn import functional as F

from lightning_grpo.protocols.sampling import check_truncation, sampling_removed

#: Tokens per chunk by default (prime-rl's ``fused_lm_head_token_chunk_size``); top-p sorts the vocabulary and uses
#: chunks 8 times smaller, as :func:`lightning_grpo.functional.token_logprobs`.
DEFAULT_CHUNK_SIZE = 1024


def _chunks(total: int, chunk_size: int, top_p: float) -> list[tuple[int, int]]:
    size = max(1, chunk_size // 8) if top_p < 1.0 else max(1, chunk_size)
    return [(start, min(start + size, total)) for start in range(0, total, size)]


def _tempered(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor, temperature: float,
              truncation: tuple[int, float, float, tuple[int, ...]]) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """One chunk: ``(z, logits dtype, removed)``: the tempered float32 logits ``(C, V)`` with the truncated tokens at
    ``-inf`` (the label kept), the dtype the output layer computed in, and the removed mask (None: nothing)."""
    logits = F.linear(hidden, weight, bias)  # [C, V] in the compute dtype (autocast's, if on)
    dtype = logits.dtype
    z = logits.float().div_(temperature)  # [C, V], in place: the one [C, V] float32 buffer of the chunk so far
    del logits
    removed = sampling_removed(z, *truncation)
    if removed is not None:
        removed.scatter_(1, labels[:, None], False)  # the label stays in the support
        z.masked_fill_(removed, float("-inf"))
    return z, dtype, removed


def _dot(a: Tensor, b: Tensor) -> Tensor:
    """Row-wise ``(a * b).sum(-1)`` of ``(C, V)`` tensors without a ``(C, V)`` temporary: ``(C,)``."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def _grad_z(z: Tensor, removed: Optional[Tensor], labels: Tensor, grad_logprobs: Optional[Tensor],
            grad_entropy: Optional[Tensor]) -> Tensor:
    """``dL/dz`` ``(C, V)`` of one chunk from its tempered logits ``z`` (overwritten), the ``(C, 1)`` labels and the
    ``(C, 1)`` incoming gradients of the logprobs and the entropy (None: zero), in two ``[C, V]`` float32 buffers:
    ``z`` (then ``log p``, then the entropy term) and ``p`` (then the result)."""
    log_p = z.sub_(torch.logsumexp(z, dim=-1, keepdim=True))  # [C, V], -inf where removed
    grad_z = log_p.exp()  # p, 0 where removed
    term = None
    if grad_entropy is not None:
        if removed is not None:
            log_p.masked_fill_(removed, 0.0)  # finite; p = 0 there
        entropy = -_dot(grad_z, log_p)[:, None]  # [C, 1]
        term = log_p.add_(entropy).mul_(grad_z).mul_(grad_entropy.to(grad_z.dtype))  # g_H p (log p + H)
    if grad_logprobs is not None:
        g = grad_logprobs.to(grad_z.dtype)  # [C, 1]
        grad_z.mul_(-g).scatter_add_(1, labels, g)  # g (onehot(y) - p)
    else:
        grad_z.zero_()
    if term is not None:
        grad_z.sub_(term)
    return grad_z


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """``(hidden [K, H], weight [V, H], bias [V] | None, labels [K]) -> (logprobs [K], entropy [K])`` float32, with
    the logits recomputed chunk by chunk in backward (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Optional[Tensor], labels: Tensor,
                temperature: float, top_k: int, top_p: float, min_p: float, with_entropy: bool, entropy_grad: bool,
                chunk_size: int, banned: tuple[int, ...] = ()) -> tuple[Tensor, Tensor]:
        truncation = (top_k, top_p, min_p, banned)
        logprobs = hidden.new_zeros(labels.shape, dtype=torch.float32)  # [K]
        entropy = hidden.new_zeros(labels.shape, dtype=torch.float32)  # [K]
        for start, end in _chunks(labels.numel(), chunk_size, top_p):
            z, _, removed = _tempered(hidden[start:end], weight, bias, labels[start:end], temperature, truncation)
            lse = torch.logsumexp(z, dim=-1)  # [C]
            logprobs[start:end] = z.gather(1, labels[start:end, None]).squeeze(1) - lse
            if with_entropy:
                probs = torch.softmax(z, dim=-1)  # [C, V]
                if removed is not None:
                    z.masked_fill_(removed, 0.0)  # p = 0 there: no 0 * -inf
                entropy[start:end] = lse - probs.mul_(z).sum(-1)  # in place: the full path's sum, bit for bit
                del probs
            del z, removed
        device_type = hidden.device.type
        ctx.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        ctx.settings = (temperature, truncation, entropy_grad and with_entropy, chunk_size)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(hidden, weight, bias if bias is not None else hidden.new_empty(0), labels)
        if not (entropy_grad and with_entropy):
            ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, grad_logprobs: Optional[Tensor], grad_entropy: Optional[Tensor]) -> tuple:
        hidden, weight, bias, labels = ctx.saved_tensors
        temperature, truncation, entropy_grad, chunk_size = ctx.settings
        bias = bias if ctx.has_bias else None
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if need_bias and bias is not None else None
        device_type, enabled, dtype = ctx.autocast
        use_entropy = entropy_grad and grad_entropy is not None
        with torch.no_grad(), torch.autocast(device_type, dtype, enabled=enabled):
            for start, end in _chunks(labels.numel(), chunk_size, truncation[1]):
                h = hidden[start:end]  # [C, H]
                y = labels[start:end, None]  # [C, 1]
                z, logits_dtype, removed = _tempered(h, weight, bias, labels[start:end], temperature, truncation)
                grad_z = _grad_z(z, removed, y, None if grad_logprobs is None else grad_logprobs[start:end, None],
                                 grad_entropy[start:end, None] if use_entropy else None)
                del z, removed
                grad_logits = grad_z.div_(temperature).to(logits_dtype)  # the .float() cast's backward, [C, V]
                del grad_z
                if grad_hidden is not None:
                    grad_hidden[start:end] = grad_logits.mm(weight.to(logits_dtype)).to(hidden.dtype)
                if grad_weight is not None:
                    grad_weight += grad_logits.t().mm(h.to(logits_dtype)).float()
                if grad_bias is not None:
                    grad_bias += grad_logits.float().sum(0)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None, None, None, None


def chunked_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    bias: Optional[Tensor] = None,
    temperature: float = 1.0,
    *,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    banned_token_ids: Sequence[int] = (),
) -> tuple[Tensor, Optional[Tensor]]:
    """Logprobs of ``labels`` under the sampling distribution of ``softmax((hidden @ weight.T + bias) / temperature)``
    truncated by min-p / top-k / top-p (vLLM's order, the label always kept), computed ``chunk_size`` tokens at a
    time in forward and backward: the same values and gradients as
    ``functional.token_logprobs(F.linear(hidden, weight, bias), labels, ...)`` without the ``[K, V]`` logits.

    Args:
        hidden: ``(K, H)`` float final hidden states (after the model's last norm) of the positions that predict
            ``labels``; any float dtype, autocast respected (the logits are computed as the output layer would).
        weight: ``(V, H)`` output-layer (lm_head) weight; tied embeddings are the same tensor.
        labels: ``(K,)`` long target ids in ``[0, V)``.
        bias: ``(V,)`` output-layer bias or None.
        temperature: > 0.
        top_k, top_p, min_p: the rollout's truncation (:func:`lightning_grpo.protocols.sampling.sampling_removed`).
        with_entropy: also return the per-token entropy (nats) of the truncated distribution.
        entropy_grad: the entropy is differentiable (an entropy bonus); else it carries no gradient.
        chunk_size: tokens per chunk (>= 1); top-p uses chunks 8 times smaller (it sorts the vocabulary).
        banned_token_ids: tokens the engines never sample, removed first (a vision-language model's placeholders).

    Returns:
        ``(logprobs, entropy)``: ``(K,)`` float32 (differentiable w.r.t. ``hidden``, ``weight`` and ``bias``), and
        ``(K,)`` float32 or None.

    Raises:
        ValueError: shapes that do not match, temperature <= 0, a bad truncation setting or ``chunk_size < 1``.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be (K, H) and weight {tuple(weight.shape)} (V, H)")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels {tuple(labels.shape)} must be (K,) = ({hidden.shape[0]},)")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"bias {tuple(bias.shape)} must be (V,) = ({weight.shape[0]},)")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size} must be >= 1")
    check_truncation(top_k, top_p, min_p)
    logprobs, entropy = _ChunkedTokenLogprobs.apply(hidden, weight, bias, labels, float(temperature), int(top_k),
                                                    float(top_p), float(min_p), bool(with_entropy),
                                                    bool(entropy_grad), int(chunk_size),
                                                    tuple(int(t) for t in banned_token_ids))
    if not with_entropy:
        return logprobs, None
    return logprobs, entropy if entropy_grad else entropy.detach()
