"""Collectives over the data-parallel processes that the training components share."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def gather_per_process(value: Any) -> list[Any]:
    """``value`` of every process, indexed by global rank (a collective when a process group exists: every
    process must call it)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values
