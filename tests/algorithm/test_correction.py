"""The rollout-correction knobs (issue 33) on a small case worked by hand: loss and gradient of each knob through
``grpo_objective``, the masks' values, and the relations that make every knob work with every ``loss_type`` and
policy-ratio level. TRL's counterparts are in test_differential_trl.py; accumulation in tests/test_accumulation.py.

The case: 2 sequences, mask [[1, 1, 1], [1, 1, 0]] (5 loss tokens), on-policy (the ratio pi / pi_old is 1 with
gradient 1), so each kept token's loss is ``-w_t * A_i`` and its gradient ``-w_t * A_i / 5`` with "dapo".
"""

import math

import pytest
import torch

from lightning_grpo import GRPOConfig
from lightning_grpo.algorithm import geometric_mask, grpo_objective, kl_mask, off_policy_mask
from lightning_grpo.config.correction import CorrectionConfig
from lightning_grpo.functional import loss_normalizer

pytestmark = pytest.mark.filterwarnings("ignore:importance_sampling_level='sequence' with loss_type")
NAN = float("nan")
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
LOGPROBS = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -0.3, -1.0]])
#: d = log pi_old - log pi_sampler = [[-0.8, 0.5, 0.0], [0.0, 1.7, (masked)]]: ratios [[0.4493, 1.6487, 1], [1, 5.4739]]
SAMPLER = torch.tensor([[-0.2, -2.5, -0.5], [-1.5, -2.0, NAN]])
ADVANTAGES = torch.tensor([1.0, -2.0])


def _run(advantages=ADVANTAGES, old=None, **knobs):
    """``(loss, gradient w.r.t. the logprobs, output)`` of the case with ``GRPOConfig(loss_type="dapo", **knobs)``."""
    config = GRPOConfig(loss_type=knobs.pop("loss_type", "dapo"), max_new_tokens=3, **knobs)
    lp = LOGPROBS.clone().requires_grad_(True)
    out = grpo_objective(lp, MASK, advantages, config, old_logprobs=old, sampler_logprobs=SAMPLER)
    (grad,) = torch.autograd.grad(out.loss, lp)
    return out.loss.detach(), grad, out


def _assert(loss, grad, expected_loss, expected_grad):
    torch.testing.assert_close(loss, torch.tensor(expected_loss), atol=1e-5, rtol=0)
    torch.testing.assert_close(grad, torch.tensor(expected_grad), atol=1e-5, rtol=0)


def test_icepop_two_sided_token_mask_golden():
    """IcePop = the importance weight in "mask" mode with bounds [0.5, 5]: ratio 0.4493 (< 0.5) and 5.4739 (> 5)
    are dropped, 1.6487 keeps its weight. Loss (-(0 + 1.6487 + 1) * 1 - (1 + 0) * -2) / 5."""
    loss, grad, out = _run(importance_sampling_cap=5.0, importance_sampling_min=0.5, importance_sampling_mode="mask")
    e = math.exp(0.5)
    _assert(loss, grad, (-(e + 1) + 2) / 5, [[0.0, -e / 5, -0.2], [0.4, 0.0, 0.0]])
    torch.testing.assert_close(out.importance_weights, torch.tensor([[0.0, e, 1.0], [1.0, 0.0, 1.0]]))


def test_two_sided_truncation_golden():
    """"truncate" with [0.5, 5]: 0.4493 is raised to 0.5, 5.4739 lowered to 5."""
    loss, grad, _ = _run(importance_sampling_cap=5.0, importance_sampling_min=0.5)
    e = math.exp(0.5)
    _assert(loss, grad, (-(0.5 + e + 1) + 2 * (1 + 5)) / 5, [[-0.1, -e / 5, -0.2], [0.4, 2.0, 0.0]])


