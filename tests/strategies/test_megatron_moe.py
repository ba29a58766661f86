"""Mixtures of experts under megatron-core, in this process: the HF <-> megatron-core conversion of Qwen3-MoE and
Mixtral for every expert-parallel layout (bit-exact), logits, logprobs and gradients against transformers at EP=1,
and routing replay (the replayed routing is the recorded one, on its token). The EP=2 / PP=2 runs are in
tests/strategies/test_megatron_experts.py."""

import os

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

from transformers import AutoConfig, AutoModelForCausalLM, OlmoeConfig  # noqa: E402

from lightning_grpo.strategies.megatron import convert, cpu_shims  # noqa: E402
from lightning_grpo.strategies.megatron.experts import ExpertRanks, check_dense_layout, moe_settings  # noqa: E402
from lightning_grpo.strategies.megatron.model import Architecture, transformer_config  # noqa: E402
from support.megatron_moe import experience, hf_routing, save_tiny_moe  # noqa: E402


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("megatron_moe")
    return {"qwen3_moe": save_tiny_moe(str(root / "qwen3_moe"), smollm2_path, "qwen3_moe", num_hidden_layers=3,
                                       mlp_only_layers=(1,)),
            "mixtral": save_tiny_moe(str(root / "mixtral"), smollm2_path, "mixtral")}


@pytest.fixture(scope="module")
def model_parallel():
    """A one-process gloo group with megatron-core's parallel state (TP = PP = EP = 1) and the CPU shim."""
    from megatron.core import parallel_state

    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT")}
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(_free_port())
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    cpu_shims.apply()
    parallel_state.initialize_model_parallel()
    yield
    parallel_state.destroy_model_parallel()
    cpu_shims.remove()
    torch.distributed.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _policy(path, **overrides):
    from lightning_grpo.strategies.megatron.policy import MegatronPolicy

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return hf, MegatronPolicy.from_hf(hf, replay_routing=True, **overrides)


# ------------------------------------------------------------------------------------------- architecture
def test_moe_architectures_from_qwen3_moe_and_mixtral(moe_models):
    qwen = Architecture.from_hf_config(AutoConfig.from_pretrained(moe_models["qwen3_moe"]))
    assert qwen.qk_layernorm and qwen.moe is not None
    assert (qwen.moe.num_experts, qwen.moe.ffn_hidden_size, qwen.moe.topk, qwen.moe.norm_topk_prob) == (4, 32, 2, True)
    assert qwen.moe.layers == (True, False, True) and qwen.moe.moe_layers == (0, 2) and qwen.ffn_hidden_size == 96
    mixtral = Architecture.from_hf_config(AutoConfig.from_pretrained(moe_models["mixtral"]))
    assert not mixtral.qk_layernorm and mixtral.moe is not None and mixtral.moe.layers == (True, True)
    config = transformer_config(qwen, expert_model_parallel_size=2)
    assert (config.num_moe_experts, config.moe_router_topk, config.moe_ffn_hidden_size) == (4, 2, 32)
    # HF renormalizes the top-k softmax weights (norm_topk_prob): megatron-core's softmax over the top-k logits
    assert config.moe_router_pre_softmax is False and config.moe_router_load_balancing_type == "none"
    assert config.moe_layer_freq == [1, 0, 1] and config.expert_model_parallel_size == 2 and config.qk_layernorm
    unnormalized = AutoConfig.from_pretrained(moe_models["qwen3_moe"])
    unnormalized.norm_topk_prob = False
    assert transformer_config(Architecture.from_hf_config(unnormalized)).moe_router_pre_softmax is True


