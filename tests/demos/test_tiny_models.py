"""The tiny random Llamas the tests train (:mod:`lightning_grpo.demos.tiny_models`): their sizes, tying and special
ids, and the cut SmolLM2 tokenizer they carry."""

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_grpo.demos.tiny_models import save_tiny_tokenizer


@pytest.mark.parametrize("fixture, tied", [("tiny_llama_path", False), ("tiny_tied_llama_path", True)])
def test_tiny_llama_fixtures(request, fixture, tied):
    path = request.getfixturevalue(fixture)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.head_dim) == (2, 64, 2, 32)
    assert (config.num_key_value_heads, config.intermediate_size, config.vocab_size) == (1, 128, 2048)
    assert len(tokenizer) == 2048
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied
    assert model.generation_config.eos_token_id == model.generation_config.pad_token_id == tokenizer.eos_token_id == 2
    smollm2_tokenizer = AutoTokenizer.from_pretrained(request.getfixturevalue("smollm2_path"))
    assert tokenizer.chat_template == smollm2_tokenizer.chat_template


def test_a_cut_tokenizer_keeps_the_first_tokens_the_specials_and_the_template(tmp_path, smollm2_path):
    """``save_tiny_tokenizer``: ids below the cut are SmolLM2's own; any text still round-trips (in more tokens, all
    below the cut); the chat template renders the same text with the same special ids."""
    full = AutoTokenizer.from_pretrained(smollm2_path)
    cut = AutoTokenizer.from_pretrained(save_tiny_tokenizer(smollm2_path, tmp_path / "cut", 300))
    assert len(cut) == 300 and cut.get_vocab() == {t: i for t, i in full.get_vocab().items() if i < 300}
    specials = (cut.eos_token_id, cut.pad_token_id, cut.bos_token_id)
    assert specials == (full.eos_token_id, full.pad_token_id, full.bos_token_id) == (2, 2, 1)
    text = "Janet’s ducks lay 16 eggs per day — 🦆 #### 18"
    ids = cut(text)["input_ids"]
    assert cut.decode(ids) == text and max(ids) < 300 and len(ids) > len(full(text)["input_ids"])
    assert full.convert_ids_to_tokens(ids) == cut.convert_ids_to_tokens(ids)  # the same tokens, fewer merges
    chat = [{"role": "user", "content": "What is 7 times 6?"}]
    rendered = cut.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rendered == full.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert cut(rendered)["input_ids"][:1] == full(rendered)["input_ids"][:1] == [1]  # <|im_start|>
    with pytest.raises(ValueError, match=r"vocab_size=49152 is invalid"):
        save_tiny_tokenizer(smollm2_path, tmp_path / "whole", 49152)
    with pytest.raises(ValueError, match=r"vocab_size=100 is invalid: the first 100 ids .* byte alphabet"):
        save_tiny_tokenizer(smollm2_path, tmp_path / "too_small", 100)


@pytest.mark.parametrize("fixture, experts, renormalized", [("tiny_qwen3_moe_path", 8, True),
                                                            ("tiny_olmoe_path", 4, False),
                                                            ("tiny_mixtral_path", 4, True)])
def test_tiny_moe_fixtures(request, tmp_path, fixture, experts, renormalized):
    """The tiny mixtures of experts: 2 layers of hidden 64 with heads of 32 (vLLM's CPU attention takes 32), every
    layer routing top-2 of its experts with N(0, 1) routers, the cut tokenizer's 2,048 tokens and special ids."""
    from lightning_grpo.demos.tiny_models import save_tiny_moe
    from lightning_grpo.models.moe import FAMILIES

    path = request.getfixturevalue(fixture)
    model = AutoModelForCausalLM.from_pretrained(path)
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size, config.num_experts_per_tok) == (2, 64,
                                                                                                          2048, 2)
    assert model.model.layers[0].self_attn.head_dim == 32
    gate = model.model.layers[0].mlp.gate
    assert gate.weight.shape == (experts, 64) and 0.8 < float(gate.weight.detach().std()) < 1.2
    assert FAMILIES[config.model_type].renormalizes(config) is renormalized
    assert model.generation_config.eos_token_id == model.generation_config.pad_token_id == 2
    with pytest.raises(ValueError, match=r"model_type='deepseek_v3' is invalid: choose one of"):
        save_tiny_moe(tmp_path / "unknown", path, "deepseek_v3")