def test_geometric_truncation_golden():
    """``rollout_importance_sampling_level="geometric"``: one weight per sequence, exp(mean d) = exp(-0.1) = 0.9048
    and exp(0.85) = 2.3396, truncated to [0.9, 1.2] -> 0.9048 and 1.2."""
    loss, grad, _ = _run(importance_sampling_cap=1.2, importance_sampling_min=0.9,
                         rollout_importance_sampling_level="geometric")
    g = math.exp(-0.1)
    _assert(loss, grad, (-3 * g + 2 * 2 * 1.2) / 5, [[-g / 5] * 3, [0.48, 0.48, 0.0]])


def test_geometric_sequence_mask_golden():
    """``correction.geo_mask_low/high`` [0.9, 1.05]: sequence 0 (0.9048) is kept, sequence 1 (2.3396) rejected; no
    weight. Its metrics name it "geometric"."""
    loss, grad, out = _run(correction=CorrectionConfig(geo_mask_low=0.9, geo_mask_high=1.05))
    _assert(loss, grad, -3 / 5, [[-0.2] * 3, [0.0, 0.0, 0.0]])
    assert out.importance_weights is None
    assert out.correction.keep["geometric"].tolist() == [[True] * 3, [False, False, True]]  # masked: True


@pytest.mark.parametrize(("estimator", "aggregation", "threshold", "kept"), [
    # k3 = exp(d) - 1 - d: [[0.24933, 0.14872, 0], [0, 2.77395]]; k2 = d^2 / 2: [[0.32, 0.125, 0], [0, 1.445]];
    # k1 = -d: [[0.8, -0.5, 0], [0, -1.7]]
    ("k3", "seq_mean", 0.5, [[1, 1, 1], [0, 0]]),  # means 0.13268 and 1.38697
    ("k3", "seq_sum", 0.4, [[1, 1, 1], [0, 0]]),  # sums 0.39805 and 2.77395
    ("k3", "seq_max", 0.2, [[0, 0, 0], [0, 0]]),  # maxima 0.24933 and 2.77395
    ("k2", "token", 0.2, [[0, 1, 1], [1, 0]]),
    ("k2", "seq_max", 0.4, [[1, 1, 1], [0, 0]]),  # maxima 0.32 and 1.445
    ("k1", "seq_mean", 0.2, [[1, 1, 1], [0, 0]]),  # |mean| 0.1 and 0.85
    ("k1", "token", 0.6, [[0, 1, 1], [1, 0]]),  # |k1| 0.8 > 0.6 and 1.7 > 0.6
])
def test_kl_rejection_golden(estimator, aggregation, threshold, kept):
    """KL-estimate rejection of each estimator and aggregation; the loss of the kept tokens, -w A / 5 with w = 1."""
    correction = CorrectionConfig(kl_mask_threshold=threshold, kl_mask_estimator=estimator,
                                  kl_mask_aggregation=aggregation)
    loss, grad, out = _run(correction=correction)
    keep = [[bool(k) for k in kept[0]], [bool(k) for k in kept[1]] + [True]]
    assert out.correction.keep["kl"].tolist() == keep
    expected_grad = [[-0.2 * k for k in kept[0]], [0.4 * k for k in kept[1]] + [0.0]]
    expected_loss = (-sum(kept[0]) + 2 * sum(kept[1])) / 5
    _assert(loss, grad, expected_loss, expected_grad)


def test_off_policy_sequence_mask_golden():
    """DeepSeek-V3.2 (delta 0.05): mean(sampler - current) = 0.1 for sequence 0 and -0.85 for sequence 1; with
    advantages [-1, 2] sequence 0 (A < 0, 0.1 > 0.05) is rejected, sequence 1 (A > 0) kept: loss -(2 + 2) / 5."""
    loss, grad, out = _run(advantages=torch.tensor([-1.0, 2.0]),
                           correction=CorrectionConfig(off_policy_mask_threshold=0.05))
    _assert(loss, grad, -4 / 5, [[0.0] * 3, [-0.4, -0.4, 0.0]])
    loss, _, _ = _run(advantages=torch.tensor([-1.0, 2.0]), correction=CorrectionConfig(off_policy_mask_threshold=0.1))
    torch.testing.assert_close(loss, torch.tensor((3 - 4) / 5))  # 0.1 <= 0.1: kept


