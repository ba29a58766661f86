"""HF <-> megatron-core weight conversion as pure functions: hand-worked layouts, bit-exact round trips, and the
architecture checks. No process group needed."""

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from lightning_grpo.strategies.megatron.convert import ParamMap, hf_to_mcore, mcore_to_hf, param_maps, shard, unshard  # noqa: E402
from lightning_grpo.strategies.megatron.model import Architecture  # noqa: E402


def _arch(**overrides):
    fields = dict(model_type="llama", vocab_size=8, hidden_size=1, ffn_hidden_size=4, num_layers=1,
                  num_attention_heads=4, num_query_groups=2, head_dim=1, rms_norm_eps=1e-5, rope_theta=1e4,
                  max_position_embeddings=16, tie_word_embeddings=True, qkv_bias=False)
    fields.update(overrides)
    return Architecture(**fields)


def _config(cls, tied, **kwargs):
    fields = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied, pad_token_id=0)
    return cls(**{**fields, **kwargs})


def test_fused_qkv_is_grouped_by_kv_head_and_split_by_whole_groups():
    # 4 query heads in 2 groups, head_dim 1, hidden 1: group g holds q heads 2g, 2g+1, then k_g, then v_g
    arch = _arch()
    pm = ParamMap("decoder.layers.0.self_attention.linear_qkv.weight", ("q", "k", "v"), "qkv")
    q = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
    k = torch.tensor([[10.0], [11.0]])
    v = torch.tensor([[20.0], [21.0]])
    assert shard(pm, [q, k, v], arch, 0, 1).flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert shard(pm, [q, k, v], arch, 0, 2).flatten().tolist() == [0, 1, 10, 20]
    assert shard(pm, [q, k, v], arch, 1, 2).flatten().tolist() == [2, 3, 11, 21]
    bias = ParamMap("b", ("q", "k", "v"), "qkv")
    assert shard(bias, [q[:, 0], k[:, 0], v[:, 0]], arch, 1, 2).tolist() == [2, 3, 11, 21]


def test_gate_up_shards_stack_each_ranks_gate_over_its_up():
    arch = _arch()
    pm = ParamMap("decoder.layers.0.mlp.linear_fc1.weight", ("gate", "up"), "gate_up")
    gate = torch.tensor([[0.0], [1.0], [2.0], [3.0]])
    up = torch.tensor([[10.0], [11.0], [12.0], [13.0]])
    assert shard(pm, [gate, up], arch, 0, 2).flatten().tolist() == [0, 1, 10, 11]
    assert shard(pm, [gate, up], arch, 1, 2).flatten().tolist() == [2, 3, 12, 13]
    assert [t.flatten().tolist() for t in unshard(pm, [shard(pm, [gate, up], arch, r, 2) for r in (0, 1)], arch)] == [
        [0, 1, 2, 3], [10, 11, 12, 13]]


def test_row_and_vocab_splits():
    arch = _arch()
    weight = torch.arange(12.0).view(3, 4)
    assert shard(ParamMap("o", ("o",), "row"), [weight], arch, 1, 2).tolist() == [[2, 3], [6, 7], [10, 11]]
    vocab = torch.arange(8.0).view(8, 1)
    assert shard(ParamMap("e", ("e",), "vocab"), [vocab], arch, 1, 2).flatten().tolist() == [4, 5, 6, 7]


@pytest.mark.parametrize("cls,config_cls,tied", [(LlamaForCausalLM, LlamaConfig, True),
                                                 (LlamaForCausalLM, LlamaConfig, False),
                                                 (Qwen2ForCausalLM, Qwen2Config, False)])
