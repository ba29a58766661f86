"""On-policy distillation's loss (issue 33): the per-token reverse KL as the advantage, worked by hand; mixed with
rewards; every loss type; the config's errors (the tokenizer check: tests/distillation/test_tokenizer_check.py)."""

import pytest
import torch

from lightning_grpo import GRPOConfig
from lightning_grpo.algorithm import distillation_advantages, grpo_objective, reverse_kl
from lightning_grpo.config.distillation import DistillationConfig
from lightning_grpo.functional import aggregate_loss

STUDENT = torch.tensor([[-1.0, -0.5, -2.0], [-0.7, -1.2, -3.0]])
TEACHER = torch.tensor([[-2.0, -0.25, -2.0], [-0.2, -1.2, float("nan")]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
#: k = student - teacher on the loss tokens: [[1.0, -0.25, 0.0], [-0.5, 0.0]]


def _distill(loss_type="dapo", coef=1.0, reward_weight=0.0, advantages=(0.0, 0.0), **knobs):
    config = GRPOConfig(loss_type=loss_type, max_new_tokens=3, distillation=DistillationConfig(
        teacher="unused-by-the-objective", coef=coef, reward_weight=reward_weight), **knobs)
    lp = STUDENT.clone().requires_grad_(True)
    out = grpo_objective(lp, MASK, torch.tensor(advantages), config, teacher_logprobs=TEACHER)
    (grad,) = torch.autograd.grad(out.loss, lp)
    return out.loss.detach(), grad, out


def test_the_loss_is_the_reverse_kl_by_hand():
    """On-policy (ratio 1), distillation alone: the loss is the mean over the loss tokens of log pi - log pi_teacher
    (the reverse KL estimate on the student's own samples): (1 - 0.25 + 0 - 0.5 + 0) / 5 = 0.05, and its gradient
    w.r.t. each logprob is that token's k / 5 (REINFORCE of the reverse KL)."""
    loss, grad, out = _distill()
    torch.testing.assert_close(loss, torch.tensor(0.25 / 5))
    torch.testing.assert_close(grad, torch.tensor([[0.2, -0.05, 0.0], [-0.1, 0.0, 0.0]]))
    torch.testing.assert_close(out.distillation_kl, torch.tensor([[1.0, -0.25, 0.0], [-0.5, 0.0, 0.0]]))
    # the same as a by-hand surrogate sum_t sg[k_t] * log pi(y_t) / n
    lp = STUDENT.clone().requires_grad_(True)
    k = torch.tensor([[1.0, -0.25, 0.0], [-0.5, 0.0, 0.0]])
    (by_hand,) = torch.autograd.grad((k * lp).sum() / 5, lp)
    torch.testing.assert_close(grad, by_hand)


def test_coef_and_grpo_loss_type_by_hand():
    """coef 2 with "grpo": per sequence mean of 2k, then mean over sequences: (2 * 0.75 / 3 + 2 * -0.5 / 2) / 2."""
    loss, grad, _ = _distill(loss_type="grpo", coef=2.0)
    torch.testing.assert_close(loss, torch.tensor((1.5 / 3 - 1.0 / 2) / 2))
    torch.testing.assert_close(grad, torch.tensor([[2 / 6, -0.5 / 6, 0.0], [-1 / 4, 0.0, 0.0]]))


def test_mixed_with_rewards_by_hand():
    """A_t = w * A_i - coef * k_t with A = [2, -1], w 0.5: [[1 - 1, 1 + 0.25, 1], [-0.5 + 0.5, -0.5]]."""
    expected = torch.tensor([[0.0, 1.25, 1.0], [0.0, -0.5, 0.0]])
    torch.testing.assert_close(distillation_advantages(torch.tensor([2.0, -1.0]), STUDENT, TEACHER, MASK, 1.0, 0.5),
                               expected)
    loss, grad, _ = _distill(reward_weight=0.5, advantages=(2.0, -1.0))
    torch.testing.assert_close(loss, -expected.sum() / 5)
    torch.testing.assert_close(grad, -expected / 5)


def test_off_policy_tokens_are_clipped_per_token():
    """The advantages go through the clipped surrogate per token: with old = student + [0.5, ...] the first token's
    ratio exp(-0.5) < 0.8 and its advantage -1 < 0, so it is clipped (no gradient)."""
    config = GRPOConfig(loss_type="dapo", distillation=DistillationConfig(teacher="t"))
    lp = STUDENT.clone().requires_grad_(True)
    old = STUDENT + torch.tensor([[0.5, 0.0, 0.0], [0.0, 0.0, 0.0]])
    out = grpo_objective(lp, MASK, torch.zeros(2), config, old_logprobs=old, teacher_logprobs=TEACHER)
    (grad,) = torch.autograd.grad(out.loss, lp)
    # k is read from the old (behaviour) logprobs: the first token's k = -0.5 + 2 = 1.5
    assert out.distillation_kl[0, 0] == pytest.approx(1.5) and out.clip.low[0, 0]
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.05, 0.0], [-0.1, 0.0, 0.0]]))


