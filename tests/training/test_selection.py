"""StepSelection on its own: the step-level statistics (high-entropy cut, covariance centers, KL-Cov's cut, Clip-Cov's
draw) are the same whether the step is one micro-batch or four, and equal the statistics of the whole step computed
directly; a micro-batch without a step plan gets its own. A tiny random Llama and CompletionLogprobs, no GRPOModule,
no Trainer."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_grpo import GRPOConfig
from lightning_grpo.algorithm import grpo_objective, selection_count, token_covariance
from lightning_grpo.algorithm.entropy import entropy_threshold
from lightning_grpo.protocols.collectives import Collectives
from lightning_grpo.training.experience import Experience, micro_batches
from lightning_grpo.training.logprobs import CompletionLogprobs
from lightning_grpo.training.selection import StepSelection, needs_step_selection

#: two processes holding the same data: every sum doubles
TWO_ALIKE = Collectives(reduce_sum=lambda t: t + t)
#: Clip-Cov with every loss token a candidate (on-policy: no PPO clip is active), 1 in 4 drawn
CLIP_COV = {"policy_loss_mode": "clip_cov", "clip_cov_lb": -100.0, "clip_cov_ub": 100.0, "clip_cov_ratio": 0.25}


@pytest.fixture(scope="module")
def policy(tiny_llama_path):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()


def _experience(vocab_size: int) -> Experience:
    """2 prompts x G=4, completions of 1 to 5 loss tokens, advantages that differ within each group."""
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, vocab_size, (2, 4), generator=g).repeat_interleave(4, dim=0)
    lengths = [5, 3, 1, 4, 2, 5, 3, 4]
    return Experience(
        prompt_ids=prompts, prompt_mask=torch.ones_like(prompts),
        completion_ids=torch.randint(0, vocab_size, (8, 5), generator=g),
        completion_mask=torch.tensor([[1] * n + [0] * (5 - n) for n in lengths]),
        advantages=torch.tensor([1.0, -0.5, 0.25, -0.75, 0.5, -1.0, 1.5, -1.0]),
    )


def _members(experience: Experience, accumulate: int, config: GRPOConfig) -> list[Experience]:
    """The micro-batches of the rollout's one optimizer step, as the loop hands them forward (shuffled with a seed
    of their own per split: the rows come in another order)."""
    members = list(micro_batches(experience, mini_batch_size=8, accumulate_grad_batches=accumulate, num_iterations=1,
                                 loss_type=config.loss_type, max_new_tokens=5,
                                 generator=torch.Generator().manual_seed(accumulate)))
    assert len(members) == accumulate and members[-1].step_end
    return members


def _prepared(policy, config: GRPOConfig, members, collectives=Collectives(), step: int = 7) -> list[dict]:  # noqa: B008
    """The objective's keyword arguments of each micro-batch, from the step's plans (one per micro-batch, sharing the
    step's statistics)."""
    plans = StepSelection(config, CompletionLogprobs(config)).plan(policy, members, collectives, step)
    assert len(plans) == len(members) and all(p.statistics is plans[0].statistics for p in plans)
    return [plan.objective_kwargs() for plan in plans]


def _selected_tokens(members, kwargs) -> set[tuple[int, int]]:
    """Clip-Cov's drawn tokens as (rollout row, completion position)."""
    return {(int(mb.rows[r]), int(c)) for mb, kw in zip(members, kwargs, strict=True)
            for r, c in kw["clip_cov_selected"].nonzero().tolist()}


def test_the_high_entropy_cut_is_the_whole_steps_quantile_in_any_split(policy):
    config = GRPOConfig(top_entropy_quantile=0.5)
    experience = _experience(policy.config.vocab_size)
    with torch.no_grad():
        _, entropy = CompletionLogprobs(config)(policy, experience, with_entropy=True)
    expected = entropy_threshold(entropy[experience.completion_mask.bool()], 0.5)
    for accumulate in (1, 4):
        kwargs = _prepared(policy, config, _members(experience, accumulate, config))
        assert [set(kw) for kw in kwargs] == [{"entropy_threshold"}] * accumulate
        for kw in kwargs:
            assert kw["entropy_threshold"] == pytest.approx(expected, abs=1e-5)


def test_the_covariance_centers_and_kl_cov_cut_are_the_whole_steps(policy):
    config = GRPOConfig(policy_loss_mode="kl_cov", kl_cov_ratio=0.2, clip_ratio_c=None)
    experience = _experience(policy.config.vocab_size)
    mask = experience.completion_mask.bool()
    with torch.no_grad():
        logprobs, _ = CompletionLogprobs(config)(policy, experience)
    token_advantages = experience.advantages.unsqueeze(1).expand_as(logprobs)
    centers = (float(logprobs[mask].mean()), float(token_advantages[mask].mean()))  # token-weighted
    assert centers[1] == pytest.approx((5 - 1.5 + 0.25 - 3 + 1 - 5 + 4.5 - 4) / 27)
    covariance = token_covariance(logprobs, token_advantages, mask, *centers)[mask]
    count = selection_count(27, 0.2)  # 5 of the 27 loss tokens
    for accumulate, collectives in ((1, Collectives()), (4, Collectives()), (4, TWO_ALIKE)):
        for kw in _prepared(policy, config, _members(experience, accumulate, config), collectives):
            stats = kw["covariance_stats"]
            assert (stats.logprob_mean, stats.advantage_mean) == pytest.approx(centers, abs=1e-5)
            assert int((covariance >= stats.kl_threshold - 1e-6).sum()) == count  # the count-th largest


def test_clip_cov_draws_the_same_tokens_in_any_split_from_the_steps_generator(policy):
    config = GRPOConfig(**CLIP_COV)
    experience = _experience(policy.config.vocab_size)
    whole_members = _members(experience, 1, config)
    whole = _selected_tokens(whole_members, _prepared(policy, config, whole_members))
    split_members = _members(experience, 4, config)
    split_kwargs = _prepared(policy, config, split_members)
    assert _selected_tokens(split_members, split_kwargs) == whole
    assert len(whole) == selection_count(27, 0.25) == 6
    loss_tokens = {(r, c) for r, c in experience.completion_mask.nonzero().tolist()}
    assert whole <= loss_tokens
    for mb, kw in zip(split_members, split_kwargs, strict=True):
        assert kw["clip_cov_selected"].shape == mb.completion_mask.shape
        assert isinstance(kw["generator"], torch.Generator)
    # another optimizer step draws from another generator
    assert _selected_tokens(whole_members, _prepared(policy, config, whole_members, step=8)) != whole


def test_no_knob_needs_no_extra_forward_pass(policy):
    config = GRPOConfig()
    assert not needs_step_selection(config)
    assert needs_step_selection(GRPOConfig(top_entropy_quantile=0.5)) and needs_step_selection(GRPOConfig(**CLIP_COV))
    calls = []
    hook = policy.register_forward_hook(lambda *args: calls.append(1))
    try:
        experience = _experience(policy.config.vocab_size)
        assert _prepared(policy, config, _members(experience, 4, config)) == [{}] * 4
        assert calls == []
        _prepared(policy, GRPOConfig(top_entropy_quantile=0.5), _members(experience, 4, config))
        assert calls  # with a knob on, the step's no-grad pass runs
    finally:
        hook.remove()


def test_each_micro_batch_is_trained_with_the_plan_it_carries(policy):
    """``StepSelection.objective`` takes the micro-batch's own ``step_plan`` (the step's high-entropy cut), and,
    without one, the micro-batch's own statistics: equal to ``grpo_objective`` called with and without the cut."""
    config = GRPOConfig(top_entropy_quantile=0.5)
    members = _members(_experience(policy.config.vocab_size), 4, config)
    selection = StepSelection(config, CompletionLogprobs(config))
    plans = selection.plan(policy, members, Collectives(), 7)
    member = members[2]
    with torch.no_grad():
        logprobs, entropy = CompletionLogprobs(config)(policy, member, with_entropy=True)
    inputs = dict(entropy=entropy, normalizer=member.loss_normalizer)
    own = grpo_objective(logprobs, member.completion_mask, member.advantages, config, **inputs)
    cut = plans[2].statistics["entropy_threshold"]
    step = grpo_objective(logprobs, member.completion_mask, member.advantages, config, entropy_threshold=cut, **inputs)
    assert member.step_plan is None and torch.equal(selection.objective(member, logprobs, entropy).entropy_mask,
                                                     own.entropy_mask)
    member.step_plan = plans[2]
    planned = selection.objective(member, logprobs, entropy)
    assert torch.equal(planned.entropy_mask, step.entropy_mask) and torch.equal(planned.loss, step.loss)
    assert not torch.equal(own.entropy_mask, step.entropy_mask)  # the step's cut is not this micro-batch's
