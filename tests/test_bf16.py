"""bf16 end to end on the CPU (issue 44): ``Trainer(precision="bf16-mixed")`` and ``"bf16-true"`` with each engine,
LoRA, the reward model, and the sampler-trainer mismatch bf16 brings, bounded by what bfloat16's rounding allows.

What runs in which dtype (docs/performance.md, "bf16"): under "bf16-mixed" the policy's weights, gradients and AdamW
state stay float32 and autocast computes the matmuls in bfloat16; under "bf16-true" they are all bfloat16. The HF
engine generates inside the trainer's precision context; the colocated vLLM engine holds its own weights in the
trainer's compute dtype (``engine.dtype="auto"``), the sync casting them; the logprob head accumulates in float32;
the experience's advantages and logprobs stay float32 (the precision plugin's input conversion leaves the loop's
micro-batches alone). Each run trains two steps of one rollout (``num_iterations=2``): the first on-policy (ratio
exactly 1), the second off-policy (ratio != 1: the weights moved).

Tolerances, where float32 tests assert equality (u = 2**-8, bfloat16's unit roundoff: 8 significand bits):

* sampler vs trainer logprobs of a sampled token y (SmolLM2-135M, the two ``..._within_the_rounding_bound`` tests):
  ``|d log p_y| <= 8 u (1 - p_y) max|z|``. A logit change ``dz`` moves ``log p_y`` by ``sum_{v != y} p_v (dz_y -
  dz_v)``, at most ``2 (1 - p_y) max|dz|``; each side rounds its logits to bfloat16 (``u |z|`` each) and carries as
  much again from its hidden states (``lightning_grpo.rollout.engines.probe``). Measured: at most 2.1 u (1 - p_y)
  max|z| (max |d| 0.32 nats, mean 0.03 to 0.05, max|z| 44). The mean over tokens is held to a quarter of the bound's
  mean, ``2 u max|z| mean(1 - p_y)``: rounding errors spread over the half-spacing, not at its edge (measured: 0.42 of
  that).
* accumulation and process count (``tests/test_accumulation.py``, ``tests/strategies/test_ddp.py``,
  ``tests/strategies/test_fsdp.py``): :func:`support.bf16.assert_bf16_step`.
"""

from __future__ import annotations

import contextlib
import logging
import math

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_grpo import GRPOConfig, GRPOModule
from lightning_grpo.config import EngineConfig
from lightning_grpo.data import PromptDataModule
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.rollout.engines.hf import HFRolloutEngine
from lightning_grpo.rollout.engines.probe import sync_check_tolerance
from lightning_grpo.training.experience import Experience
from support.algorithm import Recorder, quiet_trainer, write_prompts
from support.bf16 import U

PRECISIONS = ["bf16-mixed", "bf16-true"]
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}
#: the tiny Llamas' largest probe logit is 0.88: sync_check_tolerance(bfloat16, 1.0) = 0.03125
TINY_SYNC_CHECK = sync_check_tolerance(torch.bfloat16, 1.0)


def _alternating(prompts, completions, **kwargs):
    return [float(i % 2 == 0) for i in range(len(completions))]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl")


class Rollouts(Callback):
    """Whether the policy's forward passes during each rollout ran under bf16 autocast, and the engine's state."""

    def __init__(self) -> None:
        self.autocast: list[bool] = []
        self.engine: list[tuple] = []

    def on_train_start(self, trainer, module):
        def hook(layer, args):
            if not torch.is_grad_enabled():  # the rollout and the logprob passes: no grad
                self.autocast.append(torch.is_autocast_enabled("cpu"))

        module.hf_model.get_output_embeddings().register_forward_pre_hook(hook)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        engine = module.rollout.own_engine
        self.engine.append((getattr(engine, "dtype", None), getattr(engine, "last_sync_check", None)))


def _two_steps(path, root, prompt_file, precision, engine="hf", lora=None, given=None):
    config = GRPOConfig(num_generations=4, max_new_tokens=8, num_iterations=2, max_prompt_length=128,
                        engine=EngineConfig(name=engine, kv_cache_space_gib=0.25,
                                            weight_sync_check=None if engine == "hf" else TINY_SYNC_CHECK))
    module = GRPOModule(path, reward_funcs=[_alternating], config=config, learning_rate=1e-2, export_dir="", lora=lora)
    if given is not None:
        module.rollout_engine = given
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}
    recorder, rollouts = Recorder(), Rollouts()
    trainer = quiet_trainer(root, 2, precision=precision, callbacks=[recorder, rollouts])
    trainer.fit(module, datamodule=PromptDataModule(dataset=prompt_file, prompts_per_step=2, val_size=0))
    assert trainer.global_step == 2
    return module, trainer, recorder, rollouts, before