@pytest.mark.filterwarnings("ignore:importance_sampling_level='sequence' with loss_type")
@pytest.mark.parametrize("level", ["token", "sequence", "sequence_token"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "token_mean", "dapo", "dr_grpo", "cispo"])
def test_every_loss_type_and_level_has_the_reverse_kl_value_on_policy(loss_type, level):
    """On-policy the surrogate's value is -sum A_t aggregated by the loss type, whatever the ratio level (the ratio
    is 1); the gradient is finite and not zero."""
    knobs = {"epsilon_low": 1.0} if loss_type == "cispo" else {}
    loss, grad, _ = _distill(loss_type=loss_type, importance_sampling_level=level, **knobs)
    k = torch.tensor([[1.0, -0.25, 0.0], [-0.5, 0.0, 0.0]])
    expected = aggregate_loss(k, MASK, loss_type, 3)
    if loss_type == "cispo":  # -sg[w] * A * log pi: the value carries log pi, not the ratio
        expected = aggregate_loss(k * STUDENT, MASK, loss_type, 3)
    torch.testing.assert_close(loss, expected)
    assert torch.isfinite(grad).all() and grad.abs().max() > 0


def test_a_non_finite_teacher_logprob_of_a_loss_token_is_an_error():
    teacher = TEACHER.clone()
    teacher[1, 1] = -float("inf")
    with pytest.raises(ValueError, match=r"teacher's logprob of loss token \(row, position\) \(1, 1\) is not finite"):
        distillation_advantages(torch.zeros(2), STUDENT, teacher, MASK, 1.0, 0.0)
    assert reverse_kl(STUDENT, TEACHER, MASK)[1, 2] == 0  # the NaN at a masked position never reaches anything


# ------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(teacher="a", teacher_url="http://127.0.0.1:1"), "teacher_url=.* a teacher is either a model"),
    (dict(teacher="a", coef=0.0), "coef=0.0 is invalid: must be > 0"),
    (dict(teacher="a", reward_weight=-1.0), "reward_weight=-1.0 is invalid"),
    (dict(reward_weight=1.0), "reward_weight=1.0 is invalid: is read only with a teacher"),
    (dict(teacher="a", teacher_model_name="m"), "teacher_model_name='m' is invalid: is read only for a served"),
    (dict(teacher_url="ftp://x"), "teacher_url='ftp://x' is invalid: must be http"),
    (dict(teacher_url="http://127.0.0.1:1/v1", teacher_api="openai"), "teacher_model_name=None is invalid"),
    (dict(teacher_url="http://127.0.0.1:1", teacher_model_name="m"), "is read only with teacher_api='openai'"),
    (dict(teacher="a", teacher_timeout=float("inf")), "teacher_timeout=inf is invalid: must be a finite"),
])
def test_distillation_config_errors_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DistillationConfig(**kwargs)


def test_distillation_combinations_that_cannot_work_are_refused():
    teacher = DistillationConfig(teacher="t")
    served = DistillationConfig(teacher_url="http://127.0.0.1:1")
    with pytest.raises(ValueError, match="policy_loss_mode='clip_cov' selects tokens"):
        GRPOConfig(policy_loss_mode="clip_cov", distillation=teacher)
    with pytest.raises(ValueError, match="dynamic_sampling=True the groups are filtered by a reward that does not"):
        GRPOConfig(dynamic_sampling=True, distillation=teacher)
    GRPOConfig(dynamic_sampling=True, distillation=DistillationConfig(teacher="t", reward_weight=1.0))
    with pytest.raises(ValueError, match="a served teacher scores at temperature 1 .* temperature=0.7"):
        GRPOConfig(temperature=0.7, distillation=served)
    GRPOConfig(temperature=0.7, top_p=0.9, distillation=teacher)  # a local teacher is scored like the policy
    assert GRPOConfig.from_dict({"distillation": {"teacher": "t", "coef": 0.5}}).distillation.coef == 0.5
    assert not GRPOConfig().distillation.enabled and teacher.enabled and served.enabled