def test_bypass_mode_golden():
    """Bypass: the old policy is the sampler, ratio exp(lp - sampler) = [[0.4493, 1.6487, 1], [1, 5.4739]], clipped
    to [0.8, 1.2]: row 0 (A = 1): max(-r, -clip(r)) = [-0.4493, -1.2 (clipped, no gradient), -1]; row 1 (A = -2):
    max(-r A, -clip(r) A) = [2, 10.9479 (unclipped: 2r > 2.4)]. The old logprobs given are ignored."""
    loss, grad, out = _run(old=LOGPROBS + 3.0, correction=CorrectionConfig(bypass_mode=True))
    low, high = math.exp(-0.8), math.exp(1.7)
    _assert(loss, grad, (-low - 1.2 - 1 + 2 + 2 * high) / 5, [[-low / 5, 0.0, -0.2], [0.4, 2 * high / 5, 0.0]])
    torch.testing.assert_close(out.correction.log_ratio, torch.tensor([[-0.8, 0.5, 0.0], [0.0, 1.7, 0.0]]))


def test_bypass_mode_without_sampler_logprobs_is_a_clear_error():
    config = GRPOConfig(correction=CorrectionConfig(bypass_mode=True))
    with pytest.raises(ValueError, match="bypass_mode=True takes the sampler's logprobs.*has none"):
        grpo_objective(LOGPROBS.clone().requires_grad_(True), MASK, ADVANTAGES, config)


def test_without_sampler_logprobs_the_masks_keep_everything():
    """An engine without sampler logprobs (HF) samples with the trained policy: log-ratio 0, nothing rejected."""
    config = GRPOConfig(loss_type="dapo", correction=CorrectionConfig(geo_mask_low=0.999, geo_mask_high=1.001,
                                                                      kl_mask_threshold=1e-9))
    lp = LOGPROBS.clone().requires_grad_(True)
    out = grpo_objective(lp, MASK, ADVANTAGES, config)
    assert out.correction.log_ratio is None and all(k.all() for k in out.correction.keep.values())
    torch.testing.assert_close(out.loss, torch.tensor((-3 + 4) / 5))


def test_mask_functions_golden():
    d = torch.tensor([[0.02, 0.0], [0.3, -0.3], [0.05, 0.05]])
    assert geometric_mask(d, torch.ones(3, 2), 0.99, 1.01)[:, 0].tolist() == [False, True, False]
    d, m = torch.tensor([[0.1, -0.2]]), torch.ones(1, 2)
    assert not kl_mask(d, m, 0.01).any() and kl_mask(d, m, 0.02).all()  # k3 mean 0.01195
    assert kl_mask(d, m, 0.01, aggregation="token").tolist() == [[True, False]]  # k3 0.00517, 0.01873
    behaviour, current = torch.tensor([[-1.0, -1.0]]), torch.tensor([[-1.5, -1.3]])  # mean KL 0.4
    assert not off_policy_mask(torch.tensor([-1.0]), current, behaviour, m, 0.3).any()
    assert off_policy_mask(torch.tensor([1.0]), current, behaviour, m, 0.3).all()
    assert off_policy_mask(torch.tensor([-1.0]), current, behaviour, m, 0.5).all()


# ----------------------------------------------------------------------- every loss_type and every ratio level
LOSS_TYPES = ["grpo", "bnpo", "token_mean", "dapo", "dr_grpo", "cispo"]
LEVELS = ["token", "sequence", "sequence_token"]
#: knob -> its config (its keep mask is ``out.correction.keep[knob]``)
SEQUENCE_MASKS = {
    "geometric": CorrectionConfig(geo_mask_low=0.9, geo_mask_high=1.05),
    "kl": CorrectionConfig(kl_mask_threshold=0.05),  # k3, seq_mean
    "off_policy": CorrectionConfig(off_policy_mask_threshold=0.05),
}


