"""The GRPO variants through a real ``L.Trainer`` on a tiny random Llama: gradient invariance of one optimizer
step under gradient accumulation, the ratio over several passes, and short runs of every loss type, of the GSPO,
CISPO, Clip-Cov and KL-Cov objectives and of dynamic sampling."""

import math

import pytest
import torch

from lightning_grpo import GRPOConfig, GRPOModule
from lightning_grpo.data import PromptDataModule
from support.algorithm import FixedRolloutEngine, Recorder, fixed_completions, quiet_trainer, write_prompts


def by_position(prompts, completions, **kwargs):
    """A reward that differs within every group: [1, 0, 0.5, 0.25, ...] by position in the batch."""
    return [[1.0, 0.0, 0.5, 0.25][i % 4] for i in range(len(completions))]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl")


def _fixed_run(path, root, prompt_file, accumulate, **config):
    config = {"num_generations": 4, "max_new_tokens": 8, **config}
    module = GRPOModule(path, reward_funcs=[by_position], config=GRPOConfig(**config), export_dir="")
    eos = module.tokenizer.eos_token_id
    lengths = [9, 3, 5, 1, 9, 2, 8, 4]  # 9 > 8: truncated (no EOS)
    module.rollout_engine = FixedRolloutEngine(fixed_completions(lengths, 8, eos), eos)
    recorder = Recorder(grads=True)
    trainer = quiet_trainer(root, 1, accumulate_grad_batches=accumulate, callbacks=[recorder])
    trainer.fit(module, datamodule=PromptDataModule(dataset=prompt_file, prompts_per_step=2, val_size=0))
    return recorder


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_one_step_gradient_does_not_depend_on_accumulation(tiny_llama_path, tmp_path, prompt_file, loss_type):
    """Issue item 4: 1 micro-batch of 8 sequences vs accumulate_grad_batches=4 micro-batches of 2 give the same
    gradient at the optimizer step (Lightning's division by 4 is undone, the normalizer is step-global)."""
    config = {"loss_type": loss_type, "mask_truncated_completions": True}  # uneven token counts per micro-batch
    whole = _fixed_run(tiny_llama_path, tmp_path / "one", prompt_file, 1, **config)
    split = _fixed_run(tiny_llama_path, tmp_path / "four", prompt_file, 4, **config)
    assert [len(b) for b in whole.batches] == [8] and [len(b) for b in split.batches] == [2, 2, 2, 2]
    assert whole.batches[0].old_logprobs is None  # on-policy: the current logprobs, detached, are reused
    (g1,), (g4,) = whole.grads, split.grads
    assert g1.keys() == g4.keys() and len(g1) > 0
    largest = max(g.abs().max().item() for g in g1.values())
    assert largest > 1e-4  # a real gradient
    for name in g1:
        torch.testing.assert_close(g4[name], g1[name], atol=1e-5, rtol=0, msg=name)


def test_ratio_is_one_on_the_first_pass_and_drifts_on_the_second(tiny_llama_path, tmp_path, prompt_file):
    recorder = Recorder()
    module = GRPOModule(
        tiny_llama_path, reward_funcs=[by_position], learning_rate=1e-2, export_dir="",
        config=GRPOConfig(num_generations=4, max_new_tokens=8, num_iterations=2, epsilon_low=0.01, epsilon_high=0.01),
    )
    trainer = quiet_trainer(tmp_path, 2, callbacks=[recorder])
    trainer.fit(module, datamodule=PromptDataModule(dataset=prompt_file, prompts_per_step=2, val_size=0))
    first, second = recorder.metrics
    assert recorder.batches[0].on_policy and not recorder.batches[1].on_policy
    assert recorder.batches[1].old_logprobs is not None  # computed once, right after the rollout
    assert first["policy_ratio/min"] == 1.0 and first["policy_ratio/max"] == 1.0
    assert first["clip_ratio/region_mean"] == 0.0
    assert second["policy_ratio/max"] > 1.0 or second["policy_ratio/min"] < 1.0
    assert second["policy_ratio/max"] - second["policy_ratio/min"] > 1e-4
    assert second["clip_ratio/region_mean"] > 0  # with a 1% clip range some tokens leave it


RUNS = {
    "grpo": dict(advantage_estimator="rloo", scale_rewards="none", overlong_buffer=4,
                 reward_scale=2.0, reward_bias=0.5, reward_clip=1.0),
    "bnpo": dict(beta=0.1, kl_in_reward=True, kl_estimator="k1"),
    "token_mean": dict(entropy_coef=0.01, top_entropy_quantile=0.5, clip_ratio_c=3.0),
    "dr_grpo": dict(scale_rewards="none", num_iterations=2, mini_batch_size=4, importance_sampling_cap=2.0, delta=2.0),
}


