"""Golden values of the algorithm's pure functions (worked by hand; sources in each docstring)."""

import math

import pytest
import torch

from lightning_grpo import functional as F


def test_group_advantages_golden():
    # mean 0.25, unbiased std 0.5 -> (1 - 0.25) / (0.5 + 1e-4) = 1.4997, -0.25 / 0.5001 = -0.49990
    adv = F.group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, eps=1e-4)
    torch.testing.assert_close(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-3, rtol=0)
    assert adv[0].item() == pytest.approx(0.75 / 0.5001, abs=1e-6)


def test_group_advantages_are_per_group():
    adv = F.group_advantages(torch.tensor([1.0, 0.0, 2.0, 4.0]), 2, eps=0.0)
    # groups [1, 0] and [2, 4]: std sqrt(0.5) and sqrt(2)
    expected = torch.tensor([0.5 / math.sqrt(0.5), -0.5 / math.sqrt(0.5), -1 / math.sqrt(2), 1 / math.sqrt(2)])
    torch.testing.assert_close(adv, expected)


@pytest.mark.parametrize("value", [0.0, 1.0, 0.35, 1e-7])
def test_constant_group_gets_exactly_zero(value):
    rewards = torch.full((8,), value)
    for scale in ("group", "batch", "none"):
        adv = F.group_advantages(torch.cat([rewards, torch.tensor([0.0, 1.0])]), 2 if scale == "batch" else 2, scale)
        assert torch.equal(adv[:8], torch.zeros(8)), scale


def test_near_constant_group_stays_the_size_of_the_rewards():
    rewards = torch.tensor([0.35] * 7 + [0.0])
    adv = F.group_advantages(rewards, 8)
    assert adv.abs().max() < 3  # mean 0.30625, std 0.1237 -> -2.475 for the zero
    assert adv[-1].item() == pytest.approx(-0.30625 / (0.1237 + 1e-4), rel=1e-3)


def test_scale_rewards_none_is_dr_grpo_centering():
    adv = F.group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, "none")
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.25, -0.25]))


def test_scale_rewards_batch_uses_the_batch_std():
    rewards = torch.tensor([1.0, 0.0, 3.0, 3.0])
    adv = F.group_advantages(rewards, 2, "batch", eps=0.0)
    std = rewards.std()
    torch.testing.assert_close(adv, torch.tensor([0.5 / std, -0.5 / std, 0.0, 0.0]))


@pytest.mark.parametrize(
    "rewards, g, match",
    [
        (torch.zeros(6), 4, "multiple of num_generations"),
        (torch.zeros(4), 1, "G >= 2"),
        (torch.zeros(2, 2), 2, "1-D"),
        (torch.tensor([1.0, float("nan")]), 2, "finite"),
    ],
)
def test_group_advantages_errors(rewards, g, match):
    with pytest.raises(ValueError, match=match):
        F.group_advantages(rewards, g)


def _loss(ratio, adv, **kw):
    logp = torch.tensor([[math.log(ratio)]])
    loss, stats = F.policy_loss(logp, torch.zeros(1, 1), torch.tensor([adv]), **kw)
    return loss.item(), stats


def test_policy_loss_golden():
    loss, stats = _loss(1.5, 1.0, epsilon_low=0.2, epsilon_high=0.28)
    assert loss == pytest.approx(-1.28, abs=1e-6)
    assert stats.high.item() and not stats.low.item() and stats.region.item()
    loss, stats = _loss(0.5, -1.0, epsilon_low=0.2, epsilon_high=0.28)
    assert loss == pytest.approx(0.8, abs=1e-6)
    assert stats.low.item() and not stats.high.item()
    # inside the clip range nothing is clipped and the loss is -ratio * A
    loss, stats = _loss(1.1, 2.0)
    assert loss == pytest.approx(-2.2, abs=1e-6) and not stats.region.item()
    # ratio above the range with a negative advantage is not clipped (pessimistic max)
    loss, _ = _loss(1.5, -1.0)
    assert loss == pytest.approx(1.5, abs=1e-6)


