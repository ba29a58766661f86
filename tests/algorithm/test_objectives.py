"""Golden values and gradients of the policy objectives beyond token-level GRPO, worked by hand in the comments:
GSPO and GSPO-token (arXiv:2507.18071), CISPO (arXiv:2506.13585), Clip-Cov and KL-Cov (arXiv:2505.22617)."""

import math

import pytest
import torch

from lightning_grpo.algorithm import (
    CovarianceStats,
    clip_cov_generator,
    clip_cov_mask,
    covariance_centers,
    covariance_stats,
    grpo_objective,
    kl_cov_threshold,
    policy_log_ratio,
    selection_count,
    sequence_log_ratio,
    token_covariance,
)
from lightning_grpo.config import GRPOConfig

NAN = float("nan")


def _run(config, logprobs, mask, advantages, **kwargs):
    """The objective's loss and its gradient w.r.t. ``logprobs``."""
    leaf = logprobs.clone().requires_grad_(True)
    out = grpo_objective(leaf, mask, advantages, config, **kwargs)
    (grad,) = torch.autograd.grad(out.loss, leaf)
    return out, grad


# --------------------------------------------------------------------------- GSPO
# Two sequences of 2 and 3 tokens (third position of row 0 is padding holding garbage).
#   row 0: logp [-1.0, -2.0], old [-1.2, -1.6]: log-ratios [0.2, -0.4] -> mean -0.1 -> s_0 = e^-0.1 = 0.904837
#   row 1: logp [-0.5, -1.0, -1.5], old [-0.8, -1.3, -1.8]: log-ratios 0.3 each -> s_1 = e^0.3 = 1.349859
GSPO_LOGP = torch.tensor([[-1.0, -2.0, NAN], [-0.5, -1.0, -1.5]])
GSPO_OLD = torch.tensor([[-1.2, -1.6, 7.0], [-0.8, -1.3, -1.8]])
GSPO_MASK = torch.tensor([[1, 1, 0], [1, 1, 1]])
GSPO_ADV = torch.tensor([-1.0, 1.0])


def _gspo_config(level, loss_type="grpo"):
    return GRPOConfig(num_generations=2, importance_sampling_level=level, loss_type=loss_type)


def test_sequence_log_ratio_golden():
    log_s = sequence_log_ratio(GSPO_LOGP, GSPO_OLD, GSPO_MASK)
    torch.testing.assert_close(log_s, torch.tensor([-0.1, 0.3]))