def _random_case(seed):
    g = torch.Generator().manual_seed(seed)
    n, t = 6, 5
    mask = (torch.arange(t) < torch.tensor([5, 3, 4, 5, 1, 2])[:, None]).long()
    lp = -2 * torch.rand(n, t, generator=g) - 0.1
    old = lp + 0.1 * torch.randn(n, t, generator=g)
    sampler = old + 0.3 * torch.randn(n, t, generator=g)
    return mask, lp, old, sampler, torch.randn(n, generator=g)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("knob", sorted(SEQUENCE_MASKS))
def test_a_sequence_mask_is_training_without_those_sequences(knob, loss_type, level):
    """A sequence-level mask drops whole sequences: the loss and gradient equal the objective without the knob on
    the kept sequences only (the step's denominator unchanged), for every loss type and policy-ratio level, off
    policy. Some sequences are rejected and some kept."""
    mask, lp, old, sampler, adv = _random_case(seed=1)
    kwargs = dict(loss_type=loss_type, max_new_tokens=5, importance_sampling_level=level)
    if loss_type == "cispo":
        kwargs.update(epsilon_low=1.0)
    with_knob = GRPOConfig(correction=SEQUENCE_MASKS[knob], **kwargs)
    plain = GRPOConfig(**kwargs)
    normalizer = loss_normalizer(mask, loss_type, 5)
    x = lp.clone().requires_grad_(True)
    out = grpo_objective(x, mask, adv, with_knob, old_logprobs=old, sampler_logprobs=sampler, normalizer=normalizer)
    (grad,) = torch.autograd.grad(out.loss, x)
    kept_rows = out.correction.keep[knob][:, 0]
    assert 0 < int(kept_rows.sum()) < len(kept_rows)
    y = lp.clone().requires_grad_(True)
    reduced = mask * kept_rows.long().unsqueeze(1)
    ref = grpo_objective(y, reduced, adv, plain, old_logprobs=old, sampler_logprobs=sampler, normalizer=normalizer)
    (ref_grad,) = torch.autograd.grad(ref.loss, y)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=0)
    assert grad[~kept_rows].abs().max() == 0 and grad[kept_rows].abs().max() > 0