def test_policy_loss_dual_clip_and_delta():
    loss, stats = _loss(5.0, -1.0, clip_ratio_c=3.0)
    assert loss == pytest.approx(3.0, abs=1e-6) and stats.dual.item()
    loss, _ = _loss(5.0, 1.0, clip_ratio_c=3.0)  # only applies where A < 0
    assert loss == pytest.approx(-1.2, abs=1e-6)
    loss, _ = _loss(0.5, 1.0, delta=2.0)  # delta caps the unclipped ratio: min(0.5, 2) = 0.5 -> max(-0.5, -0.8)
    assert loss == pytest.approx(-0.5, abs=1e-6)
    loss, _ = _loss(3.0, -1.0, delta=2.0)  # -min(3, 2) * -1 = 2 vs clipped 1.2 -> 2
    assert loss == pytest.approx(2.0, abs=1e-6)


def test_policy_loss_gradient_is_advantage_times_score_on_policy():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = F.policy_loss(logp, logp.detach(), torch.tensor([3.0]))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-3.0, -3.0]]))


def test_kl_estimators_golden():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-2.0])
    assert F.kl_penalty(logp, ref, "k1").item() == pytest.approx(1.0)
    assert F.kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5)
    assert F.kl_penalty(logp, ref, "k3").item() == pytest.approx(0.3679, abs=1e-4)
    with pytest.raises(ValueError, match="k4"):
        F.kl_penalty(logp, ref, "k4")


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_is_finite_for_huge_log_ratio(estimator):
    logp = torch.tensor([-101.0, 99.0], requires_grad=True)
    kl = F.kl_penalty(logp, torch.tensor([-1.0, -1.0]), estimator)
    kl.sum().backward()
    assert torch.isfinite(kl).all() and torch.isfinite(logp.grad).all()


def test_aggregate_loss_worked_example():
    x = torch.tensor([[2, 2, 2, 2, 2, 6, 5, 3, 2, 4], [10, 3, 4, 5, 2, 3, 4, 1, 1, 3]], dtype=torch.float)
    mask = torch.tensor([[1] * 5 + [0] * 5, [1] + [0] * 9])
    assert F.aggregate_loss(x, mask, "token_mean").item() == pytest.approx(20 / 6)
    assert F.aggregate_loss(x, mask, "bnpo").item() == pytest.approx(20 / 6)
    assert F.aggregate_loss(x, mask, "grpo").item() == pytest.approx(6.0)
    assert F.aggregate_loss(x, mask, "dr_grpo", max_new_tokens=10).item() == pytest.approx(20 / 20)
    # an explicit normalizer (the whole step's) replaces the batch's own
    assert F.aggregate_loss(x, mask, "grpo", normalizer=4.0).item() == pytest.approx(3.0)


def test_masked_positions_never_matter():
    x = torch.tensor([[1.0, 2.0, float("nan")], [3.0, 1e9, float("inf")]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    for loss_type in ("grpo", "bnpo", "dapo", "dr_grpo"):
        value = F.aggregate_loss(x, mask, loss_type, max_new_tokens=3)
        clean = F.aggregate_loss(torch.where(mask.bool(), x, 0.0), mask, loss_type, max_new_tokens=3)
        assert torch.isfinite(value) and value == clean


def test_loss_normalizer_errors():
    with pytest.raises(ValueError, match="max_new_tokens"):
        F.loss_normalizer(torch.ones(1, 2), "dr_grpo")
    with pytest.raises(ValueError, match="ppo"):
        F.loss_normalizer(torch.ones(1, 2), "ppo")


def test_token_logprobs_match_log_softmax_and_temperature():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    labels = torch.randint(0, 11, (3, 5))
    for temperature in (1.0, 0.7):
        lp, ent = F.token_logprobs(logits, labels, temperature, chunk_size=4, with_entropy=True)
        ref = torch.log_softmax(logits / temperature, -1)
        torch.testing.assert_close(lp, ref.gather(-1, labels[..., None]).squeeze(-1))
        torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1))


