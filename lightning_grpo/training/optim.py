"""The optimizer of the policy: AdamW with a linear warmup, as Lightning's ``configure_optimizers`` returns it."""

from __future__ import annotations

import math
import numbers
from typing import Any, Iterable, Sequence

import torch


def adamw_with_warmup(params: Iterable[torch.nn.Parameter], learning_rate: float, weight_decay: float,
                      betas: tuple[float, float], warmup_steps: int) -> dict[str, Any]:
    """AdamW (Loshchilov & Hutter 2019) whose learning rate rises linearly from ``lr / (warmup_steps + 1)`` to
    ``lr`` over ``warmup_steps`` optimizer steps and then stays constant; a per-step scheduler."""
    beta1, beta2 = betas
    optimizer = torch.optim.AdamW(list(params), lr=learning_rate, weight_decay=weight_decay, betas=(beta1, beta2))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / (warmup_steps + 1)) if warmup_steps else 1.0
    )
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


#: Names of the dtypes :class:`lightning_grpo.GRPOModule` loads model weights in (``dtype=``).
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def check_optimizer_arguments(
    learning_rate: float,
    weight_decay: float,
    adam_betas: Sequence[float],
    warmup_steps: int,
    dtype: str,
) -> None:
    """Validate the optimizer and weight arguments of :class:`lightning_grpo.GRPOModule` (AdamW, Loshchilov and
    Hutter 2019, with a linear warmup).

    Args:
        learning_rate: AdamW peak learning rate: finite and > 0.
        weight_decay: AdamW weight decay: finite and >= 0.
        adam_betas: AdamW ``(beta1, beta2)``: two finite numbers, each in [0, 1).
        warmup_steps: optimizer steps of linear warmup: an int >= 0.
        dtype: one of :data:`DTYPE_NAMES`.

    Raises:
        ValueError: an argument out of range or not finite; the message names the argument and its value.
    """
    if not _is_number(learning_rate) or not math.isfinite(learning_rate) or learning_rate <= 0:
        raise ValueError(f"learning_rate={learning_rate!r} is invalid: must be a finite number > 0")
    if not _is_number(weight_decay) or not math.isfinite(weight_decay) or weight_decay < 0:
        raise ValueError(f"weight_decay={weight_decay!r} is invalid: must be a finite number >= 0")
    betas = tuple(adam_betas) if isinstance(adam_betas, (tuple, list)) else None
    if betas is None or len(betas) != 2 or not all(_is_number(b) and math.isfinite(b) and 0 <= b < 1 for b in betas):
        raise ValueError(f"adam_betas={adam_betas!r} is invalid: must be two finite numbers, each in [0, 1)")
    if not isinstance(warmup_steps, numbers.Integral) or isinstance(warmup_steps, bool) or warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps!r} is invalid: must be an int >= 0")
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype={dtype!r} is invalid: choose one of {', '.join(DTYPE_NAMES)}")


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)
