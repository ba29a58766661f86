"""adamw_with_warmup on its own: the learning rate of each optimizer step, worked by hand; the check that the
optimizers hold exactly the trained parameters."""

import copy

import pytest
import torch

from lightning_grpo.training.optim import adamw_with_warmup, check_optimized_parameters, rounded_away_fraction


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


def test_an_update_below_half_a_bfloat16_spacing_is_rounded_away():
    """Worked by hand at lr = 1e-3 (issue 44): 1.5 (spacing 2**-7, half 0.0039) and 0.75 (half 0.00195) cannot take
    it, 3e-3 (half 2**-17) and 0 can; float32 weights always can: 2 of 6. One real AdamW step (whose first step
    moves each weight by lr) leaves exactly those two unchanged."""
    half = torch.tensor([1.5, 0.75, 0.0, 3e-3], dtype=torch.bfloat16)
    full = torch.tensor([1.5, 0.75])
    assert rounded_away_fraction([half, full], 1e-3) == pytest.approx(2 / 6)
    params = [torch.nn.Parameter(half.clone()), torch.nn.Parameter(full.clone())]
    for p in params:
        p.grad = torch.ones_like(p)
    torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0).step()
    assert (params[0].detach() == half).tolist() == [True, True, False, False]
    assert not (params[1].detach() == full).any()
    assert rounded_away_fraction([half], 1e-1) == 0.0 and rounded_away_fraction([], 1e-3) == 0.0


def test_the_optimizers_must_hold_exactly_the_trained_parameters():
    policy = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    policy[1].bias.requires_grad_(False)  # frozen: may be held or left out
    trained = [p for p in policy.parameters() if p.requires_grad]
    check_optimized_parameters(policy, [torch.optim.SGD(trained, lr=0.1)])
    check_optimized_parameters(policy, [torch.optim.SGD(policy.parameters(), lr=0.1)])
    with pytest.raises(ValueError, match=r"an optimizer over 4 parameters that the trained policy \(Sequential\) "
                                         r"does not hold \(shapes \(3, 2\), \(3,\), \(1, 3\), ...\)"):
        check_optimized_parameters(policy, [torch.optim.SGD(copy.deepcopy(policy).parameters(), lr=0.1)])
    with pytest.raises(ValueError, match=r"2 trainable parameters of the policy are in no optimizer that "
                                         r"configure_optimizers returned \(0.bias, 1.weight\)"):
        check_optimized_parameters(policy, [torch.optim.SGD(trained[:1], lr=0.1)])