def test_token_logprobs_gradient_matches_unchunked():
    torch.manual_seed(1)
    logits = torch.randn(2, 7, 13, requires_grad=True)
    labels = torch.randint(0, 13, (2, 7))
    F.token_logprobs(logits, labels, 0.5, chunk_size=3)[0].sum().backward()
    chunked = logits.grad.clone()
    logits.grad = None
    torch.log_softmax(logits / 0.5, -1).gather(-1, labels[..., None]).sum().backward()
    torch.testing.assert_close(chunked, logits.grad)


def test_token_logprobs_errors():
    with pytest.raises(ValueError, match="temperature"):
        F.token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long), 0.0)
    with pytest.raises(ValueError, match="do not match"):
        F.token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 3, dtype=torch.long))


# ---------------------------------------------------------------- issue 3: advantages, normalizer, entropy grad
def test_rloo_is_the_leave_one_out_baseline():
    # r = [1, 0, 0, 0]: r_0 - mean(0, 0, 0) = 1; r_1 - mean(1, 0, 0) = -1/3
    adv = F.group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, "none", estimator="rloo")
    torch.testing.assert_close(adv, torch.tensor([1.0, -1 / 3, -1 / 3, -1 / 3]))
    # with the group std (0.5) it is the GRPO advantage times G / (G - 1) = 4/3: [2, -2/3, -2/3, -2/3]
    adv = F.group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), 4, "group", eps=0.0, estimator="rloo")
    torch.testing.assert_close(adv, torch.tensor([2.0, -2 / 3, -2 / 3, -2 / 3]))


def test_std_floor_keeps_float_noise_from_becoming_a_unit_advantage():
    # seven 0.35 and one 0.35 + 1 ulp (3e-8): without eps or floor float noise becomes a unit-size advantage
    # (the exact value depends on the rounding of the mean; at most (G-1)/sqrt(G) = 2.47)
    rewards = torch.tensor([0.35] * 7 + [0.0])
    rewards[7] = torch.nextafter(torch.tensor(0.35), torch.tensor(1.0))
    noisy = F.group_advantages(rewards, 8, eps=0.0)
    assert 1.0 < noisy.abs().max().item() <= 7 / math.sqrt(8) + 1e-4
    # with the floor 1e-3 the centered values (~1e-8) stay ~1e-5
    floored = F.group_advantages(rewards, 8, eps=0.0, std_floor=1e-3)
    assert 0 < floored.abs().max().item() < 1e-4
    # a real spread is untouched by the floor: seven 0.35 and one 0.0 (std 0.1237) -> -2.475
    real = F.group_advantages(torch.tensor([0.35] * 7 + [0.0]), 8, eps=0.0, std_floor=1e-3)
    assert real[7].item() == pytest.approx(-0.30625 / 0.123744, rel=1e-4)


def test_missing_rewards_are_left_out_of_the_group_statistics():
    nan = float("nan")
    rewards = torch.tensor([1.0, nan, 0.0, 0.0, 5.0, nan, nan, nan])
    valid = ~torch.isnan(rewards)
    adv = F.group_advantages(rewards, 4, eps=0.0, valid=valid)
    # group 1: valid [1, 0, 0], mean 1/3, unbiased std sqrt(1/3); group 2: one valid reward -> all 0
    std = math.sqrt(1 / 3)
    expected = torch.tensor([(2 / 3) / std, 0.0, (-1 / 3) / std, (-1 / 3) / std, 0.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(adv, expected)
    assert torch.isfinite(adv).all()
    rloo = F.group_advantages(rewards, 4, "none", valid=valid, estimator="rloo")  # k = 3 valid: 3/2 * centered
    torch.testing.assert_close(rloo[:4], torch.tensor([1.0, 0.0, -0.5, -0.5]))


def test_batch_std_can_come_from_all_processes():
    rewards = torch.tensor([1.0, 0.0, 3.0, 3.0])
    adv = F.group_advantages(rewards, 2, "batch", eps=0.0, batch_std=2.0)
    torch.testing.assert_close(adv, torch.tensor([0.25, -0.25, 0.0, 0.0]))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"estimator": "ppo"}, "estimator='ppo'"),
        ({"std_floor": -1.0}, "std_floor=-1.0"),
        ({"valid": torch.ones(2, dtype=torch.bool)}, "valid"),
    ],
)
def test_group_advantages_new_argument_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        F.group_advantages(torch.zeros(4), 2, **kwargs)


