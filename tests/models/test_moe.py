"""The routers of the mixture-of-experts families (:mod:`lightning_grpo.models.moe`): recording what they select,
replaying given experts with the family's own mixing weights (a gradient still reaches the router), -1 leaving the
router's own choice, gradient checkpointing's recomputation replaying too; the tiny random models of every family."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from lightning_grpo.models.moe import FAMILIES, MoeRouters, ReplayStats, moe_family

FAMILY_FIXTURES = {"qwen3_moe": "tiny_qwen3_moe_path", "olmoe": "tiny_olmoe_path", "mixtral": "tiny_mixtral_path"}


@pytest.fixture(scope="module", params=sorted(FAMILY_FIXTURES))
def family_model(request):
    path = request.getfixturevalue(FAMILY_FIXTURES[request.param])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return request.param, model, MoeRouters(model)


def _ids(seed=0, shape=(3, 9)):
    return torch.randint(3, 2000, shape, generator=torch.Generator().manual_seed(seed))


def _other_experts(own: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Each position's experts shifted by one: a valid top-k set (distinct experts) other than ``own``."""
    return ((own.long() + 1) % num_experts).to(own.dtype)


def test_every_family_has_its_router_and_renormalization(family_model):
    name, model, routers = family_model
    assert moe_family(model.config) is FAMILIES[name]
    assert type(routers.routers[0]).__name__ == FAMILIES[name].router_class
    expected = {"qwen3_moe": (2, 8, 2, True), "olmoe": (2, 4, 2, False), "mixtral": (2, 4, 2, True)}[name]
    assert (routers.moe_layers, routers.num_experts, routers.top_k,
            FAMILIES[name].renormalizes(model.config)) == expected


def test_replaying_the_own_routing_changes_nothing_bit_for_bit(family_model):
    """The logprobs of the replayed forward equal the plain forward's when the routing is the model's own."""
    _, model, routers = family_model
    ids = _ids()
    with torch.no_grad(), routers.record() as calls:
        plain = model(ids).logits
    assert len(calls) == 1 and calls[0].shape == (27, routers.moe_layers, routers.top_k)
    with torch.no_grad(), routers.replay(calls[0]):
        replayed = model(ids).logits
    assert torch.equal(replayed, plain)


def test_replayed_experts_are_the_ones_used_with_the_familys_weights_and_the_router_gets_a_gradient(family_model):
    """Every position of every MoE layer routes to the replayed experts; their weights are the live router
    probabilities at those experts (renormalized iff the family does); the router's weight gets a gradient."""
    name, model, routers = family_model
    ids = _ids(1)
    with torch.no_grad(), routers.record() as calls:
        plain = model(ids).logits
    given = _other_experts(calls[0], routers.num_experts)
    seen = []  # what each sparse block's experts receive: (router logits, indices, weights)
    handles = [r.register_forward_hook(lambda m, a, out: seen.append(out)) for r in routers.routers]
    model.zero_grad()
    try:
        with routers.replay(given):
            replayed = model(ids).logits
            replayed.sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    assert not torch.allclose(replayed, plain, atol=1e-3)
    assert [tuple(i.shape) for _, _, i in seen] == [(27, 2)] * routers.moe_layers
    for layer, (logits, weights, indices) in enumerate(seen):
        assert torch.equal(indices, given[:, layer].long())  # every token, every MoE layer
        probs = torch.softmax(logits.detach().double(), dim=-1).gather(-1, indices)
        if FAMILIES[name].renormalizes(model.config):
            probs = probs / probs.sum(-1, keepdim=True)
        torch.testing.assert_close(weights.detach().double(), probs, atol=1e-6, rtol=0)
    for router in routers.routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_minus_one_keeps_the_routers_own_choice_and_the_disagreement_is_counted(family_model):
    _, model, routers = family_model
    ids = _ids(2)
    with torch.no_grad(), routers.record() as calls:
        model(ids)
    own = calls[0]
    given = _other_experts(own, routers.num_experts)
    given[:10] = -1  # the first 10 positions: the router's own; the other 17 differ in every layer
    stats = ReplayStats()
    with torch.no_grad(), routers.replay(given, stats=stats), routers.observe(
            lambda layer, logits, experts, recomputing: used.append(experts)):
        used: list = []
        model(ids)
    expected = torch.where(given >= 0, given, own).long()
    assert all(torch.equal(u, expected[:, layer]) for layer, u in enumerate(used))
    # layer 0 sees the replayed experts' inputs unchanged, so its own choice is ``own`` there: 17 of 17 differ;
    # later layers see other hidden states, but a shifted set never equals the own one at layer 0
    assert float(stats.counted) == 17 * routers.moe_layers and float(stats.differing) >= 17