@pytest.mark.parametrize("tp", [1, 2])
def test_hf_to_mcore_to_hf_is_bit_exact(cls, config_cls, tied, tp):
    torch.manual_seed(0)
    model = cls(_config(config_cls, tied))
    with torch.no_grad():
        for _name, param in model.named_parameters():
            param.normal_()  # biases and norms are not their constant init
    hf_state = model.state_dict()
    arch = Architecture.from_hf_config(model.config)
    shards = [hf_to_mcore(hf_state, arch, rank, tp) for rank in range(tp)]
    back = mcore_to_hf(shards, arch)
    assert sorted(back) == sorted(hf_state)
    for name, value in hf_state.items():
        assert torch.equal(back[name], value), name
    if tp == 2:  # each rank holds half of every split tensor
        qkv = shards[0]["decoder.layers.0.self_attention.linear_qkv.weight"]
        assert qkv.shape == ((4 + 2 * 2) * 8 // 2, 32)
        assert shards[1]["embedding.word_embeddings.weight"].shape == (32, 32)
    names = {pm.mcore for pm in param_maps(arch)}
    assert ("output_layer.weight" in names) == (not tied)
    assert ("decoder.layers.1.self_attention.linear_qkv.bias" in names) == (cls is Qwen2ForCausalLM)


def test_architecture_from_configs():
    arch = Architecture.from_hf_config(_config(Qwen2Config, False, rope_theta=1e6, rms_norm_eps=1e-6))
    assert (arch.model_type, arch.qkv_bias, arch.rope_theta, arch.rms_norm_eps) == ("qwen2", True, 1e6, 1e-6)
    assert (arch.num_attention_heads, arch.num_query_groups, arch.heads_per_group, arch.head_dim) == (4, 2, 2, 8)
    assert Architecture.from_hf_config(_config(LlamaConfig, True)).padding_idx == 0


@pytest.mark.parametrize("change,match", [
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}), "rope"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(attention_bias=True), "attention_bias"),
])
def test_unsupported_llama_features_are_named(change, match):
    with pytest.raises(ValueError, match=match):
        Architecture.from_hf_config(_config(LlamaConfig, True, **change))


def test_unsupported_model_type_and_sliding_window():
    config = _config(LlamaConfig, True)
    config.model_type = "mistral"
    with pytest.raises(ValueError, match="model_type='mistral'"):
        Architecture.from_hf_config(config)
    with pytest.raises(ValueError, match="use_sliding_window"):
        Architecture.from_hf_config(_config(Qwen2Config, False, use_sliding_window=True, sliding_window=16))


def test_tensor_parallel_size_must_split_heads_vocab_and_mlp():
    arch = Architecture.from_hf_config(_config(LlamaConfig, True))
    arch.check_tensor_parallel(2)
    with pytest.raises(ValueError, match="num_key_value_heads=2 is not divisible by tensor_model_parallel_size=4"):
        arch.check_tensor_parallel(4)
    with pytest.raises(ValueError, match="tensor_model_parallel_size=0"):
        arch.check_tensor_parallel(0)


def test_missing_hf_tensor_is_named():
    model = LlamaForCausalLM(_config(LlamaConfig, False))
    state = model.state_dict()
    del state["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        hf_to_mcore(state, Architecture.from_hf_config(model.config))


@pytest.mark.parametrize("tied", [True, False])
def test_pipeline_stages_hold_each_hf_tensor_once_with_global_layer_names(tied):
    from lightning_grpo.strategies.megatron.convert import hf_shapes, pipeline_param_maps
    from lightning_grpo.strategies.megatron.model import stage_layout

    arch = Architecture.from_hf_config(_config(Qwen2Config, tied, num_hidden_layers=4))
    model = Qwen2ForCausalLM(_config(Qwen2Config, tied, num_hidden_layers=4))
    first, last = (param_maps(arch, stage=stage_layout(arch, 2, s)) for s in (0, 1))
    assert (first[0].mcore, first[0].hf) == ("embedding.word_embeddings.weight", ("model.embed_tokens.weight",))
    assert [pm.hf[0] for pm in last if pm.mcore == "decoder.layers.0.self_attention.linear_proj.weight"] == [
        "model.layers.2.self_attn.o_proj.weight"]  # stage 1's local layer 0 is the model's layer 2
    output = [pm for pm in last if pm.mcore == "output_layer.weight"]
    assert [(pm.hf, pm.copy) for pm in output] == [(("model.embed_tokens.weight",), True) if tied
                                                   else (("lm_head.weight",), False)]
    exported = [(s, name) for s, pm in pipeline_param_maps(arch, pp_size=2) for name in pm.hf]
    names = [name for _, name in exported]
    expected = {k for k in model.state_dict() if not (tied and k == "lm_head.weight")}
    assert len(names) == len(set(names)) and set(names) == expected  # every tensor once, the tied copy left out
    assert {s for s, name in exported if "layers.1." in name} == {0}
    assert {s for s, name in exported if name == "model.norm.weight"} == {1}
    shapes = hf_shapes(arch)
    assert all(tuple(v.shape) == shapes[k] for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match="num_hidden_layers=4 is not divisible by pipeline_model_parallel_size=3"):
        stage_layout(arch, 3, 0)
