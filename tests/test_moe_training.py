"""Mixture-of-experts policies trained by ``GRPOModule`` in one process (issue 43): a GRPO step of each tiny family
(Qwen3-MoE, OLMoE, Mixtral) with the HF engine recording the routing it replays (R3), the load-balancing loss and the
diagnostics; accumulation changes no gradient under "R3" and "R2" with the load-balancing loss; LoRA on an MoE policy
adapts the attention and its KL reference routes by itself. The FSDP2 run is in tests/strategies/test_fsdp.py."""

import math

import pytest
import torch
from peft import LoraConfig

from lightning_grpo import GRPOConfig, GRPOModule
from lightning_grpo.config import EngineConfig
from lightning_grpo.data import PromptDataModule
from lightning_grpo.models.hf_weights import hf_weights
from lightning_grpo.training.logprobs import CompletionLogprobs
from support.algorithm import FixedRolloutEngine, Recorder, fixed_completions, quiet_trainer, write_prompts
from support.moe import RoutedEngine

FAMILY_FIXTURES = {"qwen3_moe": "tiny_qwen3_moe_path", "olmoe": "tiny_olmoe_path", "mixtral": "tiny_mixtral_path"}
EXPERTS = {"qwen3_moe": 8, "olmoe": 4, "mixtral": 4}


def by_position(prompts, completions, **kwargs):
    return [[1.0, 0.0, 0.5, 0.25][i % 4] for i in range(len(completions))]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl")


def _fit(module, root, prompt_file, steps=1, accumulate=1, callbacks=()):
    recorder = Recorder(grads=True)
    trainer = quiet_trainer(root, steps, accumulate_grad_batches=accumulate, callbacks=[recorder, *callbacks])
    trainer.fit(module, datamodule=PromptDataModule(dataset=prompt_file, prompts_per_step=2, val_size=0))
    return recorder


@pytest.mark.parametrize("family", sorted(FAMILY_FIXTURES))
def test_a_grpo_step_with_the_hf_engine_replays_its_routing(request, tmp_path, prompt_file, family):
    """One step: the rollout carries each token's experts (-1 at pads), the training forward replays them (the HF
    engine's float32 routing is the trainer's own: no router disagrees), every router gets a gradient, and the
    diagnostics and the load-balancing loss are logged."""
    path = request.getfixturevalue(FAMILY_FIXTURES[family])
    config = GRPOConfig(num_generations=2, max_new_tokens=6, routing_replay="R3", routing_replay_diagnostics=True,
                        router_aux_loss_coef=0.01, engine=EngineConfig(name="hf"))
    module = GRPOModule(path, reward_funcs=[by_position], config=config, learning_rate=1e-3, export_dir="")
    recorder = _fit(module, tmp_path, prompt_file)
    (batch,) = recorder.batches
    assert batch.prompt_routed_experts.shape == (*batch.prompt_ids.shape, 2, 2)
    assert batch.completion_routed_experts.shape == (*batch.completion_ids.shape, 2, 2)
    assert (batch.prompt_routed_experts[~batch.prompt_mask.bool()] == -1).all()
    assert (batch.prompt_routed_experts[batch.prompt_mask.bool()] >= 0).all()
    assert int(batch.completion_routed_experts.max()) < EXPERTS[family]
    (metrics,) = recorder.metrics
    # float32 KV-cached decoding vs the packed forward: equal routing up to a near-tie (none at this seed)
    assert metrics["sampling/router_disagreement"] <= 0.01
    assert metrics["sampling/without_replay/router_disagreement"] <= 0.01
    assert 1.0 < metrics["aux_loss"] < EXPERTS[family] * 2  # E * sum_e f_e P_e: k = 2 when perfectly balanced
    gates = [g for n, g in recorder.grads[0].items() if n.endswith("mlp.gate.weight")]
    assert len(gates) == 2 and all(g.abs().sum() > 0 for g in gates)