def test_unsupported_moe_settings_are_named(moe_models):
    from lightning_grpo.strategies.megatron.model import build_gpt_model

    with pytest.raises(ValueError, match=r"config.model_type='olmoe'"):  # q/k norms over all heads at once
        Architecture.from_hf_config(OlmoeConfig())
    mixtral = AutoConfig.from_pretrained(moe_models["mixtral"])
    mixtral.router_jitter_noise = 0.1
    with pytest.raises(ValueError, match=r"config.router_jitter_noise=0.1"):
        Architecture.from_hf_config(mixtral)
    arch = Architecture.from_hf_config(AutoConfig.from_pretrained(moe_models["qwen3_moe"]))
    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=2 with a mixture of experts: .* sequence "
                                         r"parallelism"):
        arch.check_tensor_parallel(2)
    with pytest.raises(ValueError, match=r"num_experts=4 is not divisible by expert_model_parallel_size=3"):
        moe_settings(arch.moe, 3)
    with pytest.raises(ValueError, match=r"inner size 32 is not divisible by expert_tensor_parallel_size=3"):
        moe_settings(arch.moe, 1, 3)
    with pytest.raises(ValueError, match=r"MegatronStrategy\(expert_model_parallel_size=2, "
                                         r"expert_tensor_parallel_size=1\): the model is dense"):
        check_dense_layout(None, 2, 1)
    check_dense_layout(None, 1, 1)
    check_dense_layout(arch.moe, 2, 2)
    assert moe_settings(None, 1, 2) == {}  # megatron-core's expert-TP size defaults to TP: nothing for a dense model
    with pytest.raises(ValueError, match=r"use_transformer_engine=True with a mixture of experts"):
        build_gpt_model(arch, use_transformer_engine=True)


