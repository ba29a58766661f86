"""Experience and micro_batches on their own: row selection and trimming, and the flags, normalizers and scales of a
rollout's micro-batches (fixed counts), worked by hand."""

import pytest
import torch

from lightning_grpo.protocols.collectives import Collectives
from lightning_grpo.training.experience import Experience, StepPlan, micro_batches


def _experience() -> Experience:
    """4 sequences; completion lengths 3, 1, 0 (no loss), 2; prompts of 1 to 3 tokens, left-padded."""
    return Experience(
        prompt_ids=torch.tensor([[0, 0, 5], [0, 6, 7], [8, 9, 4], [0, 0, 3]]),
        prompt_mask=torch.tensor([[0, 0, 1], [0, 1, 1], [1, 1, 1], [0, 0, 1]]),
        completion_ids=torch.tensor([[11, 12, 13, 0], [14, 0, 0, 0], [15, 16, 0, 0], [17, 18, 0, 0]]),
        completion_mask=torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0]]),
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
        old_logprobs=-torch.arange(16, dtype=torch.float32).view(4, 4),
        metrics={"reward": 0.25},
    )


def test_select_takes_rows_and_trims_the_all_padding_columns():
    selected = _experience().select(torch.tensor([3, 1]))
    assert selected.prompt_ids.tolist() == [[0, 3], [6, 7]]  # the first prompt column is padding in both rows
    assert selected.completion_ids.tolist() == [[17, 18], [14, 0]]  # so are the last two completion columns
    assert selected.completion_mask.tolist() == [[1, 1], [1, 0]]
    assert selected.old_logprobs.tolist() == [[-12.0, -13.0], [-4.0, -5.0]]
    assert selected.advantages.tolist() == [-0.5, -1.0] and selected.metrics == {} and len(selected) == 2
    empty = _experience().select(torch.tensor([2]))  # no loss token: one completion column is kept
    assert empty.completion_ids.shape == (1, 1) and empty.prompt_ids.shape == (1, 3)


def test_micro_batches_flags_normalizers_and_scales_golden():
    out = list(micro_batches(_experience(), mini_batch_size=2, accumulate_grad_batches=2, num_iterations=2,
                             loss_type="dapo", max_new_tokens=4, world_size=3,
                             generator=torch.Generator().manual_seed(0)))
    assert len(out) == 2 * 2 * 2  # passes x steps per pass x micro-batches per step
    assert [(mb.step_start, mb.step_end) for mb in out] == [(True, False), (False, True)] * 4
    assert [mb.on_policy for mb in out] == [True, True] + [False] * 6  # only the rollout's first step
    assert all(mb.loss_scale == 2 * 3 for mb in out)  # undoes accumulate_grad_batches * world_size averaging
    tokens = [3, 1, 0, 2]
    for i in range(0, 8, 2):  # each step's normalizer: the loss tokens of its 2 sequences
        rows = [int(r) for mb in out[i: i + 2] for r in mb.rows]
        assert out[i].loss_normalizer == out[i + 1].loss_normalizer == sum(tokens[r] for r in rows)
    for start in (0, 4):  # each pass covers every sequence once
        assert sorted(int(r) for mb in out[start: start + 4] for r in mb.rows) == [0, 1, 2, 3]
    assert [mb.metrics for mb in out] == [{}, {"reward": 0.25}] * 4  # the rollout metrics on step-end ones


def test_the_normalizer_is_summed_over_processes():
    two_alike = Collectives(reduce_sum=lambda t: t + t)
    (step,) = micro_batches(_experience(), mini_batch_size=4, accumulate_grad_batches=1, num_iterations=1,
                            loss_type="grpo", max_new_tokens=4, collectives=two_alike)
    assert step.loss_normalizer == 2 * 3  # grpo: the sequences with a loss token, on both processes
    (step,) = micro_batches(_experience(), mini_batch_size=4, accumulate_grad_batches=1, num_iterations=1,
                            loss_type="dr_grpo", max_new_tokens=4, collectives=two_alike)
    assert step.loss_normalizer == 2 * 4 * 4  # dr_grpo: every sequence times max_new_tokens


@pytest.mark.parametrize("kwargs, message", [
    ({"mini_batch_size": 3, "accumulate_grad_batches": 1},
     r"GRPOConfig.mini_batch_size=3 must divide the rollout batch of 4 sequences"),
    ({"mini_batch_size": 4, "accumulate_grad_batches": 3}, r"Trainer\(accumulate_grad_batches=3\) must divide "
                                                           r"GRPOConfig.mini_batch_size=4"),
    ({"mini_batch_size": 4, "accumulate_grad_batches": 2, "max_tokens_per_microbatch": 8},
     r"max_tokens_per_microbatch=8 forms the micro-batches of a step by token budget: set "
     r"Trainer\(accumulate_grad_batches=1\), not 2"),
])
def test_sizes_that_do_not_divide_are_refused_naming_the_fields(kwargs, message):
    with pytest.raises(ValueError, match=message):
        list(micro_batches(_experience(), num_iterations=1, loss_type="dapo", max_new_tokens=4, **kwargs))


def test_a_micro_batch_with_its_step_plan_goes_through_lightnings_batch_hooks():
    """Lightning walks a batch's dataclass fields to move or cast it (``move_data_to_device``, the precision plugins'
    ``convert_input``: FSDP's failed with "A frozen dataclass was passed to apply_to_collection" on a frozen plan):
    the plan is handed through as it is, the batch's tensors converted."""
    from lightning.pytorch.utilities import move_data_to_device
    from lightning_utilities.core.apply_func import apply_to_collection

    later = Experience(prompt_ids=torch.ones(1, 2, dtype=torch.long), prompt_mask=torch.ones(1, 2, dtype=torch.long),
                       completion_ids=torch.ones(1, 3, dtype=torch.long),
                       completion_mask=torch.ones(1, 3, dtype=torch.long), advantages=torch.zeros(1))
    plan = StepPlan({"entropy_threshold": 0.5}, torch.zeros(1, 3, dtype=torch.bool), (later,))
    batch = Experience(prompt_ids=torch.ones(1, 2, dtype=torch.long), prompt_mask=torch.ones(1, 2, dtype=torch.long),
                       completion_ids=torch.ones(1, 3, dtype=torch.long),
                       completion_mask=torch.ones(1, 3, dtype=torch.long), advantages=torch.tensor([1.5]),
                       step_plan=plan)
    cast = apply_to_collection(batch, torch.Tensor, lambda t: t.double() if t.is_floating_point() else t)
    assert cast.step_plan is plan and cast.advantages.dtype == torch.float64
    moved = move_data_to_device(batch, torch.device("cpu"))
    assert moved.step_plan is plan and plan.later[0] is later
