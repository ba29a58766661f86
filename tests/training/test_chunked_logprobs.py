"""Chunked lm_head logprobs (issue 24 item 1): the same loss and gradient as the full-logits path, without the
``[K, V]`` logits.

* the pure function equals ``functional.token_logprobs`` on ``F.linear(hidden, W, b)``: values, entropy and the
  gradients of hidden, weight and bias, for every truncation mode, chunk size and with/without the entropy gradient;
* through ``GRPOModule.compute_loss``: loss and every policy parameter's gradient (lm_head, tied embeddings included)
  equal ``lm_head_chunk_size=None`` to 1e-5 for every layout (padded, packed one sequence per row, packed in one
  row, shared prefix), truncation mode, with the entropy bonus and the high-entropy token selection;
* memory, counted from the tensors autograd saves for backward (``saved_tensors_hooks``), not wall clock: no saved
  tensor of the chunked path is ``[K, V]``-sized, and it saves at least ``K * V * 4`` bytes less;
* the models it applies to: every model type of ``PLAIN_HEAD_MODEL_TYPES`` applies nothing after its lm_head in
  transformers' source; a model that soft-caps its logits (Gemma 2) keeps the full logits and scores correctly.
"""

import importlib
import inspect

import pytest
import torch
from torch.nn import functional as F

from lightning_grpo import GRPOConfig, GRPOModule
from lightning_grpo.functional import token_logprobs
from lightning_grpo.training.experience import Experience
from lightning_grpo.training.lm_head import chunked_token_logprobs
from lightning_grpo.training.logprob_head import PLAIN_HEAD_MODEL_TYPES, plain_output_layer

TRUNCATIONS = {
    "none": dict(),
    "top_k": dict(top_k=20),
    "top_p": dict(top_p=0.9),
    "min_p": dict(min_p=0.02),
    "all": dict(top_k=50, top_p=0.95, min_p=0.01),
}
LAYOUTS = {
    "padded": dict(padding_free=False),
    "packed_per_sequence": dict(shared_prefix=False),
    "packed_one_row": dict(shared_prefix=False, packed_row_tokens=10**6),
    "shared_prefix": dict(shared_prefix=True),
}


# ----------------------------------------------------------------------------------------------- the pure function
@pytest.mark.parametrize("truncation", list(TRUNCATIONS))
@pytest.mark.parametrize("chunk_size", [1, 7, 1000])
def test_chunked_function_equals_full_logits(truncation, chunk_size):
    g = torch.Generator().manual_seed(0)
    k, h, v = 23, 16, 301
    hidden = torch.randn(k, h, generator=g).requires_grad_()
    weight = torch.randn(v, h, generator=g).requires_grad_()
    bias = torch.randn(v, generator=g).requires_grad_()
    labels = torch.randint(0, v, (k,), generator=g)
    w_lp, w_ent = torch.randn(k, generator=g), torch.randn(k, generator=g)
    knobs = TRUNCATIONS[truncation]
    results = []
    for chunked in (True, False):
        for p in (hidden, weight, bias):
            p.grad = None
        if chunked:
            lp, ent = chunked_token_logprobs(hidden, weight, labels, bias, 0.7, with_entropy=True, entropy_grad=True,
                                             chunk_size=chunk_size, **knobs)
        else:
            lp, ent = token_logprobs(F.linear(hidden, weight, bias)[None], labels[None], 0.7, with_entropy=True,
                                     entropy_grad=True, **knobs)
            lp, ent = lp[0], ent[0]
        ((lp * w_lp).mean() + (ent * w_ent).mean()).backward()  # a token mean, as the GRPO losses
        results.append((lp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone(), bias.grad.clone()))
    for name, a, b in zip(("logprobs", "entropy", "hidden", "weight", "bias"), *results, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    assert results[1][0].abs().min() > 0 and results[1][3].abs().sum() > 0  # real values and gradients
    if truncation != "none":  # the truncation really removed tokens: not the untruncated distribution
        plain, _ = token_logprobs(F.linear(hidden, weight, bias)[None].detach(), labels[None], 0.7)
        assert (plain[0] - results[0][0]).abs().max() > 1e-3


def test_entropy_without_its_gradient_gets_none_and_changes_nothing():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 8, generator=g, requires_grad=True)
    weight = torch.randn(40, 8, generator=g, requires_grad=True)
    labels = torch.randint(0, 40, (5,), generator=g)
    lp, ent = chunked_token_logprobs(hidden, weight, labels, with_entropy=True, entropy_grad=False, chunk_size=2)
    assert not ent.requires_grad
    lp.sum().backward()
    grad = weight.grad.clone()
    weight.grad = None
    ref, _ = token_logprobs(F.linear(hidden, weight)[None], labels[None])
    ref.sum().backward()
    torch.testing.assert_close(grad, weight.grad, atol=1e-5, rtol=1e-5)
    _, none = chunked_token_logprobs(hidden, weight, labels)
    assert none is None


