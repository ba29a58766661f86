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
