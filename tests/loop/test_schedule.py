"""The rollout schedule and the LoopPlan the module hands the loop (loop/schedule.py): steps and micro-batches per
rollout worked by hand, the rollouts generated ahead and the settings refused, and a plan's cut equal to the
micro-batches of training/experience.py with the same settings."""

import pytest
import torch

from lightning_grpo import GRPOConfig
from lightning_grpo.loop.schedule import NO_PROMPTS_PER_STEP, LoopPlan
from lightning_grpo.protocols.collectives import Collectives
from lightning_grpo.training.experience import Experience, micro_batches


def _plan(prompts_per_step=2, accumulate=2, **config) -> LoopPlan:
    config = GRPOConfig(**{"num_generations": 4, "mini_batch_size": 4, "num_iterations": 2, **config})
    return LoopPlan(config, prompts_per_step, accumulate, data_parallel_size=1, collectives=Collectives(),
                    token_budget=None, plan_step=lambda members: [])


def test_steps_and_micro_batches_per_rollout():
    plan = _plan()  # 2 prompts x 4 = 8 sequences, mini-batches of 4, 2 passes: 4 steps of 2 micro-batches
    assert plan.steps_per_rollout() == 4 and plan.micro_batches_per_rollout() == 8
    assert _plan(mini_batch_size=None, num_iterations=1).steps_per_rollout() == 1
    assert _plan(max_tokens_per_microbatch=100, accumulate=1).micro_batches_per_rollout() is None  # they vary
    with pytest.raises(ValueError, match="GRPO needs the datamodule's prompts_per_step"):
        _plan(prompts_per_step=None).micro_batches_per_rollout()
    assert "prompts_per_step" in NO_PROMPTS_PER_STEP


def test_rollouts_ahead_and_the_staleness_refused():
    assert _plan().rollouts_ahead(10) == 0  # synchronous
    assert _plan(max_staleness=8).rollouts_ahead(10) == 2 and _plan(max_staleness=11).rollouts_ahead(None) == 2
    with pytest.raises(ValueError, match="max_staleness=3 is less than the 4 optimizer steps of one rollout"):
        _plan(max_staleness=3).rollouts_ahead(10)
    with pytest.raises(ValueError, match="generates 2 rollouts ahead .* an epoch has only 2 rollout batches"):
        _plan(max_staleness=8).rollouts_ahead(2)


def test_a_plans_cut_is_the_micro_batches_of_its_settings():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (8, 3), generator=g)
    experience = Experience(prompt_ids=ids, prompt_mask=torch.ones_like(ids),
                            completion_ids=torch.randint(0, 50, (8, 5), generator=g),
                            completion_mask=torch.tensor([[1] * n + [0] * (5 - n) for n in (5, 3, 1, 4, 2, 5, 3, 4)]),
                            advantages=torch.linspace(-1, 1, 8))
    plan = _plan(shuffle_seed=3)
    got = list(plan.micro_batches(experience, step=5))
    want = list(micro_batches(experience, mini_batch_size=4, accumulate_grad_batches=2, num_iterations=2,
                              loss_type=plan.config.loss_type, max_new_tokens=plan.config.max_new_tokens,
                              generator=torch.Generator().manual_seed(3 + 5)))
    assert len(got) == len(want) == 8
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.rows, b.rows) and torch.equal(a.completion_ids, b.completion_ids)
        assert (a.loss_normalizer, a.loss_scale, a.step_start, a.step_end, a.on_policy) == \
            (b.loss_normalizer, b.loss_scale, b.step_start, b.step_end, b.on_policy)
