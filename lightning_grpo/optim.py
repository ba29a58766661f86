"""The optimizer of the policy: AdamW with a linear warmup, as Lightning's ``configure_optimizers`` returns it."""

from __future__ import annotations

from typing import Any, Iterable

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