def test_chunked_function_rejects_bad_arguments():
    hidden, weight, labels = torch.zeros(3, 4), torch.zeros(10, 4), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match=r"labels \(2,\) must be \(K,\) = \(3,\)"):
        chunked_token_logprobs(hidden, weight, labels[:2])
    with pytest.raises(ValueError, match="chunk_size=0 must be >= 1"):
        chunked_token_logprobs(hidden, weight, labels, chunk_size=0)
    with pytest.raises(ValueError, match="top_p=0 is invalid: must be in"):
        chunked_token_logprobs(hidden, weight, labels, top_p=0)
    with pytest.raises(ValueError, match=r"GRPOConfig.lm_head_chunk_size=0 is invalid"):
        GRPOConfig(lm_head_chunk_size=0)


# ------------------------------------------------------------------------------------------ through the module
def _experience(vocab_size, seed=0):
    """8 sequences in two groups of 4 sharing a prompt, uneven lengths, one without loss tokens, advantages +-1."""
    g = torch.Generator().manual_seed(seed)
    rows, p, t = 8, 6, 7
    prompt_mask = torch.ones(rows, p, dtype=torch.long)
    completion_mask = torch.zeros(rows, t, dtype=torch.long)
    for i in range(rows):
        completion_mask[i, : int(torch.randint(2, t + 1, (1,), generator=g))] = 1
    completion_mask[5] = 0
    prompt_ids = torch.randint(0, vocab_size, (rows, p), generator=g)
    prompt_mask[4:, :2] = 0  # the second group's prompt is shorter (left padding)
    for group in (range(0, 4), range(4, 8)):
        prompt_ids[list(group)] = prompt_ids[group[0]].clone()
    return Experience(prompt_ids=prompt_ids * prompt_mask, prompt_mask=prompt_mask,
                      completion_ids=torch.randint(0, vocab_size, (rows, t), generator=g),
                      completion_mask=completion_mask,
                      advantages=torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 2.0, -2.0]))


@pytest.fixture(scope="module", params=["tied", "untied"])
def module(request, tiny_tied_llama_full_vocab_path, tiny_llama_full_vocab_path):
    """A tiny Llama with SmolLM2's whole 49,152-token vocabulary: the memory the chunked path saves is the size of the
    vocabulary (with 2,048 tokens, the hidden activations would be as large)."""
    path = tiny_tied_llama_full_vocab_path if request.param == "tied" else tiny_llama_full_vocab_path
    module = GRPOModule(path, reward_funcs=["gsm8k_accuracy"], config=GRPOConfig())
    module.policy.eval()  # no dropout anyway; eval keeps the two passes identical
    return module