def test_grpo_normalizer_counts_only_sequences_with_loss_tokens():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert F.loss_normalizer(mask, "grpo") == 2.0
    assert F.loss_normalizer(mask, "bnpo") == 3.0
    assert F.loss_normalizer(mask, "dr_grpo", max_new_tokens=3) == 9.0  # a constant: every sequence counts
    x = torch.tensor([[1.0, 3.0, 7.0], [9.0, 9.0, 9.0], [4.0, 8.0, 8.0]])
    assert F.aggregate_loss(x, mask, "grpo").item() == pytest.approx((2.0 + 4.0) / 2)


def test_policy_loss_reports_the_ratio():
    logp = torch.tensor([[math.log(2.0), 0.0]])
    _, stats = F.policy_loss(logp, torch.zeros(1, 2), torch.tensor([1.0]))
    torch.testing.assert_close(stats.ratio, torch.tensor([[2.0, 1.0]]))


def test_token_logprobs_entropy_gradient_matches_autograd():
    torch.manual_seed(2)
    logits = torch.randn(2, 3, 7, requires_grad=True)
    labels = torch.randint(0, 7, (2, 3))
    _, entropy = F.token_logprobs(logits, labels, 0.8, chunk_size=4, with_entropy=True, entropy_grad=True)
    entropy.sum().backward()
    ours = logits.grad.clone()
    logits.grad = None
    logp = torch.log_softmax(logits / 0.8, -1)
    (-(logp.exp() * logp).sum(-1)).sum().backward()
    torch.testing.assert_close(ours, logits.grad)
    _, no_grad = F.token_logprobs(logits, labels, 0.8, with_entropy=True)
    assert not no_grad.requires_grad


# ---------------------------------------------------------------- issue 13: rewards too large for float32 statistics
def test_group_statistics_do_not_overflow_for_huge_rewards():
    # [0, 3e19]: mean 1.5e19, centered +-1.5e19, unbiased std sqrt(2 * 1.5e19^2 / 1) = 1.5e19 * sqrt(2), so
    # A = +-1.5e19 / (1.5e19 * sqrt(2) + 1e-4) = +-1/sqrt(2) = +-0.70711 (in float32 the squares sum to 4.5e38 > 3.4e38:
    # std inf and both advantages were 0)
    adv = F.group_advantages(torch.tensor([0.0, 3e19, 1.0, 0.0]), 2)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv[:2], torch.tensor([-1 / math.sqrt(2), 1 / math.sqrt(2)]), atol=1e-6, rtol=0)
    assert adv[2].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-4), abs=1e-6)  # a small group is unchanged
    # the largest float32 rewards: [-3e38, 3e38] -> +-0.70711 too
    big = F.group_advantages(torch.tensor([-3e38, 3e38]), 2)
    torch.testing.assert_close(big, torch.tensor([-1 / math.sqrt(2), 1 / math.sqrt(2)]), atol=1e-6, rtol=0)
    # batch std of [0, 3e19, 0, 3e19]: mean 1.5e19, sum of squares 4 * 2.25e38, / 3 -> std 1.5e19 * sqrt(4/3);
    # A = +-1 / sqrt(4/3) = +-sqrt(3)/2 = +-0.86603
    batch = F.group_advantages(torch.tensor([0.0, 3e19, 0.0, 3e19]), 2, "batch", eps=0.0)
    half_sqrt3 = math.sqrt(3) / 2
    torch.testing.assert_close(batch, torch.tensor([-half_sqrt3, half_sqrt3] * 2), atol=1e-6, rtol=0)
    # RLOO with the group std: the GRPO advantage times G / (G - 1) = 2: +-1.41421
    rloo = F.group_advantages(torch.tensor([0.0, 3e19]), 2, estimator="rloo")
    torch.testing.assert_close(rloo, torch.tensor([-math.sqrt(2), math.sqrt(2)]), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "rewards, scale, match",
    [
        ([1.0, 2.0, 0.0, 1e200], "group", r"group 1 are too large to normalize: \[0.0, 1e\+200\].*group std"),
        ([1.0, 2.0, 0.0, 1e200], "batch", r"too large to normalize: the batch std is inf"),
        ([-1e39, 1e39], "none", r"group 0 are too large to normalize: \[-1e\+39, 1e\+39\].*advantage"),
    ],
)
def test_rewards_too_large_for_float64_raise_naming_them(rewards, scale, match):
    with pytest.raises(ValueError, match=match):
        F.group_advantages(torch.tensor(rewards, dtype=torch.float64), 2, scale)