def test_gspo_hand_worked_value_and_gradient():
    out, grad = _run(_gspo_config("sequence"), GSPO_LOGP, GSPO_MASK, GSPO_ADV, old_logprobs=GSPO_OLD)
    # row 0, A = -1, s_0 = 0.904837 in [0.8, 1.2]: max(-s*A, -clip(s)*A) = 0.904837 (unclipped)
    # row 1, A = +1, s_1 = 1.349859 > 1.2: max(-1.349859, -1.2) = -1.2 (clipped, no gradient)
    # loss_type "grpo": each row's loss on each of its tokens, token mean per row, mean over rows:
    #   (0.904837 - 1.2) / 2 = -0.147582
    s0 = math.exp(-0.1)
    assert out.loss.item() == pytest.approx((s0 - 1.2) / 2, abs=1e-6)
    # d loss / d logp_t = 1/2 (rows) * (-A_0) * d s_0 / d logp_t = 1/2 * 1 * s_0 / |y_0| = s_0 / 4 = 0.226209
    # on both tokens of row 0; row 1 is clipped -> 0; padding -> 0
    expected = torch.tensor([[s0 / 4, s0 / 4, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(grad, expected)
    # every token of a row carries the row's ratio and clip flag
    torch.testing.assert_close(out.clip.ratio[1], torch.full((3,), math.exp(0.3)))
    assert out.clip.high.tolist() == [[False, False, False], [True, True, True]]


def test_gspo_with_loss_type_dapo_weights_rows_by_length():
    with pytest.warns(UserWarning, match="weights each sequence's loss by its number of tokens"):
        config = _gspo_config("sequence", "dapo")
    out, grad = _run(config, GSPO_LOGP, GSPO_MASK, GSPO_ADV, old_logprobs=GSPO_OLD)
    # (2 * 0.904837 + 3 * (-1.2)) / 5 tokens = -0.358065; gradient of row 0: 2 tokens * s_0 / 2 / 5 = s_0 / 5 each
    s0 = math.exp(-0.1)
    assert out.loss.item() == pytest.approx((2 * s0 - 3.6) / 5, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[s0 / 5, s0 / 5, 0.0], [0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_gspo_token_has_the_value_and_gradient_of_gspo(loss_type, recwarn):
    torch.manual_seed(0)
    logp = torch.randn(3, 5) * 0.3 - 1
    old = logp + torch.randn(3, 5) * 0.2
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])
    advantages = torch.tensor([1.5, -0.7, 0.4])
    seq, seq_grad = _run(_gspo_config("sequence", loss_type), logp, mask, advantages, old_logprobs=old)
    tok, tok_grad = _run(_gspo_config("sequence_token", loss_type), logp, mask, advantages, old_logprobs=old)
    torch.testing.assert_close(tok.loss, seq.loss)
    torch.testing.assert_close(tok_grad, seq_grad)
    torch.testing.assert_close(tok.clip.ratio[mask.bool()], seq.clip.ratio[mask.bool()])
    assert seq_grad[mask.bool()].abs().min() > 0  # the comparison is not between two zeros


def test_gspo_token_ratio_value_is_the_sequence_ratio_and_gradient_is_per_token():
    logp = GSPO_LOGP.clone().requires_grad_(True)
    log_s_t = policy_log_ratio(logp, GSPO_OLD, GSPO_MASK, "sequence_token")
    torch.testing.assert_close(log_s_t.detach(), torch.tensor([[-0.1, -0.1, 0.0], [0.3, 0.3, 0.3]]))
    # d log s_{0,1} / d logp = one-hot at (0, 1): each token's gradient reaches its own logprob only
    (grad,) = torch.autograd.grad(log_s_t[0, 1], logp)
    assert grad.tolist() == [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    # while GSPO's sequence ratio spreads 1 / |y_i| over the tokens of the sequence
    (grad,) = torch.autograd.grad(policy_log_ratio(logp, GSPO_OLD, GSPO_MASK, "sequence")[1, 0], logp)
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3]]))


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_gspo_on_one_token_sequences_equals_grpo(loss_type, recwarn):
    mask = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 0, 0]])
    logp = torch.tensor([[-1.0, NAN, NAN], [NAN, -2.0, NAN], [NAN, NAN, -0.5], [-3.0, NAN, NAN]])
    # ratios 1.5 (A > 0: clipped high), 0.5 (A < 0: clipped low), 4 (A < 0: capped by delta 2), 1.1 (unclipped)
    old = torch.nan_to_num(logp) - torch.tensor([1.5, 0.5, 4.0, 1.1]).log().unsqueeze(1) * mask
    advantages = torch.tensor([1.0, -1.0, -2.0, 0.5])
    common = dict(num_generations=2, loss_type=loss_type, epsilon_high=0.28, clip_ratio_c=3.0, delta=2.0)
    grpo, grpo_grad = _run(GRPOConfig(**common), logp, mask, advantages, old_logprobs=old)
    for level in ("sequence", "sequence_token"):
        gspo, gspo_grad = _run(GRPOConfig(importance_sampling_level=level, **common), logp, mask, advantages,
                               old_logprobs=old)
        torch.testing.assert_close(gspo.loss, grpo.loss)
        torch.testing.assert_close(gspo_grad, grpo_grad)
    assert (grpo.clip.region & mask.bool()).any() and (grpo_grad != 0).any()


# --------------------------------------------------------------------------- CISPO
# One row, A = +2. Token log-ratios ln 1.5 and ln 0.5 (ratios 1.5 and 0.5), logp [-1, -2].
CISPO_LOGP = torch.tensor([[-1.0, -2.0]])
CISPO_OLD = CISPO_LOGP - torch.tensor([[math.log(1.5), math.log(0.5)]])
CISPO_MASK = torch.ones(1, 2)
CISPO_ADV = torch.tensor([2.0])


def test_cispo_golden_value_and_gradient_keeps_clipped_tokens():
    config = GRPOConfig(num_generations=2, loss_type="cispo")
    out, grad = _run(config, CISPO_LOGP, CISPO_MASK, CISPO_ADV, old_logprobs=CISPO_OLD)
    # weights sg[clip(r, 0.8, 1.2)] = [1.2, 0.8]; per token -w * A * logp = [-1.2*2*(-1), -0.8*2*(-2)] = [2.4, 3.2]
    # loss_type "cispo" = mean over the tokens: 2.8; gradient -w * A / 2 tokens = [-1.2, -0.8]
    assert out.loss.item() == pytest.approx(2.8)
    torch.testing.assert_close(grad, torch.tensor([[-1.2, -0.8]]))
    assert out.clip.high.tolist() == [[True, False]] and out.clip.low.tolist() == [[False, True]]
    # PPO-clip (same token mean): token 0 (r = 1.5 > 1.2, A > 0) is clipped and gets no gradient; token 1 keeps
    # the unclipped -A * r / 2 tokens -> gradient -2 * 0.5 / 2 = -0.5
    _, ppo_grad = _run(GRPOConfig(num_generations=2, loss_type="dapo"), CISPO_LOGP, CISPO_MASK, CISPO_ADV,
                       old_logprobs=CISPO_OLD)
    torch.testing.assert_close(ppo_grad, torch.tensor([[0.0, -0.5]]))


