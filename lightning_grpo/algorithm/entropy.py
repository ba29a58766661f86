"""Training only on high-entropy "forking" tokens (Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy
Minority Tokens Drive Effective RL for LLM Reasoning", arXiv:2506.01939, eq. 5 / sec. 4)."""

from __future__ import annotations

import math
from typing import Optional

from torch import Tensor


def entropy_threshold(values: Tensor, quantile: float) -> float:
    """The ``1 - quantile`` quantile (linear interpolation, as ``torch.quantile``) of the entropies ``values``
    (``(M,)`` float, the loss tokens of a batch or of a whole optimizer step); ``-inf`` when ``M = 0`` or
    ``quantile >= 1`` (every token kept).

    Raises:
        ValueError: ``quantile`` outside [0, 1].
    """
    if not 0 <= quantile <= 1:
        raise ValueError(f"top_entropy_quantile={quantile} must be in [0, 1]")
    values = values.detach().float().flatten().sort().values  # [M]
    if quantile >= 1 or values.numel() == 0:
        return -math.inf
    position = (values.numel() - 1) * (1.0 - quantile)
    low = math.floor(position)
    high = min(low + 1, values.numel() - 1)
    return float(values[low] + (position - low) * (values[high] - values[low]))


def high_entropy_mask(entropy: Tensor, mask: Tensor, quantile: float, threshold: Optional[float] = None) -> Tensor:
    """The tokens whose entropy is in the top ``quantile`` fraction of the batch's loss tokens.

    The threshold is the ``1 - quantile`` quantile (linear interpolation, as ``torch.quantile``) of the entropies
    at the unmasked positions; tokens with entropy >= threshold are kept (TRL's ``top_entropy_quantile`` = the
    paper's rho, 0.2 in the paper). ``quantile = 1`` keeps every token, ``0`` only the highest-entropy one(s).

    Args:
        entropy: ``(N, T)`` float per-token entropy (masked positions may be anything, NaN included).
        mask: ``(N, T)`` 0/1 loss mask.
        quantile: rho in [0, 1].
        threshold: a precomputed threshold (:func:`entropy_threshold` over the whole optimizer step, all processes);
            None = computed from the tokens given.

    Returns:
        ``(N, T)`` bool, a subset of ``mask``.

    Raises:
        ValueError: ``quantile`` outside [0, 1].

    Example (golden): unmasked entropies [0.1, 0.5, 0.9, 0.3, 0.7]: rho 0.2 -> threshold 0.74, keeps 0.9;
    rho 0.4 -> threshold 0.58, keeps 0.9 and 0.7.
    """
    if not 0 <= quantile <= 1:
        raise ValueError(f"top_entropy_quantile={quantile} must be in [0, 1]")
    mask = mask.bool()
    if quantile >= 1:
        return mask
    if threshold is None:
        threshold = entropy_threshold(entropy.detach()[mask], quantile)
    return mask & (entropy.detach() >= threshold)