# --------------------------------------------------------------------------------------------- conversion
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("ep,etp", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)])
def test_moe_hf_to_mcore_to_hf_is_bit_exact(moe_models, name, ep, etp):
    hf = AutoModelForCausalLM.from_pretrained(moe_models[name], dtype=torch.float32)
    arch, state = Architecture.from_hf_config(hf.config), hf.state_dict()
    # megatron-core's rank order for the experts: expert-TP rank fastest, then the EP rank
    ranks = [hf_to_mcore_rank(state, arch, ExpertRanks(r // etp, ep, r % etp, etp)) for r in range(ep * etp)]
    back = convert.mcore_to_hf(ranks, arch, expert_model_parallel_size=ep)
    assert sorted(back) == sorted(state)
    assert all(torch.equal(back[k], state[k]) for k in state)
    # golden placement: the last EP rank's first local expert is global expert 4 - 4 / EP; ETP rank 1 holds the
    # second half of its gate rows over the second half of its up rows, and the second half of its down columns
    last = ranks[(ep - 1) * etp + etp - 1]
    expert = 4 - 4 // ep
    gate, up = state["model.layers.0.mlp.experts.gate_up_proj"][expert].chunk(2)
    fc1 = last["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([gate.chunk(etp)[-1], up.chunk(etp)[-1]]))
    fc2 = last["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"]
    assert torch.equal(fc2, state["model.layers.0.mlp.experts.down_proj"][expert].chunk(etp, dim=1)[-1])
    assert len([k for k in last if "layers.0.mlp.experts" in k]) == 2 * 4 // ep
    assert torch.equal(last["decoder.layers.0.mlp.router.weight"], state["model.layers.0.mlp.gate.weight"])


def hf_to_mcore_rank(state, arch, experts):
    return convert.hf_to_mcore(state, arch, experts=experts)


def test_moe_pipeline_stages_hold_each_hf_tensor_once(moe_models):
    hf = AutoModelForCausalLM.from_pretrained(moe_models["qwen3_moe"], dtype=torch.float32)
    arch = Architecture.from_hf_config(hf.config)
    maps = convert.pipeline_param_maps(arch, pp_size=3)
    names = [h for _, pm in maps for h in pm.hf]
    assert sorted(names) == sorted(hf.state_dict())  # untied: lm_head included, each once
    shapes = convert.hf_shapes(arch)
    assert all(shapes[k] == tuple(v.shape) for k, v in hf.state_dict().items())
    owners = {h: owner for owner, pm in maps for h in pm.hf}
    assert owners["model.layers.2.mlp.experts.gate_up_proj"] == 2 and owners["model.layers.1.mlp.up_proj.weight"] == 1
    expert_maps = [pm for _, pm in maps if pm.experts]
    assert [pm.mcore for pm in expert_maps[:2]] == ["decoder.layers.0.mlp.experts.local_experts.{}.linear_fc1.weight",
                                                    "decoder.layers.0.mlp.experts.local_experts.{}.linear_fc2.weight"]


# --------------------------------------------------------------------------------------- a live model, EP=1
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_moe_logits_and_weights_match_transformers(model_parallel, moe_models, name):
    hf, policy = _policy(moe_models[name])
    input_ids = torch.randint(0, hf.config.vocab_size, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(input_ids).logits
        logits = policy(input_ids)
    torch.testing.assert_close(logits, expected, atol=2e-5, rtol=0)
    assert expected.abs().max() > 0.5
    gathered, reference = dict(policy.iter_hf_weights()), hf.state_dict()
    assert sorted(gathered) == sorted(reference) and all(torch.equal(gathered[k], reference[k]) for k in reference)


def test_moe_completion_logprobs_and_gradients_match_the_hf_path(model_parallel, moe_models):
    """The policy's vocab-parallel logprobs of a left-padded batch and the gradients of every weight (the routers'
    and each expert's included) against transformers' padded forward pass."""
    from lightning_grpo.functional import token_logprobs

    hf, policy = _policy(moe_models["qwen3_moe"])
    batch = experience(hf.config.pad_token_id)
    mask = batch.completion_mask.bool()
    input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    attention = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)
    positions = (attention.cumsum(1) - 1).clamp(min=0)
    logits = hf(input_ids=input_ids, attention_mask=attention, position_ids=positions).logits
    t = batch.completion_ids.shape[1]
    expected, _ = token_logprobs(logits[:, -t - 1:-1], batch.completion_ids, 0.7)
    logprobs, _ = policy.completion_logprobs(batch, 0.7)
    torch.testing.assert_close(logprobs[mask], expected[mask], atol=1e-5, rtol=0)
    weights = torch.randn(mask.shape, generator=torch.Generator().manual_seed(2)) * mask
    (expected * weights).sum().backward()
    (logprobs * weights).sum().backward()
    grads = convert.mcore_to_hf([{n: p.grad for n, p in policy.model.named_parameters()}], policy.arch)
    assert hf.model.layers[0].mlp.gate.weight.grad.abs().max() > 1e-3  # the router trains
    for name, param in hf.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, atol=2e-5, rtol=1e-4, msg=name)


# ----------------------------------------------------------------------------------------------- replay
def _chosen(recorded, routing_shape):
    """A router's recorded ``(S B, k)`` choices of one forward as ``(B, S, k)``."""
    b, s = routing_shape[:2]
    return recorded.view(s, b, -1).transpose(0, 1)


def test_replayed_routing_is_the_recorded_one_on_its_token(model_parallel, moe_models):
    """The HF model's routing of a left-padded batch (what a rollout records, prompts of different lengths) is
    replayed by the Megatron policy with negated routers, whose live choice differs: every needed token gets exactly
    its recorded experts; at the unchanged weights the replayed logprobs equal transformers' (the same routing) and
    the live ones; the routers still get a gradient (the weights are the live router's over the replayed experts)."""
    from lightning_grpo.strategies.megatron.pipeline import replayed_routing

    hf, policy = _policy(moe_models["qwen3_moe"])
    plain = experience(hf.config.pad_token_id)
    batch = hf_routing(hf, plain)
    routing = replayed_routing(batch)  # [B, S, moe_layers, k] laid out like the policy's tokens
    assert routing.shape == (3, 9, 2, 2)
    needed = routing[..., 0, 0] >= 0
    assert int(needed.sum()) == 5 + 4 + 3 + 2 + 4 + 3  # each row's prompt and completion
    with torch.no_grad():
        live, _ = policy.completion_logprobs(plain, 1.0)
        replayed, _ = policy.completion_logprobs(batch, 1.0)
    torch.testing.assert_close(replayed, live, atol=1e-6, rtol=0)  # the recorded routing is the live one here
    for _, layer in enumerate(policy.model.decoder.layers):
        if hasattr(layer.mlp, "router"):
            with torch.no_grad():
                layer.mlp.router.weight.neg_()
    lists = policy.replay.record()
    with torch.no_grad():
        policy.completion_logprobs(plain, 1.0)  # live routing of the negated routers
        policy.completion_logprobs(batch, 1.0)  # replayed
    for index, (live_choice, replayed_choice) in enumerate(lists):
        live_choice, replayed_choice = _chosen(live_choice, routing.shape), _chosen(replayed_choice, routing.shape)
        expected = routing[:, :, index]
        assert torch.equal(replayed_choice[needed], expected[needed]), index
        assert not torch.equal(live_choice[needed].sort(-1).values, expected[needed].sort(-1).values)
    logprobs, _ = policy.completion_logprobs(batch, 1.0)
    (logprobs * batch.completion_mask).sum().backward()
    assert policy.model.decoder.layers[0].mlp.router.weight.grad.abs().max() > 1e-4


def test_replay_under_activation_recompute_and_micro_batches_gives_the_same_gradients(model_parallel, moe_models):
    """Two micro-batches through megatron-core's schedule with their own recorded routing (perturbed routers, so
    replay matters), with and without full activation recompute (the recomputed forward in backward replays its own
    micro-batch's routing): the same losses and gradients."""
    from lightning_grpo.strategies.megatron.model import recompute_settings
    from lightning_grpo.strategies.megatron.pipeline import run_schedule

    hf = AutoModelForCausalLM.from_pretrained(moe_models["qwen3_moe"], dtype=torch.float32)
    batches = [hf_routing(hf, experience(hf.config.pad_token_id, seed=s)) for s in (0, 1)]
    results = []
    for recompute in (False, True):
        _, policy = _policy(moe_models["qwen3_moe"], **recompute_settings(recompute))
        with torch.no_grad():
            for layer in policy.model.decoder.layers:
                if hasattr(layer.mlp, "router"):
                    layer.mlp.router.weight.neg_()

        def loss(batch, logprobs, entropy):
            value = (logprobs * batch.completion_mask).sum()
            return value, value.detach()

        values = run_schedule(policy.model, batches, 1.0, loss, replay=policy.replay)
        results.append((values, {n: p.grad.clone() for n, p in policy.model.named_parameters()}))
    (plain, grads), (recomputed, grads_recomputed) = results
    torch.testing.assert_close(torch.stack(recomputed), torch.stack(plain), atol=1e-6, rtol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_recomputed[name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_router_disagreement_is_counted_once_per_training_forward(model_parallel, moe_models):
    """``sampling/router_disagreement``'s counts under Megatron: two micro-batches of the recorded batch (21 tokens with
    a recording, 2 MoE layers: 2 x 21 x 2 = 84 pairs) through megatron-core's schedule, with and without full activation
    recompute (whose recomputed forward is not counted again): at the weights that recorded the routing the routers
    agree on all 84; with the routers negated, each one's own top-2 of 4 experts is the complement of the replayed
    pair: all 84 differ. The old-logprob pass (no schedule, outside ``counting``) counts nothing."""
    from lightning_grpo.models.moe import ReplayStats
    from lightning_grpo.strategies.megatron.model import recompute_settings
    from lightning_grpo.strategies.megatron.pipeline import run_schedule

    hf = AutoModelForCausalLM.from_pretrained(moe_models["qwen3_moe"], dtype=torch.float32)
    batch = hf_routing(hf, experience(hf.config.pad_token_id))

    def loss(batch, logprobs, entropy):
        value = (logprobs * batch.completion_mask).sum()
        return value, value.detach()

    for recompute in (False, True):
        _, policy = _policy(moe_models["qwen3_moe"], **recompute_settings(recompute))
        for negated in (False, True):
            if negated:
                with torch.no_grad():
                    for layer in policy.model.decoder.layers:
                        if hasattr(layer.mlp, "router"):
                            layer.mlp.router.weight.neg_()
            stats = ReplayStats()
            with policy.replay.counting(stats):
                run_schedule(policy.model, [batch, batch], 1.0, loss, replay=policy.replay)
            assert (float(stats.differing), float(stats.counted)) == ((84.0 if negated else 0.0), 84.0), recompute
            with torch.no_grad():
                policy.completion_logprobs(batch, 1.0)  # not counted: the replays count only while counting is open
            assert float(stats.counted) == 84.0


def test_a_token_without_recorded_routing_is_routed_by_its_router(model_parallel, moe_models):
    """-1 (nothing recorded: padding, a token never fed to the sampler's model) lets the router choose for that token
    only, as the HF path does; under "R3" an experience without routing is an error, as is one field without the
    other."""
    import dataclasses

    from lightning_grpo.strategies.megatron.pipeline import replayed_routing

    hf, policy = _policy(moe_models["qwen3_moe"])
    plain = experience(hf.config.pad_token_id)
    batch = hf_routing(hf, plain)
    prompt = batch.prompt_routed_experts.clone()
    prompt[1, 3, 0] = -1  # row 1's second real prompt token, first MoE layer (its input is the same either way)
    batch = dataclasses.replace(batch, prompt_routed_experts=prompt)
    with torch.no_grad():
        for layer in policy.model.decoder.layers:
            if hasattr(layer.mlp, "router"):
                layer.mlp.router.weight.neg_()
        lists = policy.replay.record()
        policy.completion_logprobs(plain, 1.0)  # live
        policy.completion_logprobs(batch, 1.0)  # replayed
    routing = replayed_routing(batch)
    live, replayed = (_chosen(c, routing.shape) for c in lists[0])
    position = 1  # row 1's prompt starts at position 0 in the policy's layout: its column 3 is position 1
    assert int(routing[1, position, 0, 0]) == -1
    assert torch.equal(replayed[1, position], live[1, position])
    recorded = routing[:, :, 0][..., 0] >= 0
    assert torch.equal(replayed[recorded], routing[:, :, 0][recorded])
    assert not torch.equal(live[recorded].sort(-1).values, replayed[recorded].sort(-1).values)
    with pytest.raises(ValueError, match="routing_replay='R3': this micro-batch carries no routed experts"):
        replayed_routing(plain, required=True)
    with pytest.raises(ValueError, match="completion_routed_experts is missing"):
        replayed_routing(dataclasses.replace(batch, completion_routed_experts=None))


def test_routing_options_without_a_megatron_counterpart_are_refused():
    from lightning_grpo.strategies.megatron.strategy import check_routing_options

    refused = (("routing_replay", "R2"), ("routing_replay_diagnostics", True), ("router_aux_loss_coef", 0.01))
    for field, value in refused:
        with pytest.raises(ValueError, match=rf"GRPOConfig.{field}={value!r} is not offered with MegatronStrategy"):
            check_routing_options({"routing_replay": "off", field: value})
    check_routing_options({"routing_replay": "R3", "routing_replay_diagnostics": False, "router_aux_loss_coef": 0.0})


def test_a_token_budget_is_refused_with_the_experts_split_over_ranks():
    from lightning_grpo.strategies.megatron.strategy import check_no_token_budget

    message = (r"max_tokens_per_microbatch=512 with MegatronStrategy\(expert_model_parallel_size=2, "
               r"expert_tensor_parallel_size=1\): a token budget gives each data-parallel rank its own number of")
    with pytest.raises(ValueError, match=message):
        check_no_token_budget(512, 2, 1)
    with pytest.raises(ValueError, match=r"max_tokens_per_microbatch='auto'"):
        check_no_token_budget("auto", 1, 2)
    check_no_token_budget(512, 1, 1)  # experts not split (or a dense model): any budget
    check_no_token_budget(None, 2, 2)