def test_cispo_without_lower_bound_and_at_the_sequence_level():
    # epsilon_low = 1: no lower bound (the paper's setting); weights [1.2, 0.5]: [2.4, -0.5*2*(-2) = 2.0] -> 2.2
    config = GRPOConfig(num_generations=2, loss_type="cispo", epsilon_low=1.0)
    out, grad = _run(config, CISPO_LOGP, CISPO_MASK, CISPO_ADV, old_logprobs=CISPO_OLD)
    assert out.loss.item() == pytest.approx(2.2)
    torch.testing.assert_close(grad, torch.tensor([[-1.2, -0.5]]))
    # sequence level: s = exp((ln 1.5 + ln 0.5) / 2) = sqrt(0.75) = 0.866 in [0.8, 1.2], the weight of both tokens:
    # [-0.866 * 2 * (-1), -0.866 * 2 * (-2)] -> mean 3 * 0.866 = 2.598
    with pytest.warns(UserWarning, match="number of tokens"):
        config = GRPOConfig(num_generations=2, loss_type="cispo", importance_sampling_level="sequence")
    out, grad = _run(config, CISPO_LOGP, CISPO_MASK, CISPO_ADV, old_logprobs=CISPO_OLD)
    assert out.loss.item() == pytest.approx(3 * math.sqrt(0.75))
    torch.testing.assert_close(grad, torch.full((1, 2), -math.sqrt(0.75)))


# --------------------------------------------------------------------------- Clip-Cov / KL-Cov
# 5 loss tokens: logp [[-0.5, -1.0, -3.0], [-2.0, -3.5, pad]], A = [2, -2] per row.
#   centers: mean logp = -10 / 5 = -2.0; mean A over tokens = (3 * 2 - 2 * 2) / 5 = 0.4
#   cov = (logp + 2) * (A - 0.4): row 0 (A - 0.4 = 1.6): [1.5 * 1.6, 1.0 * 1.6, -1.0 * 1.6] = [2.4, 1.6, -1.6]
#                                 row 1 (A - 0.4 = -2.4): [0 * -2.4, -1.5 * -2.4] = [0, 3.6]
COV_LOGP = torch.tensor([[-0.5, -1.0, -3.0], [-2.0, -3.5, NAN]])
COV_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
COV_ADV = torch.tensor([2.0, -2.0])
COV = torch.tensor([[2.4, 1.6, -1.6], [0.0, 3.6, -math.inf]])


def test_covariance_golden():
    centers = covariance_centers(COV_LOGP, COV_ADV, COV_MASK)
    assert centers == pytest.approx((-2.0, 0.4))
    torch.testing.assert_close(token_covariance(COV_LOGP, COV_ADV, COV_MASK, *centers), COV)
    # counts: max(int(ratio * n), 1)
    assert [selection_count(5, r) for r in (2e-4, 0.4, 1.0)] == [1, 2, 5]
    # KL-Cov cut: 2 largest of [2.4, 1.6, -1.6, 0, 3.6] -> threshold 2.4
    assert kl_cov_threshold(COV, COV_MASK, 0.4) == pytest.approx(2.4)


