"""adamw_with_warmup on its own: the learning rate of each optimizer step, worked by hand."""

import pytest
import torch

from lightning_grpo.training.optim import adamw_with_warmup


def _learning_rates(warmup_steps: int, steps: int) -> list[float]:
    parameter = torch.nn.Parameter(torch.ones(2))
    config = adamw_with_warmup([parameter], 1e-3, 0.1, (0.9, 0.99), warmup_steps)
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert config["lr_scheduler"]["interval"] == "step"
    group = optimizer.param_groups[0]
    assert (group["weight_decay"], group["betas"]) == (0.1, (0.9, 0.99)) and isinstance(optimizer, torch.optim.AdamW)
    rates = []
    for _ in range(steps):
        rates.append(group["lr"])
        parameter.grad = torch.ones(2)
        optimizer.step()
        scheduler.step()
    return rates


def test_the_learning_rate_rises_linearly_over_the_warmup_then_stays():
    # step k (0-based) trains with lr * min(1, (k + 1) / (warmup + 1))
    assert _learning_rates(3, 6) == pytest.approx([0.25e-3, 0.5e-3, 0.75e-3, 1e-3, 1e-3, 1e-3])
    assert _learning_rates(0, 3) == pytest.approx([1e-3] * 3)