def _loss_and_grads(module, batch, config):
    module.config.__dict__.update(config.__dict__)  # every component holds this config object
    module.policy.zero_grad(set_to_none=True)
    output = module.compute_loss(batch)
    output.loss.backward()
    return output.loss.detach(), {n: p.grad.clone() for n, p in module.policy.named_parameters()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("truncation", list(TRUNCATIONS))
@pytest.mark.parametrize("entropy", ["none", "bonus", "bonus_and_selection"])
def test_loss_and_gradients_equal_the_full_logits_path(module, layout, truncation, entropy):
    if module.policy.config.tie_word_embeddings is False and (truncation, entropy) not in (("none", "none"),
                                                                                            ("all", "bonus")):
        pytest.skip("untied: the two extreme cases suffice (the head is the same code)")
    if entropy != "bonus" and truncation not in ("none", "all"):
        pytest.skip("each truncation mode is covered with the entropy gradient (the hardest case)")
    knobs = dict(**LAYOUTS[layout], **TRUNCATIONS[truncation], temperature=0.8)
    if entropy != "none":
        knobs["entropy_coef"] = 0.05
    if entropy == "bonus_and_selection":
        knobs["top_entropy_quantile"] = 0.5
    batch = _experience(module.policy.config.vocab_size)
    loss_full, grads_full = _loss_and_grads(module, batch, GRPOConfig(lm_head_chunk_size=None, **knobs))
    loss_chunked, grads_chunked = _loss_and_grads(module, batch, GRPOConfig(lm_head_chunk_size=5, **knobs))
    torch.testing.assert_close(loss_chunked, loss_full, atol=1e-5, rtol=0)
    assert loss_full.abs() > 0
    for name, grad in grads_full.items():
        torch.testing.assert_close(grads_chunked[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    head = module.policy.get_output_embeddings().weight
    name = next(n for n, p in module.policy.named_parameters() if p is head)  # lm_head or the tied embeddings
    assert grads_full[name].abs().sum() > 0


def test_no_grad_logprobs_equal_the_full_logits_path(module):
    batch = _experience(module.policy.config.vocab_size, seed=3)
    results = []
    for chunk in (None, 4):
        module.config.__dict__.update(GRPOConfig(lm_head_chunk_size=chunk, top_p=0.9).__dict__)
        results.append(module.logprobs.batched(module.policy, batch, micro_batch_size=3))
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(results[1][mask], results[0][mask], atol=1e-5, rtol=0)
    assert (results[1][~mask] == 0).all()


# --------------------------------------------------------------------------------------------------- memory
def _saved_bytes(module, batch, chunk):
    """Bytes and shapes of the non-parameter tensors autograd saves during ``compute_loss``."""
    module.config.__dict__.update(GRPOConfig(lm_head_chunk_size=chunk, entropy_coef=0.1).__dict__)
    parameters = {p.data_ptr() for p in module.policy.parameters()}
    saved = []

    def pack(tensor):
        if tensor.data_ptr() not in parameters:
            saved.append((tuple(tensor.shape), tensor.numel() * tensor.element_size()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module.compute_loss(batch)
    return saved


def test_chunked_path_saves_no_vocabulary_sized_activation(module):
    batch = _experience(module.policy.config.vocab_size)
    vocab = module.policy.config.vocab_size
    tokens = int(batch.completion_mask.sum())  # K, the scored positions
    full, chunked = _saved_bytes(module, batch, None), _saved_bytes(module, batch, 4)
    # the full path keeps the (float32) logits of the K tokens (one tensor per forward pass) for backward
    assert sum(size for shape, size in full if shape and shape[-1] == vocab) >= tokens * vocab * 4
    largest = max(chunked, key=lambda item: item[1])
    assert largest[1] < vocab * 4, f"a saved tensor {largest} is vocabulary-sized"
    assert sum(b for _, b in full) - sum(b for _, b in chunked) >= tokens * vocab * 4


# --------------------------------------------------------------------------------------------- which models
@pytest.mark.parametrize("model_type", sorted(PLAIN_HEAD_MODEL_TYPES))
def test_listed_model_types_apply_nothing_after_their_output_layer(model_type):
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    module = model_type_to_module_name(model_type)  # e.g. qwen3_5_text -> qwen3_5
    source = inspect.getsource(importlib.import_module(f"transformers.models.{module}.modeling_{module}"))
    head_calls = [i for i, line in enumerate(source.splitlines()) if "logits = self." in line and "(hidden_states[:, "
                  "slice_indices, :])" in line]
    lines = source.splitlines()
    assert head_calls, f"{model_type}: no `logits = self.<head>(hidden_states[:, slice_indices, :])`"
    for i in head_calls:
        following = next(line.strip() for line in lines[i + 1:] if line.strip())
        assert following == "loss = None", f"{model_type}: after its output layer: {following!r}"


def test_a_soft_capping_model_keeps_the_full_logits():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=5.0,
                          attn_implementation="eager")
    model = Gemma2ForCausalLM(config).eval()
    assert plain_output_layer(model) is None
    batch = _experience(97)
    from lightning_grpo.training.logprobs import CompletionLogprobs

    logprobs, _ = CompletionLogprobs(GRPOConfig(shared_prefix=False))(model, batch)
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0)).logits
    expected, _ = token_logprobs(logits[:, batch.prompt_ids.shape[1] - 1:-1], batch.completion_ids)
    done = batch.completion_mask.bool()
    torch.testing.assert_close(logprobs[done], expected[done], atol=1e-5, rtol=0)