def test_gradient_checkpointing_recomputes_with_the_replayed_experts(tiny_qwen3_moe_path):
    """Backward's recomputation of a checkpointed layer routes like its forward pass (the checkpoint's
    ``context_fn`` reopens the replay): the same gradients as without checkpointing."""
    grads = []
    for checkpointing in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe_path, dtype=torch.float32).train()
        routers = MoeRouters(model)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ids = _ids(3)
        with torch.no_grad(), routers.record() as calls:
            model(ids)
        with routers.replay(_other_experts(calls[0], routers.num_experts)):
            loss = model(ids).logits.pow(2).mean()
        loss.backward()  # after the replay closed, as Lightning's backward runs after training_step
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=0, msg=name)


def test_only_the_routing_layers_count_and_dense_models_are_refused(tiny_llama_path):
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
                            num_experts_per_tok=2, mlp_only_layers=[1])
    model = Qwen3MoeForCausalLM(config)
    mixed = MoeRouters(model)
    assert mixed.moe_layers == 2 and mixed.routers == [model.model.layers[0].mlp.gate, model.model.layers[2].mlp.gate]
    dense = AutoModelForCausalLM.from_pretrained(tiny_llama_path)
    assert moe_family(dense.config) is None
    with pytest.raises(ValueError, match=r"model_type='llama'\) is not a mixture-of-experts model of a supported "
                                         r"family \(mixtral, olmoe, qwen3_moe\)"):
        MoeRouters(dense)


def test_a_replay_laid_out_for_other_positions_is_an_error(family_model):
    _, model, routers = family_model
    with torch.no_grad(), routers.replay(torch.zeros(5, routers.moe_layers, routers.top_k, dtype=torch.int16)):
        with pytest.raises(RuntimeError, match=r"router 0 selects \(27, 2\) \(rows, top_k\) experts but \(5, 2\)"):
            model(_ids())


def test_the_weight_stream_of_a_mixture_of_experts_is_its_checkpoint(family_model, request):
    """The weights an engine with its own copy receives (:func:`hf_weights`) are the checkpoint's tensors under the
    checkpoint's names, exactly: transformers fuses each layer's experts in memory (``mlp.experts.gate_up_proj``
    ``(E, 2I, H)``, ``mlp.experts.down_proj``), the checkpoint (what vLLM's loaders read) has one tensor per expert and
    projection (Mixtral's under ``block_sparse_moe.experts.<e>.w1/w2/w3``); a dense model's stream is unchanged."""
    from safetensors.torch import load_file

    from lightning_grpo.models.hf_weights import checkpoint_layout, hf_weights

    name, model, _ = family_model
    path = request.getfixturevalue(FAMILY_FIXTURES[name])
    saved = load_file(f"{path}/model.safetensors")
    streamed = dict(hf_weights(model, tie_word_embeddings=False))
    assert sorted(streamed) == sorted(saved)
    assert any(".experts.3." in key for key in streamed) and not any(k.endswith("gate_up_proj") for k in streamed)
    for key, value in saved.items():
        assert torch.equal(streamed[key], value), key
    assert checkpoint_layout(AutoModelForCausalLM.from_config(model.config)) is not None  # made from code: the same


def test_a_dense_models_weight_stream_keeps_its_names(tiny_llama_path):
    from lightning_grpo.models.hf_weights import checkpoint_layout, hf_weights

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    assert checkpoint_layout(model) is None
    assert [n for n, _ in hf_weights(model, False)] == [n for n, _ in model.named_parameters()]
