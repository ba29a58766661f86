"""The architecture matrix's tiny models (:mod:`lightning_grpo.demos.architectures`): their shared shape, each family's
quirks kept, the Llama the tests' own tiny Llama, an unknown name refused. What each runs through:
``tests/test_model_matrix.py``."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_grpo.demos.architectures import ARCHITECTURES, save_tiny_architecture


@pytest.fixture(scope="module")
def models(tiny_architecture_paths):
    return {name: AutoModelForCausalLM.from_pretrained(path) for name, path in tiny_architecture_paths.items()}


def test_every_architecture_has_the_matrix_shape(models):
    assert list(models) == ["llama", "qwen2.5", "qwen3", "qwen3_moe", "olmoe", "gemma3", "mistral", "phi3", "gpt_oss",
                            "qwen3.5"]
    for name, model in models.items():
        config = model.config
        assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (64, 2, 2048), name
        assert (config.num_attention_heads, config.num_key_value_heads) == (2, 1), name
        assert model.dtype == torch.float32 and model.generation_config.eos_token_id == 2, name
        assert type(model).__name__ == {"qwen2.5": "Qwen2ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                                        "olmoe": "OlmoeForCausalLM", "gemma3": "Gemma3ForCausalLM",
                                        "phi3": "Phi3ForCausalLM", "gpt_oss": "GptOssForCausalLM",
                                        "qwen3.5": "Qwen3_5ForCausalLM"}.get(name, f"{name.title()}ForCausalLM")


def test_each_family_keeps_its_quirks(models):
    hybrid = models["qwen3.5"].model.layers
    assert models["qwen3.5"].config.layer_types == ["linear_attention", "full_attention"]
    assert hasattr(hybrid[0], "linear_attn") and not hasattr(hybrid[0], "self_attn")  # the first layer is not attention
    assert hasattr(hybrid[1], "self_attn") and hybrid[1].self_attn.head_dim == 32
    gemma = models["gemma3"].config
    assert (gemma.final_logit_softcapping, gemma.sliding_window, gemma.tie_word_embeddings) == (1.0, 8, True)
    assert gemma.layer_types == ["sliding_attention", "full_attention"]
    gpt_oss = models["gpt_oss"]
    assert gpt_oss.config.layer_types == ["sliding_attention", "full_attention"]
    assert gpt_oss.model.layers[0].self_attn.sinks.shape == (2,)
    assert gpt_oss.config.rope_parameters["rope_type"] == "yarn"
    assert hasattr(models["phi3"].model.layers[0].self_attn, "qkv_proj")
    qwen2 = models["qwen2.5"]
    assert qwen2.model.layers[0].self_attn.q_proj.bias is not None and qwen2.config.tie_word_embeddings
    for name in ("qwen3_moe", "olmoe", "gpt_oss"):
        routers = [p for n, p in models[name].named_parameters() if n.endswith(ARCHITECTURES[name].routers)]
        assert len(routers) == 2 and all(0.8 < float(r.detach().std()) < 1.2 for r in routers), name
    for name, model in models.items():  # heads of 32: vLLM's CPU attention takes 32 to 128 in steps of 16
        assert model.model.layers[-1].self_attn.head_dim == 32, name


def test_the_llama_is_the_tests_tiny_llama(models, tiny_llama_path):
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_path).state_dict()
    ours = models["llama"].state_dict()
    assert ours.keys() == reference.keys() and all(torch.equal(ours[k], reference[k]) for k in ours)


def test_an_unknown_architecture_is_named(tmp_path, tiny_llama_path):
    with pytest.raises(ValueError, match=r"name='bert' is invalid: choose one of \['llama', 'qwen2.5', "):
        save_tiny_architecture(tmp_path, tiny_llama_path, "bert")
