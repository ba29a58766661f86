"""Golden values of the GRPO variants in lightning_grpo.algorithm (worked by hand; sources in the docstrings)."""

import math

import pytest
import torch

from lightning_grpo.algorithm import (
    DynamicSampler,
    ScoredRollout,
    grpo_objective,
    high_entropy_mask,
    informative_groups,
    overlong_penalty,
    rollout_importance_weights,
    sequence_kl,
    transform_rewards,
)
from lightning_grpo.config import GRPOConfig
from lightning_grpo.protocols.rollout import RolloutOutput

NAN = float("nan")


def test_overlong_penalty_dapo_eq13_golden():
    lengths = torch.tensor([3, 15, 16, 18, 20])
    penalty = overlong_penalty(lengths, max_new_tokens=20, overlong_buffer=5)
    torch.testing.assert_close(penalty, torch.tensor([0.0, 0.0, -0.2, -0.6, -1.0]))
    half = overlong_penalty(lengths, max_new_tokens=20, overlong_buffer=5, penalty_factor=0.5)
    torch.testing.assert_close(half, torch.tensor([0.0, 0.0, -0.1, -0.3, -0.5]))
    with pytest.raises(ValueError, match="overlong_buffer=21"):
        overlong_penalty(lengths, 20, 21)


def test_transform_rewards_golden():
    out = transform_rewards(torch.tensor([2.0, -3.0, 0.5, NAN]), scale=2.0, bias=-1.0, clip=2.5)
    torch.testing.assert_close(out, torch.tensor([2.5, -2.5, 0.0, NAN]), equal_nan=True)