def _assert_trained_in(precision, module, trainer, recorder, before):
    """Finite losses; the weights and AdamW's moments in the precision's dtype; the experience in float32; step 1
    on-policy (ratio exactly 1), step 2 not; the trained weights moved."""
    dtype = torch.float32 if precision == "bf16-mixed" else torch.bfloat16
    trained = [p for p in module.policy.parameters() if p.requires_grad]
    assert {p.dtype for p in trained} == {dtype}
    states = trainer.optimizers[0].state
    assert {v.dtype for p in trained for k, v in states[p].items() if k != "step"} == {dtype}
    for metrics in recorder.metrics:
        assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])
    first, second = recorder.metrics
    assert first["policy_ratio/min"] == first["policy_ratio/max"] == 1.0
    assert second["policy_ratio/min"] < 1.0 < second["policy_ratio/max"]
    for batch in recorder.batches:
        floats = [batch.advantages, batch.old_logprobs, batch.sampler_logprobs]
        assert all(t.dtype == torch.float32 for t in floats if t is not None)
        assert batch.old_logprobs is not None
    moved = [n for n, p in module.policy.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert moved and len(moved) == len(before)


@pytest.mark.parametrize("precision,lora", [("bf16-mixed", None), ("bf16-true", None), ("bf16-mixed", LORA)],
                         ids=["bf16-mixed", "bf16-true", "bf16-mixed-lora"])
def test_two_bf16_steps_with_the_hf_engine(tiny_llama_path, tmp_path, prompt_file, precision, lora):
    """The HF engine generates with the policy itself inside the trainer's precision context: under "bf16-mixed" the
    rollout's forward passes run under bf16 autocast (so it samples what the trainer scores), under "bf16-true" on
    the bfloat16 weights (no autocast)."""
    module, trainer, recorder, rollouts, before = _two_steps(tiny_llama_path, tmp_path, prompt_file, precision,
                                                             lora=lora)
    _assert_trained_in(precision, module, trainer, recorder, before)
    assert rollouts.autocast and set(rollouts.autocast) == {precision == "bf16-mixed"}


@pytest.mark.engine
@pytest.mark.parametrize("precision,lora", [("bf16-mixed", None), ("bf16-true", LORA)], ids=["bf16-mixed",
                                                                                              "bf16-true-lora"])
def test_two_bf16_steps_with_colocated_vllm_synced_in_bf16(tiny_llama_path, tmp_path, prompt_file, precision, lora,
                                                           vllm_engine):
    """A bfloat16 colocated engine (the pooled one: what ``engine.dtype="auto"`` makes for a bf16 trainer,
    ``tests/rollout/test_registry.py``), every sync casting the policy's (merged) weights into it, and the post-sync
    check passing at the derived bf16 tolerance with a difference it really measured (bfloat16 rounding: not 0)."""
    given = vllm_engine(tiny_llama_path, reload=False, dtype="bfloat16")
    given.weight_sync_check = TINY_SYNC_CHECK  # the pooled engine checks nothing by default
    try:
        module, trainer, recorder, rollouts, before = _two_steps(tiny_llama_path, tmp_path, prompt_file, precision,
                                                                 engine="vllm", lora=lora, given=given)
    finally:
        given.weight_sync_check = None
    _assert_trained_in(precision, module, trainer, recorder, before)
    for dtype, check in rollouts.engine:
        assert dtype == torch.bfloat16 and 0 < check <= TINY_SYNC_CHECK
    for metrics in recorder.metrics:  # the mismatch metrics of the bf16 sampler: measured, within the bound
        assert 0 < metrics["sampling/sampling_logp_difference/mean"] <= 2 * U
        assert math.exp(-8 * U) <= metrics["sampling/mismatch_ratio/min"] <= metrics["sampling/mismatch_ratio/max"]
        assert metrics["sampling/mismatch_ratio/max"] <= math.exp(8 * U)


def test_bf16_true_warns_that_a_small_learning_rate_is_rounded_away(tiny_llama_path, tmp_path, prompt_file, caplog):
    """bfloat16 weights cannot take an AdamW step of 1e-6 (half their spacing is larger on 98 % of the tiny Llama's
    weights): "bf16-true" says so and names "bf16-mixed"; float32 weights under "bf16-mixed" take it silently."""
    for precision in PRECISIONS:
        module = GRPOModule(tiny_llama_path, reward_funcs=[_alternating], export_dir="", learning_rate=1e-6,
                            config=GRPOConfig(num_generations=2, max_new_tokens=2))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lightning_grpo.training.optim"):
            quiet_trainer(tmp_path / precision, 1, precision=precision).fit(
                module, datamodule=PromptDataModule(dataset=prompt_file, prompts_per_step=1, val_size=0))
        warned = [r.getMessage() for r in caplog.records if "rounded away" in r.getMessage()]
        if precision == "bf16-true":
            assert len(warned) == 1 and "98.1 %" in warned[0] and "bf16-mixed" in warned[0], warned
        else:
            assert not warned


def test_a_reward_model_scores_in_the_trainers_compute_dtype(tiny_llama_path, tiny_reward_model_path, tmp_path,
                                                              prompt_file):
    """A reward model given by its folder loads in the dtype the trainer computes in ("auto"): bfloat16 here."""
    module = GRPOModule(tiny_llama_path, reward_funcs=[tiny_reward_model_path, _alternating], export_dir="",
                        config=GRPOConfig(num_generations=2, max_new_tokens=4))
    recorder = Recorder()
    quiet_trainer(tmp_path, 1, precision="bf16-mixed", callbacks=[recorder]).fit(
        module, datamodule=PromptDataModule(dataset=prompt_file, prompts_per_step=1, val_size=0))
    (reward_model,) = module.rewards.pooled.values()
    model, _ = reward_model.load()
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert math.isfinite(recorder.metrics[0]["loss"])


# ------------------------------------------------------------------------------------- the mismatch, bounded
def _context(precision):
    if precision == "bf16-mixed":
        return lambda: torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)
    return contextlib.nullcontext


