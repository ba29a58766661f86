"""Accumulation changes memory, not the gradient, for every GRPOConfig knob that changes the loss (issue 12 item 3).

The same fixed rollout (8 sequences of uneven lengths, some truncated) is trained for two optimizer steps
(``num_iterations=2``: the second step is off-policy, so clipping, dual clip, delta and the KL act) with
``accumulate_grad_batches=1`` and ``=4``; both steps' gradients must agree to 1e-5. The sampler logprobs differ
from the trainer's by fixed offsets, so the truncated importance weights are not 1.

Knobs that change the loss or which tokens get it, each listed below: ``loss_type`` (all six), ``scale_rewards``,
``advantage_estimator``, ``advantage_std_floor``, ``reward_scale``/``reward_bias``/``reward_clip``,
``overlong_buffer``/``overlong_penalty_factor``, ``mask_truncated_completions``, ``epsilon_low``/``epsilon_high``,
``clip_ratio_c``, ``delta``, ``beta`` with each ``kl_estimator``, ``kl_in_reward``, ``entropy_coef``,
``top_entropy_quantile``, ``importance_sampling_cap`` with each ``rollout_importance_sampling_level`` and
``importance_sampling_mode``, ``importance_sampling_level`` (GSPO, GSPO-token), ``policy_loss_mode`` (Clip-Cov,
KL-Cov), ``temperature``, ``top_k``/``top_p``/``min_p`` (the trainer scores the truncated distribution),
``padding_free``/``shared_prefix`` (the forward layout); the rollout correction of issue 33 (the two-sided and
geometric importance weights, IcePop, the geometric-mean, KL-estimate and off-policy masks, bypass mode) and on-policy
distillation (a teacher model's per-token reverse KL as the advantage), each of whose masks is checked to act.

Multi-turn episodes (issue 21): the same check on episodes of a scripted environment (every finished turn gets an
observation, the second ends the episode), whose environment tokens are context without loss, for every
``loss_type`` and the knobs that read token statistics.
"""

import dataclasses

import pytest
import torch

from lightning_grpo import GRPOConfig, GRPOModule
from lightning_grpo.config import CorrectionConfig, DistillationConfig, EpisodeConfig
from lightning_grpo.data import PromptDataModule
from lightning_grpo.training.experience import Experience
from support.algorithm import FixedRolloutEngine, Recorder, fixed_completions, quiet_trainer, write_prompts
from support.episodes import EchoEnvironment

#: stands for the teacher model of the distillation knobs (the tied tiny Llama: the student's tokenizer, other weights)
TEACHER = "<tiny tied llama>"