def test_sequence_kl_golden_and_masking():
    logp = torch.tensor([[-1.0, -1.0, 1e9], [-1.0, NAN, NAN]])
    ref = torch.tensor([[-2.0, -1.0, NAN], [-1.0, 5.0, NAN]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    torch.testing.assert_close(sequence_kl(logp, ref, mask, "k1"), torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(sequence_kl(logp, ref, mask, "k3"), torch.tensor([math.exp(-1), 0.0]))


def test_truncated_importance_sampling_golden():
    old = torch.tensor([[-1.0, -2.0, -0.5, 7.0]])
    sampler = torch.tensor([[-1.5, -1.0, -0.5, NAN]])
    mask = torch.tensor([[1, 1, 1, 0]])
    token = rollout_importance_weights(old, sampler, mask, cap=1.5)
    torch.testing.assert_close(token, torch.tensor([[1.5, math.exp(-1.0), 1.0, 1.0]]))
    masked = rollout_importance_weights(old, sampler, mask, cap=1.5, mode="mask")
    torch.testing.assert_close(masked, torch.tensor([[0.0, math.exp(-1.0), 1.0, 1.0]]))
    sequence = rollout_importance_weights(old, sampler, mask, cap=1.5, level="sequence")
    torch.testing.assert_close(sequence, torch.tensor([[math.exp(-0.5)] * 3 + [1.0]]))
    with pytest.raises(ValueError, match="importance_sampling_level='word'"):
        rollout_importance_weights(old, sampler, mask, 2.0, level="word")


def test_high_entropy_mask_golden():
    entropy = torch.tensor([[0.1, 0.5, 0.9, 0.3], [0.7, NAN, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0]])
    # unmasked [0.1, 0.5, 0.9, 0.3, 0.7]: rho 0.2 -> quantile(0.8) = 0.74 keeps 0.9
    top = high_entropy_mask(entropy, mask, 0.2)
    assert top.nonzero().tolist() == [[0, 2]]
    top = high_entropy_mask(entropy, mask, 0.4)  # quantile(0.6) = 0.58 keeps 0.9 and 0.7
    assert top.nonzero().tolist() == [[0, 2], [1, 0]]
    assert torch.equal(high_entropy_mask(entropy, mask, 1.0), mask.bool())


def test_informative_groups_golden():
    primary = torch.tensor([1, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0.5, NAN, 0.5, NAN, 1, NAN, NAN, NAN])
    assert informative_groups(primary, 4).tolist() == [False, True, False, False, False]


def _scored(primary: list, width: int, prompt_width: int, tag: int) -> ScoredRollout:
    n = len(primary)
    rollout = RolloutOutput(
        prompt_ids=torch.full((n, prompt_width), tag),
        prompt_mask=torch.ones(n, prompt_width, dtype=torch.long),
        completion_ids=torch.full((n, width), tag),
        completion_mask=torch.ones(n, width, dtype=torch.long),
        truncated=torch.zeros(n, dtype=torch.bool),
        completions=[f"{tag}"] * n,
    )
    return ScoredRollout(
        rollout,
        per_function=torch.tensor(primary, dtype=torch.float32).unsqueeze(1),
        rewards=torch.tensor(primary, dtype=torch.float32),
        num_generations=2,
        pad_token_id=0,
    )


def test_dynamic_sampler_keeps_informative_groups_and_pads_shapes():
    sampler = DynamicSampler(target_groups=3)
    sampler.add(_scored([1, 1, 0, 1, 0, 0], width=2, prompt_width=3, tag=1))  # groups: const, info, const
    assert sampler.need_more and sampler.num_informative == 1
    sampler.add(_scored([1, 0, 1, 1, 0, 0], width=4, prompt_width=2, tag=2))  # info, const, const
    assert sampler.need_more
    sampler.add(_scored([0, 1, 1, 0], width=1, prompt_width=1, tag=3))  # info, info (one surplus)
    assert not sampler.need_more
    batch, stats = sampler.batch()
    assert stats == {"gen_batches": 3.0, "dropped_groups": 4.0, "filled_groups": 0.0, "surplus_groups": 1.0}
    assert batch.per_function[:, 0].tolist() == [0, 1, 1, 0, 0, 1]
    assert batch.rollout.completion_ids.shape == (6, 4) and batch.rollout.prompt_ids.shape == (6, 3)
    # completions right-padded, prompts left-padded
    rows = batch.rollout
    assert rows.completion_mask.tolist()[0] == [1, 1, 0, 0] and rows.completion_ids.tolist()[0] == [1, 1, 0, 0]
    assert rows.prompt_mask.tolist()[2] == [0, 1, 1] and rows.prompt_ids.tolist()[2] == [0, 2, 2]
    assert rows.completion_ids.tolist()[4] == [3, 0, 0, 0]
    assert batch.rollout.completions == ["1", "1", "2", "2", "3", "3"]


def test_dynamic_sampler_fills_with_dropped_groups_when_short():
    sampler = DynamicSampler(target_groups=3)
    sampler.add(_scored([1, 1, 0, 1, 0, 0], width=2, prompt_width=1, tag=1))
    batch, stats = sampler.batch()  # the round limit was reached with 1 informative group
    assert stats == {"gen_batches": 1.0, "dropped_groups": 0.0, "filled_groups": 2.0, "surplus_groups": 0.0}
    assert batch.per_function[:, 0].tolist() == [0, 1, 1, 1, 0, 0]
    off = DynamicSampler(target_groups=3, enabled=False)
    off.add(_scored([1, 1, 0, 1, 0, 0], width=2, prompt_width=1, tag=1))
    assert not off.need_more and off.batch()[0].per_function[:, 0].tolist() == [1, 1, 0, 1, 0, 0]


# --------------------------------------------------------------------------- the objective
def _objective(config=None, **kwargs):
    logprobs = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    args = dict(mask=torch.ones(1, 2), advantages=torch.tensor([2.0]), config=config or GRPOConfig(num_generations=2))
    args.update(kwargs)
    return logprobs, grpo_objective(logprobs, **args)


def test_objective_goldens():
    # on-policy, A = 2: per token -2 * ratio(=1); grpo mean -> -2
    _, out = _objective()
    assert out.loss.item() == pytest.approx(-2.0) and torch.equal(out.clip.ratio, torch.ones(1, 2))
    # entropy bonus 0.1 with H = [0.5, 1.5]: -2 - 0.05, -2 - 0.15 -> -2.1
    entropy = torch.tensor([[0.5, 1.5]])
    _, out = _objective(GRPOConfig(num_generations=2, entropy_coef=0.1), entropy=entropy)
    assert out.loss.item() == pytest.approx(-2.1)
    # top_entropy_quantile 0.5: threshold quantile(0.5) of [0.5, 1.5] = 1.0, only token 2 keeps its loss:
    # (0 - 2) / 2 tokens = -1
    _, out = _objective(GRPOConfig(num_generations=2, top_entropy_quantile=0.5), entropy=entropy)
    assert out.loss.item() == pytest.approx(-1.0) and out.entropy_mask.tolist() == [[False, True]]
    # TIS cap 1.5: sampler [-1.5, -2]: weights [min(e^0.5, 1.5), 1] = [1.5, 1] -> (-3 - 2) / 2 = -2.5
    cfg = GRPOConfig(num_generations=2, importance_sampling_cap=1.5)
    _, out = _objective(cfg, sampler_logprobs=torch.tensor([[-1.5, -2.0]]))
    assert out.loss.item() == pytest.approx(-2.5)
    torch.testing.assert_close(out.importance_weights, torch.tensor([[1.5, 1.0]]))
    # KL in the loss, beta 0.1, k3, ref [-2, -2]: x = [-1, 0] -> k3 = [e^-1, 0]: (-2 + 0.1 e^-1 - 2) / 2
    cfg = GRPOConfig(num_generations=2, beta=0.1)
    _, out = _objective(cfg, ref_logprobs=torch.tensor([[-2.0, -2.0]]))
    assert out.loss.item() == pytest.approx((-4 + 0.1 * math.exp(-1)) / 2)
    # off-policy: old = [-1, -1.5] -> ratios [1, e^-0.5 = 0.6065]; with A > 0 the pessimistic max keeps the
    # unclipped -2 * 0.6065 (the clipped -2 * 0.8 is lower): per token [-2, -1.2131] -> mean -1.6065
    _, out = _objective(old_logprobs=torch.tensor([[-1.0, -1.5]]))
    assert out.loss.item() == pytest.approx(-(1 + math.exp(-0.5)))


@pytest.mark.parametrize("garbage", [1e9, NAN, -math.inf])
def test_objective_ignores_every_value_at_masked_positions(garbage):
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    cfg = GRPOConfig(
        num_generations=2, beta=0.05, entropy_coef=0.01, top_entropy_quantile=0.5, importance_sampling_cap=2.0,
        clip_ratio_c=3.0, loss_type="grpo",
    )
    base = {
        "old_logprobs": torch.randn(3, 4) - 1,
        "ref_logprobs": torch.randn(3, 4) - 1,
        "sampler_logprobs": torch.randn(3, 4) - 1,
    }
    logits = torch.randn(3, 4, requires_grad=True)
    entropy_source = torch.rand(3, 4, requires_grad=True)

    def run(values, advantages, fill):
        logprobs = torch.where(mask.bool(), torch.nn.functional.logsigmoid(logits), fill)
        entropy = torch.where(mask.bool(), entropy_source, fill)
        out = grpo_objective(logprobs, mask, advantages, cfg, entropy=entropy, **values)
        grads = torch.autograd.grad(out.loss, [logits, entropy_source])
        return out.loss, grads

    clean, clean_grads = run(base, torch.tensor([1.0, -2.0, 0.0]), 0.0)
    dirty_values = {k: torch.where(mask.bool(), v, garbage) for k, v in base.items()}
    dirty, dirty_grads = run(dirty_values, torch.tensor([1.0, -2.0, garbage]), garbage)
    assert torch.isfinite(clean) and dirty.item() == clean.item()
    for a, b in zip(clean_grads, dirty_grads, strict=True):
        assert torch.equal(a, b)


def test_objective_rejects_a_nan_advantage_on_a_row_with_loss_tokens():
    with pytest.raises(ValueError, match=r"advantages of rows \[0\]"):
        _objective(advantages=torch.tensor([NAN]))