def test_clip_cov_mask_draws_from_the_candidates_with_an_explicit_generator():
    # candidates: 1 < cov < 5 -> (0, 0) = 2.4, (0, 1) = 1.6, (1, 1) = 3.6 (cov 0, -1.6 and padding are not)
    candidates = {(0, 0), (0, 1), (1, 1)}
    rng_state = torch.get_rng_state()
    picks = []
    for step in range(6):
        chosen = clip_cov_mask(COV, COV_MASK, 1.0, 5.0, count=2, generator=clip_cov_generator(7, step))
        again = clip_cov_mask(COV, COV_MASK, 1.0, 5.0, count=2, generator=clip_cov_generator(7, step))
        assert torch.equal(chosen, again)  # the same (seed, step) draws the same tokens
        picked = {tuple(i) for i in chosen.nonzero().tolist()}
        assert len(picked) == 2 and picked <= candidates
        picks.append(frozenset(picked))
    assert len(set(picks)) > 1  # different steps draw differently
    assert torch.equal(torch.get_rng_state(), rng_state)  # the global RNG was not used
    everything = clip_cov_mask(COV, COV_MASK, 1.0, 5.0, count=5, generator=clip_cov_generator(0, 0))
    assert {tuple(i) for i in everything.nonzero().tolist()} == candidates
    excluded = clip_cov_mask(COV, COV_MASK, 1.0, 5.0, count=5, generator=clip_cov_generator(0, 0),
                             exclude=torch.tensor([[True, False, False], [False, False, False]]))
    assert {tuple(i) for i in excluded.nonzero().tolist()} == {(0, 1), (1, 1)}
    with pytest.raises(ValueError, match="clip_cov_lb=5.0 must be < clip_cov_ub=1.0"):
        clip_cov_mask(COV, COV_MASK, 5.0, 1.0, count=1, generator=clip_cov_generator(0, 0))


def test_clip_cov_objective_golden():
    config = GRPOConfig(num_generations=2, policy_loss_mode="clip_cov", clip_cov_ratio=1.0, loss_type="grpo")
    # token (0, 0) is PPO-clipped (ratio e^0.5 = 1.6487 > 1.2 with A > 0): not a candidate. The candidates left,
    # (0, 1) and (1, 1), are both dropped (count max(int(1.0 * 5), 1) = 5 >= 2).
    old = COV_LOGP - torch.tensor([[0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    out, grad = _run(config, COV_LOGP, COV_MASK, COV_ADV, old_logprobs=old, generator=clip_cov_generator(0, 3))
    assert out.covariance_mask.tolist() == [[False, True, False], [False, True, False]]
    # per token: [-1.2 * 2 = -2.4 (clipped), 0 (dropped), -2 * 1], [2 * 1, 0 (dropped)]
    # "grpo": row means (-2.4 + 0 - 2) / 3 = -1.466667 and (2 + 0) / 2 = 1 -> (-1.466667 + 1) / 2 = -0.233333
    assert out.loss.item() == pytest.approx((-4.4 / 3 + 1) / 2)
    # gradients: clipped and dropped tokens 0; (0, 2): -A / 3 / 2 = -1/3; (1, 0): +2 / 2 / 2 = 0.5
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0, -1 / 3], [0.5, 0.0, 0.0]]))


# KL-Cov: log-ratios d = logp - old = [[0.1, 0, 0], [0, -0.2]], kl_cov_ratio 0.4 -> the 2 tokens of largest
# covariance, (1, 1) = 3.6 and (0, 0) = 2.4, get + 1.0 * |d|; the surrogate is the unclipped -A * e^d.
KL_OLD = COV_LOGP - torch.tensor([[0.1, 0.0, 0.0], [0.0, -0.2, 0.0]])


def test_kl_cov_objective_golden():
    config = GRPOConfig(num_generations=2, policy_loss_mode="kl_cov", kl_cov_ratio=0.4, ppo_kl_coef=1.0,
                        loss_type="dapo")
    out, grad = _run(config, COV_LOGP, COV_MASK, COV_ADV, old_logprobs=KL_OLD)
    assert out.covariance_mask.tolist() == [[True, False, False], [False, True, False]]
    # per token: (0,0) -2 e^0.1 + 0.1 = -2.110342; (0,1) -2; (0,2) -2; (1,0) +2; (1,1) 2 e^-0.2 + 0.2 = 1.837462
    # "dapo": sum / 5 tokens = -2.272880 / 5 = -0.454576
    per_token = [-2 * math.exp(0.1) + 0.1, -2.0, -2.0, 2.0, 2 * math.exp(-0.2) + 0.2]
    assert out.loss.item() == pytest.approx(sum(per_token) / 5)
    # gradient / 5: (0,0) (-2 e^0.1 + sign(0.1)) / 5 = -0.242068; (1,1) (2 e^-0.2 - 1) / 5 = 0.127492; others -A / 5
    expected = torch.tensor([[(-2 * math.exp(0.1) + 1) / 5, -0.4, -0.4], [0.4, (2 * math.exp(-0.2) - 1) / 5, 0.0]])
    torch.testing.assert_close(grad, expected)
    assert not out.clip.region.any()  # unclipped surrogate
    # precomputed statistics: threshold 3.0 selects (1, 1) only
    stats = CovarianceStats(logprob_mean=-2.0, advantage_mean=0.4, kl_threshold=3.0)
    out, _ = _run(config, COV_LOGP, COV_MASK, COV_ADV, old_logprobs=KL_OLD, covariance_stats=stats)
    assert out.covariance_mask.tolist() == [[False, False, False], [False, True, False]]


