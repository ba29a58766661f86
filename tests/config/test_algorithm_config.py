"""GRPOConfig rejects bad algorithm settings at construction, naming the field and the value."""


import pytest

from lightning_grpo.config import GRPOConfig


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_generations": 1}, r"num_generations=1 .*G|num_generations=1 .*group"),
        ({"advantage_estimator": "ppo"}, r"advantage_estimator='ppo'"),
        ({"advantage_std_floor": -0.1}, r"advantage_std_floor=-0.1"),
        ({"advantage_eps": 0.0}, r"advantage_eps=0.0 .*advantage_std_floor"),
        ({"reward_scale": 0.0}, r"reward_scale=0.0"),
        ({"reward_clip": -1.0}, r"reward_clip=-1.0"),
        ({"overlong_buffer": 300, "max_new_tokens": 256}, r"overlong_buffer=300 .*max_new_tokens=256"),
        ({"overlong_penalty_factor": -1.0}, r"overlong_penalty_factor=-1.0"),
        ({"max_num_gen_batches": 0}, r"max_num_gen_batches=0"),
        ({"kl_in_reward": True}, r"kl_in_reward=True .*beta > 0"),
        ({"entropy_coef": -0.01}, r"entropy_coef=-0.01"),
        ({"top_entropy_quantile": 1.5}, r"top_entropy_quantile=1.5"),
        ({"importance_sampling_cap": 0.5}, r"importance_sampling_cap=0.5"),
        ({"importance_sampling_level": "word"}, r"importance_sampling_level='word'"),
        ({"importance_sampling_mode": "clip"}, r"importance_sampling_mode='clip'"),
        ({"loss_type": "ppo"}, r"loss_type='ppo'"),
        ({"clip_ratio_c": 1.0}, r"clip_ratio_c=1.0"),
        ({"epsilon_low": 1.5}, r"epsilon_low=1.5 .*\[0, 1\]"),
        ({"rollout_importance_sampling_level": "word"}, r"rollout_importance_sampling_level='word'"),
        ({"policy_loss_mode": "gspo"}, r"policy_loss_mode='gspo'"),
        ({"clip_cov_ratio": 0.0}, r"clip_cov_ratio=0.0 .*\(0, 1\]"),
        ({"kl_cov_ratio": 1.5}, r"kl_cov_ratio=1.5 .*\(0, 1\]"),
        ({"clip_cov_lb": 5.0}, r"clip_cov_lb=5.0 .*clip_cov_ub=5.0"),
        ({"ppo_kl_coef": -1.0}, r"ppo_kl_coef=-1.0"),
        ({"loss_type": "cispo", "delta": 2.0}, r"loss_type='cispo' .*delta"),
        ({"loss_type": "cispo", "clip_ratio_c": 3.0}, r"loss_type='cispo' .*clip_ratio_c"),
        ({"policy_loss_mode": "clip_cov", "loss_type": "cispo"}, r"policy_loss_mode='clip_cov' .*cispo"),
        ({"policy_loss_mode": "kl_cov", "importance_sampling_level": "sequence_token"},
         r"policy_loss_mode='kl_cov' .*importance_sampling_level='token'"),
        ({"policy_loss_mode": "kl_cov", "clip_ratio_c": 3.0}, r"policy_loss_mode='kl_cov' .*clip_ratio_c"),
    ],
)
def test_bad_settings_raise_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GRPOConfig(**kwargs)


def test_good_settings_construct():
    config = GRPOConfig(
        num_generations=2, advantage_estimator="rloo", scale_rewards="none", advantage_eps=0.0, overlong_buffer=4,
        max_new_tokens=4, beta=0.1, kl_in_reward=True, dynamic_sampling=True, max_num_gen_batches=1,
        top_entropy_quantile=0.0, importance_sampling_cap=1.0, reward_clip=1.0,
    )
    assert config.overlong_buffer == 4 and config.kl_in_reward


def test_objective_settings_construct():
    config = GRPOConfig(
        num_generations=2, loss_type="cispo", epsilon_low=1.0, epsilon_high=4.0,
        importance_sampling_level="sequence_token",
    )
    assert config.loss_type == "cispo" and config.epsilon_low == 1.0
    config = GRPOConfig(num_generations=2, policy_loss_mode="clip_cov", clip_cov_ratio=1.0, clip_ratio_c=3.0)
    assert (config.clip_cov_ratio, config.clip_cov_lb, config.clip_cov_ub) == (1.0, 1.0, 5.0)
    config = GRPOConfig(num_generations=2, policy_loss_mode="kl_cov")
    assert (config.kl_cov_ratio, config.ppo_kl_coef) == (2e-3, 1.0)
