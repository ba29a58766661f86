"""What the per-token weight versions of a streamed rollout say: how stale its tokens and samples are, how many
samples span an in-flight weight update (verl's ``partial_ratio`` / ``max_partial_span``), and which tokens are of
each sample's newest version (``streaming.newest_version_only``, slime's ``--mask-offpolicy-in-partial-rollout``).

A token's staleness is ``trainer_version - token_version``: the optimizer steps between the weights that sampled it
and the weights it is trained from (the proximal policy of AReaL's decoupled objective). A sample's is that of its
oldest token (what the age bound reads).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_grpo.protocols.collectives import Collectives


def sampled(versions: Tensor, mask: Tensor) -> Tensor:
    """``(N, T)`` bool: the tokens an engine sampled and stamped (``mask`` 1 and a version >= 0)."""
    return mask.bool() & (versions >= 0)


def newest_version_mask(versions: Tensor, mask: Tensor) -> Tensor:
    """``(N, T)`` long: ``mask`` kept only on each row's tokens of its newest version (the tokens a sample got before
    the last weight update it saw are dropped from the loss; a row of one version keeps all its tokens).

    Args:
        versions: ``(N, T)`` long, each token's weight version (-1: not sampled).
        mask: ``(N, T)`` the loss mask.

    Example (golden): versions ``[[3, 3, 4, -1], [5, 5, 5, 5]]``, mask all 1 -> ``[[0, 0, 1, 1], [1, 1, 1, 1]]``
    (the unstamped token keeps its mask).
    """
    stamped = sampled(versions, mask)
    newest = torch.where(stamped, versions, torch.full_like(versions, -1)).amax(dim=1, keepdim=True)
    keep = ~stamped | (versions == newest)
    return mask * keep.to(mask.dtype)


def _quantile(values: Tensor, q: float) -> float:
    return float(torch.quantile(values.double(), q)) if values.numel() else 0.0


def version_metrics(versions: Tensor, mask: Tensor, trainer_version: int, collectives: Collectives) -> dict[str, float]:
    """The staleness and version-span metrics of a rollout, all processes together (means and maxima reduced; the
    90th percentiles, linear interpolation, this process's).

    Args:
        versions: ``(N, T)`` long, each completion token's weight version (-1: not sampled).
        mask: ``(N, T)``, the sampled completion tokens.
        trainer_version: the trainer's optimizer steps (the weights the rollout is trained from).
        collectives: the data-parallel reductions.

    Returns:
        ``streaming/token_staleness/{mean,p90,max}`` (over tokens), ``streaming/sample_staleness/{mean,p90,max}``
        (over samples, each its oldest token's), ``streaming/partial_ratio`` (the share of samples whose tokens span
        more than one version), ``streaming/max_partial_span`` (the most versions between a sample's oldest and
        newest token), and ``rollout/staleness_{mean,max}`` (the token mean and max, the fixed schedule's names).
        Zero for a rollout without a sampled token.

    Example (golden): trainer version 5, versions ``[[3, 3, 4], [5, 5, -1]]``, mask all 1: token ages ``[2, 2, 1, 0,
    0]`` (mean 1.0, p90 2.0, max 2), sample ages ``[2, 0]`` (mean 1.0, max 2), partial ratio 0.5, span 1.
    """
    stamped = sampled(versions, mask)
    ages = (trainer_version - versions)[stamped].double()
    rows = stamped.any(dim=1)
    oldest = torch.where(stamped, versions, torch.full_like(versions, torch.iinfo(torch.long).max)).amin(dim=1)[rows]
    newest = torch.where(stamped, versions, torch.full_like(versions, -1)).amax(dim=1)[rows]
    sample_ages = (trainer_version - oldest).double()
    spans = (newest - oldest).double()
    local = torch.tensor([float(ages.sum()), float(ages.numel()), float(sample_ages.sum()), float(sample_ages.numel()),
                          float((spans > 0).sum())], dtype=torch.float64)
    summed = collectives.reduce_sum(local.to(collectives.device)).cpu().tolist()
    token_sum, tokens, sample_sum, samples, partial = summed
    maxima = torch.tensor([float(ages.max()) if ages.numel() else 0.0,
                           float(sample_ages.max()) if sample_ages.numel() else 0.0,
                           float(spans.max()) if spans.numel() else 0.0], dtype=torch.float64)
    token_max, sample_max, span_max = collectives.reduce_max(maxima.to(collectives.device)).cpu().tolist()
    token_mean = token_sum / tokens if tokens else 0.0
    return {
        "streaming/token_staleness/mean": token_mean,
        "streaming/token_staleness/p90": _quantile(ages, 0.9),
        "streaming/token_staleness/max": token_max,
        "streaming/sample_staleness/mean": sample_sum / samples if samples else 0.0,
        "streaming/sample_staleness/p90": _quantile(sample_ages, 0.9),
        "streaming/sample_staleness/max": sample_max,
        "streaming/partial_ratio": partial / samples if samples else 0.0,
        "streaming/max_partial_span": span_max,
        "rollout/staleness_mean": token_mean,
        "rollout/staleness_max": token_max,
    }
