"""make_experience and compute_loss on a tiny random Llama with fixed completions: reward shaping, masking,
RLOO, KL in the reward, reward-function errors, dynamic sampling bookkeeping, TIS and padding invariance.

No Trainer: ``GRPOModule`` binds a single-process ``RolloutContext`` when it is built, so ``make_experience`` and
``compute_loss`` run on the module alone; no optimizer step runs, so these tests see exactly one rollout."""

import dataclasses
import math

import pytest
import torch

from lightning_grpo import GRPOConfig, GRPOModule
from lightning_grpo import functional as F
from lightning_grpo.algorithm import sequence_kl
from support.algorithm import FixedRolloutEngine, fixed_completions

PROMPTS = {"prompt": ["first prompt", "second prompt"], "answer": ["1", "2"]}


def accuracy(prompts, completions, **kwargs):
    return [1.0, 0.0, None, 0.5, 1.0, 1.0, 1.0, 1.0][: len(completions)]


def style(prompts, completions, **kwargs):
    return [None, None, None, 0.25, 0.0, 0.0, 0.0, 0.0][: len(completions)]


def _module(path, lengths=(7, 2, 5, 5, 3, 3, 3, 6), reward_funcs=(accuracy, style), sampler=None,
            **config):
    config = {"num_generations": 4, "max_new_tokens": 6, **config}
    module = GRPOModule(path, reward_funcs=list(reward_funcs), config=GRPOConfig(**config), export_dir="",
                        reward_weights=[1.0, 2.0][: len(reward_funcs)] if len(reward_funcs) <= 2 else None)
    eos = module.tokenizer.eos_token_id
    module.rollout_engine = FixedRolloutEngine(fixed_completions(lengths, 6, eos), eos, sampler)
    return module


def test_shaping_masking_and_rloo_golden(tiny_llama_path):
    module = _module(
        tiny_llama_path, overlong_buffer=2, reward_scale=2.0, reward_bias=-1.0, reward_clip=1.5,
        mask_truncated_completions=True, advantage_estimator="rloo", scale_rewards="none",
    )
    experience = module.make_experience(PROMPTS)
    assert module._trainer is None  # no Trainer anywhere: the module's default single-process context
    # lengths [6 (no EOS), 2, 5, 5 | 3, 3, 3, 6]; overlong (L_max 6, L_cache 2): [-1, 0, -0.5, -0.5 | 0, 0, 0, -1]
    # weighted rewards (accuracy + 2 * style): [1, 0, missing, 1.0 | 1, 1, 1, 1]
    # + overlong: [0, 0, -, 0.5 | 1, 1, 1, 0]; 2r - 1 clipped to 1.5: [-1, -1, -, 0 | 1, 1, 1, -1]
    # RLOO, no std: group 1 (3 valid): -1 - mean(-1, 0) = -0.5, -0.5, -, 0 - mean(-1, -1) = 1
    #               group 2: 1 - mean(1, 1, -1) = 2/3 (x3), -1 - 1 = -2
    expected = torch.tensor([-0.5, -0.5, 0.0, 1.0, 2 / 3, 2 / 3, 2 / 3, -2.0])
    torch.testing.assert_close(experience.advantages, expected)
    # the truncated completion (row 0) and the unscored one (row 2) get no loss
    assert experience.completion_mask.sum(dim=1).tolist() == [0, 2, 0, 5, 3, 3, 3, 6]
    assert experience.old_logprobs is None and experience.ref_logprobs is None  # one on-policy step: not needed
    metrics = experience.metrics
    assert metrics["rewards/accuracy/mean"] == pytest.approx(5.5 / 7)
    assert metrics["rewards/style/mean"] == pytest.approx(0.25 / 5)
    assert metrics["rewards/overlong_penalty/mean"] == pytest.approx(-3 / 8)
    assert metrics["frac_reward_unscored"] == pytest.approx(1 / 8)
    assert metrics["completions/clipped_ratio"] == pytest.approx(1 / 8)
    assert metrics["reward_shaped"] == pytest.approx((-1 - 1 + 0 + 1 + 1 + 1 - 1) / 7)