KNOBS = {
    "grpo": dict(loss_type="grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "token_mean": dict(loss_type="token_mean"),
    "dapo": dict(loss_type="dapo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "cispo": dict(loss_type="cispo", epsilon_low=1.0, epsilon_high=0.02),
    "scale_rewards_batch": dict(scale_rewards="batch"),
    "scale_rewards_none": dict(scale_rewards="none"),
    "rloo": dict(advantage_estimator="rloo"),
    "std_floor": dict(advantage_std_floor=0.4),
    "reward_transform": dict(reward_scale=2.0, reward_bias=-0.5, reward_clip=0.8),
    "overlong": dict(overlong_buffer=4, overlong_penalty_factor=1.0),
    "clip_higher": dict(epsilon_low=0.005, epsilon_high=0.02),
    "dual_clip": dict(epsilon_low=0.005, epsilon_high=0.005, clip_ratio_c=1.01),
    "delta": dict(epsilon_low=0.005, epsilon_high=0.005, delta=1.01),
    "kl_k1": dict(beta=0.5, kl_estimator="k1"),
    "kl_k2": dict(beta=0.5, kl_estimator="k2"),
    "kl_k3": dict(beta=0.5, kl_estimator="k3"),
    "kl_in_reward": dict(beta=0.5, kl_in_reward=True),
    "entropy_bonus": dict(entropy_coef=0.1),
    "top_entropy_quantile": dict(top_entropy_quantile=0.5),
    "top_entropy_quantile_dapo": dict(top_entropy_quantile=0.3, loss_type="dapo"),
    "tis_token_truncate": dict(importance_sampling_cap=1.02),
    "tis_sequence_mask": dict(importance_sampling_cap=1.1, rollout_importance_sampling_level="sequence",
                              importance_sampling_mode="mask"),
    "gspo": dict(importance_sampling_level="sequence", epsilon_low=3e-4, epsilon_high=4e-4),
    "gspo_token": dict(importance_sampling_level="sequence_token", epsilon_low=3e-4, epsilon_high=4e-4),
    "clip_cov": dict(policy_loss_mode="clip_cov", clip_cov_ratio=0.2, clip_cov_lb=-1e9, clip_cov_ub=1e9),
    "kl_cov": dict(policy_loss_mode="kl_cov", kl_cov_ratio=0.2, loss_type="dapo"),
    "temperature": dict(temperature=0.7),
    "truncated_sampling": dict(top_k=50, top_p=0.9, min_p=0.01),
    "padded_forward": dict(padding_free=False),
    "packed_forward": dict(shared_prefix=False),
    # issue 33: the rollout correction and on-policy distillation
    "icepop": dict(importance_sampling_cap=1.04, importance_sampling_min=0.96, importance_sampling_mode="mask"),
    "tis_two_sided": dict(importance_sampling_cap=1.02, importance_sampling_min=0.98),
    "tis_geometric": dict(importance_sampling_cap=1.01, rollout_importance_sampling_level="geometric"),
    "geo_mask": dict(correction=CorrectionConfig(geo_mask_low=0.99, geo_mask_high=1.01)),
    "kl_mask_k3": dict(correction=CorrectionConfig(kl_mask_threshold=1e-3)),
    "kl_mask_k2_token": dict(correction=CorrectionConfig(kl_mask_threshold=1e-3, kl_mask_estimator="k2",
                                                         kl_mask_aggregation="token")),
    "kl_mask_k1_seq_sum": dict(correction=CorrectionConfig(kl_mask_threshold=0.05, kl_mask_estimator="k1",
                                                           kl_mask_aggregation="seq_sum")),
    "off_policy_mask": dict(correction=CorrectionConfig(off_policy_mask_threshold=0.0)),
    "bypass": dict(correction=CorrectionConfig(bypass_mode=True)),
    "bypass_gspo_geo_mask": dict(importance_sampling_level="sequence",
                                 correction=CorrectionConfig(bypass_mode=True, geo_mask_low=0.99, geo_mask_high=1.01)),
    "distillation": dict(distillation=DistillationConfig(teacher=TEACHER)),
    "distillation_mixed_cispo": dict(loss_type="cispo", epsilon_low=1.0, epsilon_high=0.02,
                                     distillation=DistillationConfig(teacher=TEACHER, reward_weight=1.0, coef=0.5)),
}
#: knob -> the ``sampling/masked_fraction/<name>`` that must be strictly between 0 and 1 at every step (the mask acts)
MASKING = {"icepop": "importance_sampling", "geo_mask": "geometric", "kl_mask_k3": "kl", "kl_mask_k2_token": "kl",
           "kl_mask_k1_seq_sum": "kl", "off_policy_mask": "off_policy", "bypass_gspo_geo_mask": "geometric"}


class OffsetSampler(FixedRolloutEngine):
    """Fixed completions whose sampler logprobs are the policy's own plus fixed offsets (an engine whose numerics
    differ from the trainer's), so the truncated importance weights are near 1 but not 1."""

    def __init__(self, module, completion_ids, eos_id, offsets):
        super().__init__(completion_ids, eos_id)
        self.module, self.offsets = module, offsets

    def generate(self, prompt_ids, num_generations, sampling):
        out = super().generate(prompt_ids, num_generations, sampling)
        batch = Experience(prompt_ids=out.prompt_ids, prompt_mask=out.prompt_mask, completion_ids=out.completion_ids,
                           completion_mask=out.completion_mask, advantages=torch.zeros(len(out.completion_ids)))
        with torch.no_grad():
            logprobs, _ = self.module.completion_logprobs(self.module.policy, batch)
        offsets = self.offsets[: logprobs.shape[0], : logprobs.shape[1]]
        out.sampler_logprobs = torch.where(out.completion_mask.bool(), logprobs + offsets, 0.0)
        return out


def by_position(prompts, completions, **kwargs):
    return [[1.0, 0.0, 0.5, 0.25][i % 4] for i in range(len(completions))]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl")


def _two_steps(path, root, prompt_file, accumulate, knobs, multiturn=False, teacher=None, precision="32-true"):
    knobs = dict(knobs)
    if "distillation" in knobs:  # the teacher fixture's folder for the placeholder
        knobs["distillation"] = dataclasses.replace(knobs["distillation"], teacher=teacher)
    config = GRPOConfig(num_generations=4, max_new_tokens=8, num_iterations=2, mask_truncated_completions=True,
                        episode=EpisodeConfig(max_tokens=40), **knobs)
    module = GRPOModule(path, reward_funcs=[by_position], config=config, learning_rate=1e-4, export_dir="",
                        environment_factory=(lambda: EchoEnvironment(turns=2)) if multiturn else None)
    eos = module.tokenizer.eos_token_id
    lengths = [9, 3, 5, 1, 9, 2, 8, 4]  # 9 > 8: truncated (no EOS)
    offsets = 0.05 * torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    module.rollout_engine = OffsetSampler(module, fixed_completions(lengths, 8, eos), eos, offsets)
    recorder = Recorder(grads=True)
    trainer = quiet_trainer(root, 2, accumulate_grad_batches=accumulate, callbacks=[recorder], precision=precision)
    trainer.fit(module, datamodule=PromptDataModule(dataset=prompt_file, prompts_per_step=2, val_size=0))
    return recorder


def _assert_the_mask_acts(name, recorder):
    if name in MASKING:
        for step, metrics in enumerate(recorder.metrics):
            assert 0 < metrics[f"sampling/masked_fraction/{MASKING[name]}"] < 1, (name, step)


@pytest.mark.parametrize("name", sorted(KNOBS))
def test_gradient_does_not_depend_on_accumulation(tiny_llama_path, tiny_tied_llama_path, tmp_path, prompt_file, name):
    whole = _two_steps(tiny_llama_path, tmp_path / "one", prompt_file, 1, KNOBS[name], teacher=tiny_tied_llama_path)
    split = _two_steps(tiny_llama_path, tmp_path / "four", prompt_file, 4, KNOBS[name], teacher=tiny_tied_llama_path)
    assert [len(b) for b in whole.batches] == [8, 8] and [len(b) for b in split.batches] == [2] * 8
    assert len(whole.grads) == len(split.grads) == 2
    for step, (g1, g4) in enumerate(zip(whole.grads, split.grads, strict=True)):
        assert g1.keys() == g4.keys() and max(g.abs().max().item() for g in g1.values()) > 1e-5, step
        for key in g1:
            torch.testing.assert_close(g4[key], g1[key], atol=1e-5, rtol=0, msg=f"step {step}: {key}")
    _assert_the_mask_acts(name, whole)
    _assert_the_mask_acts(name, split)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
@pytest.mark.parametrize("name", ["grpo", "icepop"])
def test_bf16_gradient_depends_on_accumulation_only_by_bf16_rounding(tiny_llama_path, tmp_path, prompt_file, name,
                                                                    precision):
    """In bfloat16 the 1- and 4-micro-batch gradients agree to ``4 u max|g|`` (u = 2**-8), not 1e-5: a micro-batch of 2
    rows cuts a group's shared-prefix row (4 completions) in two, whose bfloat16 matmuls of another shape round some
    outputs the other way, and under "bf16-true" the micro-batches' gradients are also summed in bfloat16
    (support/bf16.py). Measured: at most 1.2 u max|g| ("bf16-mixed", float32 gradients) and 2.2 u ("bf16-true")."""
    from support.bf16 import U

    whole = _two_steps(tiny_llama_path, tmp_path / "one", prompt_file, 1, KNOBS[name], precision=precision)
    split = _two_steps(tiny_llama_path, tmp_path / "four", prompt_file, 4, KNOBS[name], precision=precision)
    assert [len(b) for b in whole.batches] == [8, 8] and [len(b) for b in split.batches] == [2] * 8
    dtype = torch.float32 if precision == "bf16-mixed" else torch.bfloat16
    for step, (g1, g4) in enumerate(zip(whole.grads, split.grads, strict=True)):
        assert g1.keys() == g4.keys() and {g.dtype for g in g1.values()} == {dtype}, step
        scale = max(g.float().abs().max().item() for g in g1.values())
        for key in g1:
            torch.testing.assert_close(g4[key].float(), g1[key].float(), atol=4 * U * scale, rtol=0,
                                       msg=f"step {step}: {key}")
    _assert_the_mask_acts(name, whole)
    _assert_the_mask_acts(name, split)


MULTITURN_KNOBS = ["grpo", "bnpo", "token_mean", "dapo", "dr_grpo", "cispo", "kl_k3", "kl_in_reward", "entropy_bonus",
                   "top_entropy_quantile", "tis_token_truncate", "gspo", "clip_cov", "kl_cov", "padded_forward",
                   "packed_forward", "icepop", "geo_mask", "kl_mask_k3", "off_policy_mask", "bypass", "distillation"]


@pytest.mark.parametrize("name", MULTITURN_KNOBS)
def test_multiturn_gradient_does_not_depend_on_accumulation(tiny_llama_path, tiny_tied_llama_path, tmp_path,
                                                             prompt_file, name):
    whole = _two_steps(tiny_llama_path, tmp_path / "one", prompt_file, 1, KNOBS[name], multiturn=True,
                       teacher=tiny_tied_llama_path)
    split = _two_steps(tiny_llama_path, tmp_path / "four", prompt_file, 4, KNOBS[name], multiturn=True,
                       teacher=tiny_tied_llama_path)
    assert all(b.env_mask.shape == b.completion_mask.shape for b in whole.batches + split.batches)
    assert sum(int(b.env_mask.sum()) for b in whole.batches) > 0  # episodes with an observation were trained
    for step, (g1, g4) in enumerate(zip(whole.grads, split.grads, strict=True)):
        assert g1.keys() == g4.keys() and max(g.abs().max().item() for g in g1.values()) > 1e-5, step
        for key in g1:
            torch.testing.assert_close(g4[key], g1[key], atol=1e-5, rtol=0, msg=f"step {step}: {key}")
    _assert_the_mask_acts(name, whole)
    _assert_the_mask_acts(name, split)