def _trainer_side(path, precision):
    module = GRPOModule(path, reward_funcs=[_alternating], export_dir="", config=GRPOConfig(max_new_tokens=24))
    if precision == "bf16-true":
        module.policy.to(torch.bfloat16)
    return module


@torch.no_grad()
def _assert_within_the_bound(module, precision, out):
    """The trainer's logprobs (``GRPOModule.completion_logprobs``: the chunked head, in the precision's context) of
    the sampled tokens against the sampler's: per token within ``8 u (1 - p_y) max|z|``, on average within a quarter
    of that (the module docstring); and the mismatch is real (bfloat16: not 0)."""
    batch = Experience(prompt_ids=out.prompt_ids, prompt_mask=out.prompt_mask, completion_ids=out.completion_ids,
                       completion_mask=out.completion_mask, advantages=torch.zeros(len(out.completion_ids)))
    top = 0.0  # the largest |logit| at the scored positions
    with _context(precision)():
        ours, _ = module.completion_logprobs(module.policy, batch)
        for row in range(len(batch)):
            prompt = out.prompt_ids[row][out.prompt_mask[row].bool()]
            completion = out.completion_ids[row, : int(out.completion_mask[row].sum())]
            logits = module.policy(input_ids=torch.cat([prompt, completion])[None]).logits[0, len(prompt) - 1 : -1]
            top = max(top, float(logits.float().abs().max()))
    scored = out.completion_mask.bool()
    diff = (out.sampler_logprobs - ours)[scored].abs()
    headroom = 1 - ours[scored].exp()  # 1 - p_y
    assert (diff <= 8 * U * headroom * top).all(), float((diff / (U * headroom * top)).max())
    assert diff.mean() <= 2 * U * top * headroom.mean()
    assert diff.max() > 1e-3


@pytest.mark.slow
@pytest.mark.engine
def test_bf16_vllm_sampler_logprobs_within_the_rounding_bound(smollm2_path, vllm_engine):
    """A bfloat16 vLLM engine's logprobs of what it sampled from SmolLM2, against the trainer's in both precisions."""
    engine = vllm_engine(smollm2_path, dtype="bfloat16")
    tokenizer = engine.tokenizer
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             return_dict=False) for q in ("What is 7 times 6?", "Name a prime.")]
    out = engine.generate(prompts, 4, SamplingConfig(max_new_tokens=24, seed=3))
    for precision in PRECISIONS:
        _assert_within_the_bound(_trainer_side(smollm2_path, precision), precision, out)


@pytest.mark.slow
@pytest.mark.parametrize("precision", PRECISIONS)
def test_bf16_hf_sampler_logprobs_within_the_rounding_bound(smollm2_path, precision):
    """The HF engine's logprobs (KV-cache decoding) of what it sampled, in the trainer's precision context, against
    the trainer's full forward of the same rows."""
    module = _trainer_side(smollm2_path, precision)
    engine = HFRolloutEngine(module.policy, module.tokenizer, report_logprobs=True,
                             forward_context=_context(precision))
    prompts = [module.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                    return_dict=False) for q in ("What is 7 times 6?", "Name a prime.")]
    torch.manual_seed(3)
    _assert_within_the_bound(module, precision, engine.generate(prompts, 4, SamplingConfig(max_new_tokens=24)))