def test_group_std_advantages_golden_with_a_missing_reward(tiny_llama_path):
    module = _module(tiny_llama_path)
    experience = module.make_experience(PROMPTS)
    # group 1 rewards [1, 0, -, 1.0]: mean 2/3, unbiased std sqrt(1/3); group 2 constant -> 0
    std = math.sqrt(1 / 3) + 1e-4
    expected = torch.tensor([(1 / 3) / std, (-2 / 3) / std, 0.0, (1 / 3) / std, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(experience.advantages, expected)
    assert experience.completion_mask[2].sum() == 0 and experience.completion_mask[0].sum() == 6


def test_kl_in_reward_is_subtracted_before_advantages(tiny_llama_path):
    module = _module(tiny_llama_path, beta=0.5, kl_in_reward=True, kl_estimator="k1", scale_rewards="none")
    with torch.no_grad():  # a reference that differs from the policy
        for p in module.ref_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    experience = module.make_experience(PROMPTS)
    assert experience.ref_logprobs is None and experience.old_logprobs is None  # used up in the reward
    module.policy.eval()
    with torch.no_grad():
        old, _ = module.completion_logprobs(module.policy, experience)
        ref, _ = module.completion_logprobs(module.ref_model, experience)
    kl = sequence_kl(old, ref, experience.completion_mask, "k1")
    rewards = torch.tensor([1.0, 0.0, float("nan"), 1.0, 1.0, 1.0, 1.0, 1.0]) - 0.5 * kl
    valid = torch.tensor([True, True, False, True, True, True, True, True])
    expected = F.group_advantages(rewards, 4, "none", valid=valid)
    torch.testing.assert_close(experience.advantages, expected, atol=1e-5, rtol=0)
    assert experience.advantages[4:].abs().sum() > 0  # a constant task reward now differs by its KL
    assert experience.metrics["rewards/kl_penalty/mean"] == pytest.approx(-0.5 * kl[valid].mean().item(), abs=1e-5)
    output = module.compute_loss(experience)
    assert output.kl is None  # no KL term in the loss


def test_a_raising_reward_function_stops_unless_tolerant(tiny_llama_path):
    def judge(prompts, completions, **kwargs):
        return [1.0 / (int(c.split()[-1]) - 5) for c in completions]  # "completion 5" (sample 5) divides by 0

    module = _module(tiny_llama_path, reward_funcs=[accuracy, judge])
    with pytest.raises(RuntimeError, match="reward function 'judge' raised ZeroDivisionError on sample 5"):
        module.make_experience(PROMPTS)
    tolerant = GRPOModule(tiny_llama_path, reward_funcs=[accuracy, judge], tolerant_reward_funcs=["judge"],
                          config=GRPOConfig(num_generations=4, max_new_tokens=6), export_dir="")
    tolerant.rollout_engine = module.rollout_engine
    experience = tolerant.make_experience(PROMPTS)
    # judge is missing everywhere: the reward is accuracy alone, and the all-missing sample 2 has no loss
    assert torch.isfinite(experience.advantages).all() and experience.completion_mask[2].sum() == 0
    with pytest.raises(ValueError, match=r"tolerant_reward_funcs \['jugde'\]"):
        GRPOModule(tiny_llama_path, reward_funcs=[accuracy, judge], tolerant_reward_funcs=["jugde"])
    with pytest.raises(ValueError, match="primary_reward='acc'"):
        GRPOModule(tiny_llama_path, reward_funcs=[accuracy], config=GRPOConfig(num_generations=2, primary_reward="acc"))


def test_dynamic_sampling_generates_more_batches_and_fills_when_the_limit_is_hit(tiny_llama_path):
    def primary(prompts, completions, answer, **kwargs):
        # prompts whose answer is "even" get 1, 0, 1, 0 (informative); the others all 0 (dropped)
        return [float(a == "even" and i % 2 == 0) for i, a in enumerate(answer)]

    def length(prompts, completions, **kwargs):
        return [0.01 * i for i in range(len(completions))]  # varies in every group: the filter must ignore it

    module = _module(tiny_llama_path, lengths=[3] * 8, reward_funcs=[primary, length],
                     dynamic_sampling=True, max_num_gen_batches=3)
    batches = iter([{"prompt": ["c", "d"], "answer": ["odd", "even"]},
                    {"prompt": ["e", "f"], "answer": ["even", "odd"]}])
    calls = []

    def next_prompt_batch():
        calls.append(1)
        return next(batches, None)

    experience = module.make_experience({"prompt": ["a", "b"], "answer": ["odd", "odd"]}, next_prompt_batch)
    assert len(calls) == 2 and len(experience) == 8
    metrics = experience.metrics
    assert metrics["dynamic_sampling/gen_batches"] == 3
    assert metrics["dynamic_sampling/dropped_groups"] == 4 and metrics["dynamic_sampling/filled_groups"] == 0
    assert metrics["rewards/primary/mean"] == pytest.approx(0.5)  # only informative groups were kept
    # the limit: one batch of uninformative groups only -> filled with them, logged
    module = _module(tiny_llama_path, lengths=[3] * 8, reward_funcs=[primary, length],
                     dynamic_sampling=True, max_num_gen_batches=1)
    experience = module.make_experience({"prompt": ["a", "b"], "answer": ["odd", "odd"]}, next_prompt_batch)
    assert len(calls) == 2 and len(experience) == 8  # no further prompt batch was requested
    assert experience.metrics["dynamic_sampling/filled_groups"] == 2
    # exhausted data: next_prompt_batch returns None -> the batch is filled with what there is
    module = _module(tiny_llama_path, lengths=[3] * 8, reward_funcs=[primary, length],
                     dynamic_sampling=True, max_num_gen_batches=5)
    experience = module.make_experience({"prompt": ["a", "b"], "answer": ["even", "odd"]}, lambda: None)
    assert experience.metrics["dynamic_sampling/gen_batches"] == 1
    assert experience.metrics["dynamic_sampling/filled_groups"] == 1


def test_truncated_importance_sampling_weights_the_loss(tiny_llama_path):
    module = _module(tiny_llama_path, lengths=[3] * 8, importance_sampling_cap=1.5)
    experience = module.make_experience(PROMPTS)
    module.policy.eval()
    with torch.no_grad():
        trainer_logprobs, _ = module.completion_logprobs(module.policy, experience)
    offsets = torch.zeros_like(trainer_logprobs)
    offsets[:, 0] = 0.2  # sampler more likely than the trainer: weight exp(-0.2)
    offsets[:, 1] = -1.0  # sampler less likely: weight exp(1) capped at 1.5
    experience.sampler_logprobs = trainer_logprobs + offsets
    output = module.compute_loss(experience)
    weights = output.importance_weights[output.mask]
    expected = torch.tensor([math.exp(-0.2), 1.5, 1.0]).repeat(7)  # 7 scored completions of 3 tokens
    torch.testing.assert_close(weights, expected, atol=1e-4, rtol=0)
    experience.sampler_logprobs = None  # the HF engine reports none: no correction
    assert module.compute_loss(experience).importance_weights is None


@pytest.mark.parametrize("garbage", [1e9, float("nan")])
def test_padding_never_changes_the_loss_through_the_module(tiny_llama_path, garbage):
    module = _module(
        tiny_llama_path, beta=0.1, entropy_coef=0.01, top_entropy_quantile=0.5,
        importance_sampling_cap=2.0, mask_truncated_completions=True, loss_type="grpo",
    )
    clean = module.make_experience(PROMPTS)
    module.policy.eval()  # no dropout in the tiny Llama, but keep the two forward passes identical
    with torch.no_grad():
        logprobs, _ = module.completion_logprobs(module.policy, clean)
    mask = clean.completion_mask.bool()
    clean.old_logprobs = torch.where(mask, logprobs - 0.1, 0.0)
    clean.sampler_logprobs = torch.where(mask, logprobs + 0.05, 0.0)
    clean.on_policy = False
    dirty = dataclasses.replace(clean)
    dirty.loss_normalizer = clean.loss_normalizer = None
    dirty.on_policy = False
    for name in ("old_logprobs", "ref_logprobs", "sampler_logprobs"):
        setattr(dirty, name, torch.where(mask, getattr(clean, name), garbage))
    dirty.completion_ids = torch.where(mask, clean.completion_ids, 123)  # other tokens after the EOS
    dirty.advantages = torch.where(mask.any(dim=1), clean.advantages, garbage)  # fully masked rows

    def loss_and_grads(batch):
        module.policy.zero_grad()
        output = module.compute_loss(batch)
        output.loss.backward()
        return output.loss.detach(), [p.grad.clone() for p in module.policy.parameters()]

    clean_loss, clean_grads = loss_and_grads(clean)
    dirty_loss, dirty_grads = loss_and_grads(dirty)
    assert torch.isfinite(clean_loss) and clean_loss != 0
    torch.testing.assert_close(dirty_loss, clean_loss, atol=1e-6, rtol=0)
    for a, b in zip(clean_grads, dirty_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