@pytest.mark.parametrize("mode", ["R3", "R2"])
def test_accumulation_does_not_change_the_gradient_under_replay_and_the_aux_loss(tiny_qwen3_moe_path, tmp_path,
                                                                                 prompt_file, mode):
    """Two optimizer steps on the same fixed rollout (``num_iterations=2``: the second is off-policy, so "R2" replays
    the old pass's routing there) with ``accumulate_grad_batches`` 1 and 4: the same gradients (1e-5), the routers'
    included."""
    grads, metrics = [], []
    for accumulate in (1, 4):
        config = GRPOConfig(num_generations=4, max_new_tokens=8, num_iterations=2, routing_replay=mode,
                            router_aux_loss_coef=0.05, routing_replay_diagnostics=mode == "R3")
        module = GRPOModule(tiny_qwen3_moe_path, reward_funcs=[by_position], config=config, learning_rate=1e-4,
                            export_dir="")
        eos = module.tokenizer.eos_token_id
        ids = fixed_completions([9, 3, 5, 1, 9, 2, 8, 4], 8, eos)
        module.rollout_engine = (RoutedEngine(ids, eos, 2, 2, 8, sampler_logprobs=True) if mode == "R3"
                                 else FixedRolloutEngine(ids, eos))
        recorder = _fit(module, tmp_path / f"{accumulate}", prompt_file, steps=2, accumulate=accumulate)
        grads.append(recorder.grads)
        metrics.append(recorder.metrics)
    for step, (g1, g4) in enumerate(zip(*grads, strict=True)):
        assert g1.keys() == g4.keys() and any(k.endswith("mlp.gate.weight") for k in g1)
        for key in g1:
            torch.testing.assert_close(g4[key], g1[key], atol=1e-5, rtol=0, msg=f"step {step}: {key}")
    for m1, m4 in zip(*metrics, strict=True):
        assert m1["aux_loss"] == pytest.approx(m4["aux_loss"], rel=1e-6)
    if mode == "R3":  # the fixed rollout's experts are not the routers' own
        assert metrics[0][0]["sampling/router_disagreement"] > 0.5
        for key in ("router_disagreement", "k3_kl", "sampling_logp_difference/mean"):
            value = metrics[0][0][f"sampling/without_replay/{key}"]
            assert math.isfinite(value) and value > 0, key
    else:  # R2: the first step trains on the old pass's own routing; the second replays it
        assert metrics[0][0]["sampling/router_disagreement"] == 0.0


def test_lora_on_a_moe_policy_trains_its_adapters_under_replay_and_its_reference_routes_by_itself(
        tiny_qwen3_moe_path, tmp_path, prompt_file):
    """``target_modules="all-linear"``: PEFT adapts the attention projections and, as parameters
    (``target_parameters``), the fused experts and the router; one R3 step with the HF engine trains every adapter, the
    router's included (its logits, hence its mixing weights, change; the replayed selection does not); the KL
    reference (the policy with its adapters off) scores without replay: its logprobs are the base model's own. An
    engine with its own weights cannot be synced such adapters (refused, not streamed unmerged)."""
    config = GRPOConfig(num_generations=4, max_new_tokens=8, routing_replay="R3", beta=0.1)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    module = GRPOModule(tiny_qwen3_moe_path, reward_funcs=[by_position], config=config, learning_rate=1e-3,
                        export_dir="", lora=lora)
    adapted = {n.split(".")[-1] for n, m in module.policy.named_modules() if hasattr(m, "lora_A")}
    assert adapted >= {"q_proj", "k_proj", "v_proj", "o_proj", "experts", "gate"}
    with torch.no_grad():  # LoRA's B starts at 0 (no gradient for A): a random B makes every adapter train
        for name, param in module.policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.1)
    eos = module.tokenizer.eos_token_id
    module.rollout_engine = RoutedEngine(fixed_completions([9, 3, 5, 1, 9, 2, 8, 4], 8, eos), eos, 2, 2, 8)
    recorder = _fit(module, tmp_path, prompt_file)
    (batch,) = recorder.batches
    trained = {n for n, g in recorder.grads[0].items() if g.abs().sum() > 0}
    assert all("lora_" in n for n in trained)
    assert any(".mlp.gate.lora_A" in n for n in trained) and any(".mlp.experts." in n for n in trained)
    base = module.policy.get_base_model()
    with torch.no_grad(), module.policy.disable_adapter():
        own, _ = CompletionLogprobs(GRPOConfig())(base, batch)
        replayed, _ = module.logprobs(base, batch)
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(batch.ref_logprobs[mask], own[mask], atol=1e-5, rtol=0)
    assert (replayed - own)[mask].abs().max() > 1e-2  # the policy's forward does replay
    with pytest.raises(NotImplementedError, match=r"LoRA adapts parameters, not linear layers.*mlp\.experts"):
        list(hf_weights(module.policy, tie_word_embeddings=False))