@pytest.mark.parametrize("mode", ["clip_cov", "kl_cov"])
def test_step_level_covariance_stats_make_the_loss_independent_of_the_split(mode):
    config = GRPOConfig(num_generations=2, policy_loss_mode=mode, clip_cov_ratio=1.0, kl_cov_ratio=0.4,
                        loss_type="dapo")
    stats = covariance_stats(COV_LOGP, COV_ADV, COV_MASK, config.kl_cov_ratio)
    assert stats.kl_threshold == pytest.approx(2.4)
    kwargs = dict(covariance_stats=stats, normalizer=5.0)
    whole, whole_grad = _run(config, COV_LOGP, COV_MASK, COV_ADV, old_logprobs=KL_OLD, **kwargs)
    parts = [_run(config, COV_LOGP[i : i + 1], COV_MASK[i : i + 1], COV_ADV[i : i + 1],
                  old_logprobs=KL_OLD[i : i + 1], **kwargs) for i in range(2)]
    assert whole.loss.item() == pytest.approx(sum(p[0].loss.item() for p in parts))
    torch.testing.assert_close(torch.cat([p[1] for p in parts]), whole_grad)
    selected = torch.cat([p[0].covariance_mask for p in parts])
    assert torch.equal(selected, whole.covariance_mask) and selected.any()
    # without the step-level statistics, each micro-batch centers on its own tokens and selects differently
    alone = [_run(config, COV_LOGP[i : i + 1], COV_MASK[i : i + 1], COV_ADV[i : i + 1],
                  old_logprobs=KL_OLD[i : i + 1], normalizer=5.0)[0].covariance_mask for i in range(2)]
    assert not torch.equal(torch.cat(alone), whole.covariance_mask)


@pytest.mark.parametrize("garbage", [1e9, NAN, -math.inf])
@pytest.mark.parametrize(
    "settings",
    [
        dict(importance_sampling_level="sequence"),
        dict(importance_sampling_level="sequence_token"),
        dict(loss_type="cispo"),
        dict(policy_loss_mode="clip_cov", clip_cov_ratio=0.5),
        dict(policy_loss_mode="kl_cov", kl_cov_ratio=0.5),
    ],
)
def test_new_objectives_ignore_every_value_at_masked_positions(settings, garbage):
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    config = GRPOConfig(num_generations=2, **{"loss_type": "grpo", **settings})
    old = torch.randn(3, 4) - 1
    logits = torch.randn(3, 4, requires_grad=True)

    def run(fill, advantages, old_values):
        logprobs = torch.where(mask.bool(), torch.nn.functional.logsigmoid(logits), fill)
        out = grpo_objective(logprobs, mask, advantages, config, old_logprobs=old_values,
                             generator=clip_cov_generator(0, 0))
        return out.loss, torch.autograd.grad(out.loss, logits)[0]

    clean, clean_grad = run(0.0, torch.tensor([1.0, -2.0, 0.0]), old)
    dirty, dirty_grad = run(garbage, torch.tensor([1.0, -2.0, garbage]), torch.where(mask.bool(), old, garbage))
    assert torch.isfinite(clean) and dirty.item() == clean.item()
    assert torch.equal(clean_grad, dirty_grad) and clean_grad.abs().sum() > 0


def test_policy_ratio_level_and_rollout_correction_level_are_separate_knobs():
    # on-policy logp [-1, -2], A = 2, sampler [-1.5, -2]: TIS log-weights old - sampler = [0.5, 0], cap 2
    logp, mask, advantages = torch.tensor([[-1.0, -2.0]]), torch.ones(1, 2), torch.tensor([2.0])
    sampler = torch.tensor([[-1.5, -2.0]])
    # rollout level "sequence": weight exp(0.5 + 0) = 1.648721 on both tokens -> -2 * 1.648721 = -3.297443
    config = GRPOConfig(num_generations=2, importance_sampling_cap=2.0, rollout_importance_sampling_level="sequence")
    out, _ = _run(config, logp, mask, advantages, sampler_logprobs=sampler)
    assert out.loss.item() == pytest.approx(-2 * math.exp(0.5))
    # policy level "sequence" (ratio 1 on-policy), rollout level "token": weights [1.648721, 1] -> -2.648721
    config = GRPOConfig(num_generations=2, importance_sampling_cap=2.0, importance_sampling_level="sequence")
    out, _ = _run(config, logp, mask, advantages, sampler_logprobs=sampler)
    assert out.loss.item() == pytest.approx(-(math.exp(0.5) + 1))