@pytest.mark.parametrize("loss_type", [t for t in LOSS_TYPES if t != "grpo"])
@pytest.mark.parametrize("knob", ["icepop", "kl_token_k2"])
def test_a_token_mask_is_training_without_those_tokens(knob, loss_type):
    """A token-level mask (IcePop's, or KL rejection per token) at the token ratio level: the loss and gradient equal
    the objective without the knob on the kept tokens (for a token-sum loss type; IcePop also weights the kept
    tokens by their ratio, so its reference carries a TIS weight with an unreachable cap)."""
    mask, lp, old, sampler, adv = _random_case(seed=7 + len(loss_type))
    kwargs = dict(loss_type=loss_type, max_new_tokens=5, **({"epsilon_low": 1.0} if loss_type == "cispo" else {}))
    if knob == "icepop":
        with_knob = GRPOConfig(importance_sampling_cap=1.3, importance_sampling_min=0.77,
                               importance_sampling_mode="mask", **kwargs)
        plain = GRPOConfig(importance_sampling_cap=1e9, **kwargs)
    else:
        with_knob = GRPOConfig(correction=CorrectionConfig(kl_mask_threshold=0.02, kl_mask_estimator="k2",
                                                           kl_mask_aggregation="token"), **kwargs)
        plain = GRPOConfig(**kwargs)
    normalizer = loss_normalizer(mask, loss_type, 5)
    x = lp.clone().requires_grad_(True)
    out = grpo_objective(x, mask, adv, with_knob, old_logprobs=old, sampler_logprobs=sampler, normalizer=normalizer)
    (grad,) = torch.autograd.grad(out.loss, x)
    keep = out.importance_weights > 0 if knob == "icepop" else out.correction.keep["kl"]
    assert 0 < int((keep & mask.bool()).sum()) < int(mask.sum())
    y = lp.clone().requires_grad_(True)
    ref = grpo_objective(y, mask * keep.long(), adv, plain, old_logprobs=old, sampler_logprobs=sampler,
                         normalizer=normalizer)
    (ref_grad,) = torch.autograd.grad(ref.loss, y)
    torch.testing.assert_close(out.loss, ref.loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(grad, ref_grad, atol=1e-6, rtol=0)


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_every_knob_together_with_every_loss_type_and_level(loss_type, level):
    """All knobs at once (two-sided weight, geometric, KL and off-policy masks): a finite loss with a gradient, and
    no gradient on a sequence every mask rejects; bypass mode likewise."""
    mask, lp, old, sampler, adv = _random_case(seed=3)
    kwargs = dict(loss_type=loss_type, max_new_tokens=5, importance_sampling_level=level,
                  **({"epsilon_low": 1.0} if loss_type == "cispo" else {}))
    correction = CorrectionConfig(geo_mask_low=0.8, geo_mask_high=1.25, kl_mask_threshold=0.3,
                                  off_policy_mask_threshold=0.2)
    for config in (GRPOConfig(importance_sampling_cap=3.0, importance_sampling_min=0.33,
                              importance_sampling_mode="mask", correction=correction, **kwargs),
                   GRPOConfig(correction=CorrectionConfig(bypass_mode=True, geo_mask_low=0.8, geo_mask_high=1.25),
                              **kwargs)):
        x = lp.clone().requires_grad_(True)
        out = grpo_objective(x, mask, adv, config, old_logprobs=old, sampler_logprobs=sampler)
        (grad,) = torch.autograd.grad(out.loss, x)
        assert torch.isfinite(out.loss) and torch.isfinite(grad).all() and grad.abs().max() > 0
        trained = out.correction.combined() & mask.bool()
        if out.importance_weights is not None:
            trained &= out.importance_weights > 0
        dropped = ~trained.any(dim=1)  # rows none of whose tokens keeps its policy-gradient term
        assert dropped.any() and not dropped.all()
        assert grad[dropped].abs().max() == 0


# -------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(geo_mask_low=1.5), "geo_mask_low=1.5 is invalid: must be in"),
    (dict(geo_mask_high=0.9), "geo_mask_high=0.9 is invalid: must be >= 1"),
    (dict(kl_mask_threshold=0.0), "kl_mask_threshold=0.0 is invalid"),
    (dict(kl_mask_threshold=float("nan")), "kl_mask_threshold=nan is invalid: must be a finite"),
    (dict(kl_mask_estimator="k3"), "kl_mask_estimator='k3' is invalid: is read only with kl_mask_threshold"),
    (dict(kl_mask_threshold=0.1, kl_mask_aggregation="seq_median"), "choose one of token, seq_mean"),
    (dict(off_policy_mask_threshold=-0.1), "off_policy_mask_threshold=-0.1 is invalid"),
])
def test_correction_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CorrectionConfig(**kwargs)


def test_bypass_mode_is_refused_where_it_would_be_wrong():
    with pytest.raises(ValueError, match="bypass_mode=True is invalid: .*importance_sampling_cap=2.0 ignored"):
        GRPOConfig(importance_sampling_cap=2.0, correction=CorrectionConfig(bypass_mode=True))
    with pytest.raises(ValueError, match="importance_sampling_min=0.5 ignored"):
        GRPOConfig(importance_sampling_min=0.5, correction=CorrectionConfig(bypass_mode=True))
    with pytest.raises(ValueError, match="max_staleness=1 trains stale rollouts .* set a rejection mask"):
        GRPOConfig(max_staleness=1, correction=CorrectionConfig(bypass_mode=True))
    stale = GRPOConfig(max_staleness=1, correction=CorrectionConfig(bypass_mode=True, geo_mask_low=0.99))
    assert stale.tis_cap() is None and not stale.importance_weight_on()  # the async cap is not applied in bypass
    assert GRPOConfig(max_staleness=1).tis_cap() == 2.0
    with pytest.raises(ValueError, match="importance_sampling_min=1.5 is invalid"):
        GRPOConfig(importance_sampling_min=1.5)
    assert GRPOConfig.from_dict({"correction": {"geo_mask_low": 0.99}}).correction.geo_mask_low == 0.99