# ---------------------------------------------------------------- issue 12: the sampling distribution (truncation)
def test_token_logprobs_top_k_golden_and_label_kept():
    # logits [2, 1, 0, -1], top_k 2: log(e / (e^2 + e)) = -1.3133 for label 1; label 3 is outside the top 2 but
    # kept: log(e^-1 / (e^2 + e + e^-1)) = -3.3490; the entropy is that of the renormalized kept tokens.
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0]).expand(1, 2, 4)
    lp, entropy = F.token_logprobs(logits, torch.tensor([[1, 3]]), top_k=2, with_entropy=True)
    torch.testing.assert_close(lp, torch.tensor([[-1.3133, -3.3490]]), atol=1e-4, rtol=0)
    p = torch.tensor([math.e**2, math.e]) / (math.e**2 + math.e)
    q = torch.tensor([math.e**2, math.e, math.e**-1]) / (math.e**2 + math.e + math.e**-1)
    torch.testing.assert_close(entropy, torch.stack([-(p * p.log()).sum(), -(q * q.log()).sum()])[None])


def test_truncated_logprobs_equal_log_softmax_of_sampling_logits_with_finite_gradients():
    torch.manual_seed(5)
    logits = (torch.randn(2, 9, 50) * 2).requires_grad_()
    z = F.sampling_logits(logits.detach(), 0.7, top_k=30, top_p=0.9, min_p=0.05)
    labels = torch.distributions.Categorical(logits=z).sample()  # tokens the engines could sample
    lp, entropy = F.token_logprobs(logits, labels, 0.7, chunk_size=8, with_entropy=True, entropy_grad=True,
                                   top_k=30, top_p=0.9, min_p=0.05)
    reference = torch.log_softmax(z, -1)
    torch.testing.assert_close(lp, reference.gather(-1, labels[..., None]).squeeze(-1))
    torch.testing.assert_close(entropy, -(reference.exp() * reference.masked_fill(torch.isinf(z), 0)).sum(-1))
    assert (lp > torch.log_softmax(logits / 0.7, -1).gather(-1, labels[..., None]).squeeze(-1)).all()
    (lp.sum() + entropy.sum()).backward()
    assert torch.isfinite(logits.grad).all()
    assert (logits.grad[torch.isinf(z)] == 0).all()  # removed tokens get no gradient


def test_token_logprobs_defaults_truncate_nothing():
    torch.manual_seed(6)
    logits, labels = torch.randn(2, 3, 11), torch.randint(0, 11, (2, 3))
    plain = F.token_logprobs(logits, labels, 0.9, with_entropy=True)
    same = F.token_logprobs(logits, labels, 0.9, with_entropy=True, top_k=11, top_p=1.0, min_p=0.0)
    assert torch.equal(plain[0], same[0]) and torch.equal(plain[1], same[1])


def test_truncation_errors_name_the_argument():
    logits, labels = torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long)
    for kwargs, name in [({"top_k": -1}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"min_p": 1.5}, "min_p")]:
        with pytest.raises(ValueError, match=name):
            F.token_logprobs(logits, labels, **kwargs)
    with pytest.raises(ValueError, match="temperature"):
        F.sampling_logits(logits, 0.0)
    with pytest.raises(ValueError, match="top_k=-1"):
        F.sampling_logits(logits, 1.0, top_k=-1)
