"""NonFiniteGuard and the weight checks on their own: a real optimizer step on a small module, no Trainer."""

import pytest
import torch
from torch import nn

from lightning_grpo.protocols.collectives import Collectives
from lightning_grpo.training.nonfinite import (
    NonFiniteError,
    NonFiniteGuard,
    check_finite_checkpoint,
    check_finite_parameters,
    nonfinite_names,
)

#: another process reports a non-finite value: every flag's sum is at least 1
OTHER_PROCESS_BAD = Collectives(reduce_sum=lambda t: t + 1)


def _model_with_grads():
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).square().sum().backward()
    return model, optimizer


def test_an_unknown_mode_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"GRPOConfig.on_nonfinite='ignore' is invalid: choose one of error, skip"):
        NonFiniteGuard("ignore")


@pytest.mark.parametrize("loss, norm, what", [(float("nan"), 1.0, "loss=nan"), (0.5, float("inf"), "grad_norm=inf")])
def test_error_mode_stops_before_the_step_naming_step_and_quantity(loss, norm, what):
    model, optimizer = _model_with_grads()
    guard = NonFiniteGuard("error")
    guard.observe_loss(loss)
    with pytest.raises(NonFiniteError, match=rf"optimizer step 4 \(global_step=3\): non-finite {what}"):
        guard.before_optimizer_step(3, torch.tensor(norm), optimizer)
    assert all(p.grad is not None for p in model.parameters())  # nothing dropped: the run stops


def test_error_mode_passes_finite_steps_and_leaves_inf_gradients_to_a_grad_scaler():
    _, optimizer = _model_with_grads()
    guard = NonFiniteGuard("error")
    guard.observe_loss(0.5)
    assert guard.before_optimizer_step(0, torch.tensor(2.0), optimizer) == {}
    guard.observe_loss(0.5)
    assert guard.before_optimizer_step(1, torch.tensor(float("inf")), optimizer, check_grad_norm=False) == {}


def test_skip_mode_drops_the_gradients_so_the_optimizer_changes_nothing():
    model, optimizer = _model_with_grads()
    before = [p.detach().clone() for p in model.parameters()]
    guard = NonFiniteGuard("skip")
    guard.observe_loss(float("inf"))
    assert guard.before_optimizer_step(0, torch.tensor(1.0), optimizer) == {"nonfinite_steps": 1.0}
    assert all(p.grad is None for p in model.parameters())
    optimizer.step()
    for old, new in zip(before, model.parameters(), strict=True):
        assert torch.equal(old, new)
    # the next step is finite: taken, and the count stays; the loss was consumed by the skipped step
    model(torch.randn(2, 3)).sum().backward()
    assert guard.before_optimizer_step(1, torch.tensor(1.0), optimizer) == {"nonfinite_steps": 1.0}
    assert all(p.grad is not None for p in model.parameters())
    optimizer.step()
    assert not torch.equal(before[0], model.weight)
    assert guard.state_dict() == {"skipped": 1}


def test_the_skip_count_round_trips_through_a_checkpoint():
    guard = NonFiniteGuard("skip")
    guard.load_state_dict({"skipped": 3})
    assert guard.skipped == 3 and guard.state_dict() == {"skipped": 3}
    guard.load_state_dict(None)  # a checkpoint written before the guard existed
    assert guard.skipped == 0


def test_nonfinite_names_finds_nan_and_inf_only_in_floating_tensors():
    big_half = torch.full((1000,), 60000.0, dtype=torch.float16)  # finite, but its sum overflows float16
    named = [("finite", torch.ones(3)), ("nan", torch.tensor([1.0, float("nan")])), ("ints", torch.arange(3)),
             ("empty", torch.empty(0)), ("half", big_half), ("ninf", torch.tensor([-float("inf")])),
             ("not a tensor", float("nan"))]
    assert nonfinite_names(named) == ["nan", "ninf"]


def test_check_finite_parameters_names_the_parameter_and_what_was_about_to_happen():
    model = nn.Linear(2, 2)
    check_finite_parameters(model, "sampling a rollout")  # finite: nothing happens
    with torch.no_grad():
        model.bias[1] = float("nan")
    with pytest.raises(NonFiniteError, match=r"non-finite weights before sampling a rollout: bias \(1 tensors\)"):
        check_finite_parameters(model, "sampling a rollout")


def test_check_finite_parameters_agrees_with_the_other_processes():
    model = nn.Linear(2, 2)
    check_finite_parameters(model, "x", Collectives())
    with pytest.raises(NonFiniteError, match="a parameter shard of another process"):
        check_finite_parameters(model, "sampling a rollout", OTHER_PROCESS_BAD)


def test_check_finite_checkpoint_looks_at_weights_and_optimizer_states():
    checkpoint = {"state_dict": {"policy.w": torch.ones(2)},
                  "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}}}]}
    check_finite_checkpoint(checkpoint)
    checkpoint["optimizer_states"][0]["state"][0]["exp_avg"] = torch.tensor([0.0, float("inf")])
    with pytest.raises(NonFiniteError, match=r"optimizer_states\[0\]\['state'\]\[0\]\['exp_avg'\] \(1 tensors\)"):
        check_finite_checkpoint(checkpoint)
    checkpoint["optimizer_states"][0]["state"][0]["exp_avg"] = torch.ones(2)
    with pytest.raises(NonFiniteError, match="a shard of another process"):
        check_finite_checkpoint(checkpoint, OTHER_PROCESS_BAD)