@pytest.mark.parametrize("loss_type", sorted(RUNS))
def test_three_steps_per_loss_type(tiny_llama_path, tmp_path, prompt_file, loss_type):
    recorder = Recorder()
    module = GRPOModule(
        tiny_llama_path, reward_funcs=[by_position], learning_rate=1e-3, export_dir="",
        config=GRPOConfig(num_generations=4, max_new_tokens=8, loss_type=loss_type, **RUNS[loss_type]),
    )
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    trainer = quiet_trainer(tmp_path, 3, callbacks=[recorder])
    trainer.fit(module, datamodule=PromptDataModule(dataset=prompt_file, prompts_per_step=2, val_size=0))
    assert trainer.global_step == 3 and len(recorder.metrics) == 3
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in recorder.metrics)
    assert any(not torch.equal(before[k], v) for k, v in module.policy.state_dict().items())
    first = recorder.metrics[0]
    assert first["policy_ratio/min"] == first["policy_ratio/max"] == 1.0
    if loss_type == "grpo":
        assert all(-1.0 <= m["rewards/overlong_penalty/mean"] <= 0.0 for m in recorder.metrics)
        assert all(-1.0 <= m["reward_shaped"] <= 1.0 for m in recorder.metrics)  # clipped to +-1
    if loss_type == "bnpo":
        assert first["kl"] == 0.0  # policy == reference before the first step
        assert recorder.metrics[2]["kl"] != 0.0 and recorder.metrics[2]["rewards/kl_penalty/mean"] != 0.0
    if loss_type == "token_mean":
        assert all(0.3 <= m["entropy/trained_token_frac"] <= 0.7 for m in recorder.metrics)
        assert "clip_ratio/dual_mean" in first
    if loss_type == "dr_grpo":  # the HF engine reports no sampler logprobs: weight 1 exactly
        assert all(m[f"sampling/importance_sampling_ratio/{s}"] == 1.0 for m in recorder.metrics
                   for s in ("min", "mean", "max"))
        assert recorder.metrics[1]["policy_ratio/max"] != 1.0  # second mini-batch: after one update


def test_three_steps_of_dapo_with_dynamic_sampling(tiny_llama_path, tmp_path, prompt_file):
    def parity(prompts, completions, answer, **kwargs):
        """1, 0, 1, 0 in the groups of even answers; all 0 (uninformative) for odd answers."""
        return [float(int(a) % 2 == 0 and i % 2 == 0) for i, a in enumerate(answer)]

    def length(prompts, completions, **kwargs):
        return [0.01 * len(c) for c in completions]  # varies everywhere: the filter must not look at it

    recorder = Recorder()
    module = GRPOModule(
        tiny_llama_path, reward_funcs=[parity, length], learning_rate=1e-3, export_dir="",
        config=GRPOConfig(num_generations=4, max_new_tokens=8, loss_type="dapo", epsilon_high=0.28,
                          dynamic_sampling=True, max_num_gen_batches=4, primary_reward="parity"),
    )
    trainer = quiet_trainer(tmp_path, 3, callbacks=[recorder])
    trainer.fit(module, datamodule=PromptDataModule(dataset=prompt_file, prompts_per_step=2, val_size=0))
    assert trainer.global_step == 3
    assert all(len(b) == 8 for b in recorder.batches)  # always prompts_per_step * G sequences
    generated = 0
    for m in recorder.metrics:
        gen, dropped, surplus, filled = (m[f"dynamic_sampling/{k}"] for k in
                                         ("gen_batches", "dropped_groups", "surplus_groups", "filled_groups"))
        assert 2 * gen == 2 + dropped + surplus  # every generated group is trained on, dropped or surplus
        assert m["rewards/parity/mean"] == pytest.approx(0.5 * (2 - filled) / 2)
        generated += gen
    assert generated > 3  # some rollouts needed more than one prompt batch (8 of the 16 answers are odd)


OBJECTIVES = {
    "cispo": dict(loss_type="cispo", epsilon_low=1.0, epsilon_high=4.0),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", epsilon_low=3e-4, epsilon_high=4e-4),
    "gspo_token": dict(loss_type="grpo", importance_sampling_level="sequence_token", epsilon_low=3e-4,
                       epsilon_high=4e-4),
    "kl_cov": dict(loss_type="dapo", policy_loss_mode="kl_cov", kl_cov_ratio=0.2),
}


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_one_step_gradient_of_the_objectives_does_not_depend_on_accumulation(tiny_llama_path, tmp_path,
                                                                              prompt_file, name):
    """GSPO, GSPO-token, CISPO and (on-policy, where |log r| = 0 adds no gradient) KL-Cov: 1 micro-batch vs 4."""
    config = {**OBJECTIVES[name], "mask_truncated_completions": True}
    (g1,) = _fixed_run(tiny_llama_path, tmp_path / "one", prompt_file, 1, **config).grads
    (g4,) = _fixed_run(tiny_llama_path, tmp_path / "four", prompt_file, 4, **config).grads
    assert g1.keys() == g4.keys() and max(g.abs().max().item() for g in g1.values()) > 1e-4
    for key in g1:
        torch.testing.assert_close(g4[key], g1[key], atol=1e-5, rtol=0, msg=key)


@pytest.mark.parametrize("name", sorted(OBJECTIVES) + ["clip_cov"])
def test_two_passes_per_objective(tiny_llama_path, tmp_path, prompt_file, name):
    settings = OBJECTIVES.get(name, dict(policy_loss_mode="clip_cov", clip_cov_ratio=0.2, clip_cov_lb=-1e9))
    recorder = Recorder()
    module = GRPOModule(
        tiny_llama_path, reward_funcs=[by_position], learning_rate=1e-2, export_dir="",
        config=GRPOConfig(num_generations=4, max_new_tokens=8, num_iterations=2, **settings),
    )
    before = {k: v.clone() for k, v in module.policy.state_dict().items()}
    trainer = quiet_trainer(tmp_path, 2, callbacks=[recorder])
    trainer.fit(module, datamodule=PromptDataModule(dataset=prompt_file, prompts_per_step=2, val_size=0))
    first, second = recorder.metrics
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in recorder.metrics)
    assert any(not torch.equal(before[k], v) for k, v in module.policy.state_dict().items())
    assert first["policy_ratio/min"] == first["policy_ratio/max"] == 1.0
    assert second["policy_ratio/max"] - second["policy_ratio/min"] > 1e-4  # the second pass is off-policy
    if name.startswith("gspo"):  # sequence ratios leave [1 - 3e-4, 1 + 4e-4] after one update at lr 1e-2
        assert second["clip_ratio/region_mean"] > 0
