"""``engine.kv_cache_space_gib="auto"``: the CPU KV cache sized to one rollout, golden numbers, and a
vLLM engine that starts and generates with a fractional cache of that size."""

import importlib.util

import pytest
from transformers import AutoConfig

from lightning_grpo import EngineConfig, GRPOConfig
from lightning_grpo.rollout.engines.vllm.kv_cache import kv_bytes_per_token, kv_cache_space_gib, rollout_kv_cache_bytes


def test_smollm2_kv_cache_golden(smollm2_path):
    config = AutoConfig.from_pretrained(smollm2_path)
    # 30 layers x (key + value) x 3 KV heads x head_dim 64 x 4 bytes (float32)
    assert kv_bytes_per_token(config, 4) == 30 * 2 * 3 * 64 * 4 == 46_080
    # 16 sequences of 512 + 256 = 768 tokens = 6 blocks of 128: 16 x 768 x 46,080 bytes = 0.527 GiB
    assert rollout_kv_cache_bytes(config, 4, 16, 768) == 16 * 768 * 46_080
    assert rollout_kv_cache_bytes(config, 4, 1, 769) == 896 * 46_080  # rounded up to whole blocks
    cfg = GRPOConfig(num_generations=8, max_prompt_length=512, max_new_tokens=256)
    assert kv_cache_space_gib(cfg, config, 4, rollout_prompts=2) == pytest.approx(16 * 768 * 46_080 / 2**30)
    assert kv_cache_space_gib(cfg, config, 4, rollout_prompts=None) == 2.0  # prompts per rollout unknown
    assert kv_cache_space_gib(GRPOConfig(engine=EngineConfig(kv_cache_space_gib=0.5)), config, 4, 2) == 0.5
    with pytest.raises(ValueError, match="sequences=0"):
        rollout_kv_cache_bytes(config, 4, 0, 10)


def test_config_checks_the_kv_cache_size():
    assert GRPOConfig().engine.kv_cache_space_gib == "auto"
    with pytest.raises(ValueError, match=r"engine.kv_cache_space_gib=0 is invalid: must be > 0 \(GiB\) or 'auto'"):
        EngineConfig(kv_cache_space_gib=0)


@pytest.mark.slow  # starts a vLLM engine
@pytest.mark.engine
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_vllm_generates_with_an_auto_sized_fractional_cache(tiny_llama_path):
    from lightning_grpo.protocols.sampling import SamplingConfig
    from lightning_grpo.rollout.engines.vllm.colocated import VLLMRolloutEngine

    config = AutoConfig.from_pretrained(tiny_llama_path)
    gib = rollout_kv_cache_bytes(config, 4, 4, 64 + 16) / 2**30  # 4 sequences of 80 tokens: 0.25 MiB
    assert gib < 0.001
    engine = VLLMRolloutEngine(tiny_llama_path, kv_cache_space_gib=gib, max_model_len=80, dtype="float32", seed=0)
    try:
        out = engine.generate([[1, 2, 3], [4, 5]], 2, SamplingConfig(max_new_tokens=16, temperature=1.0, seed=0))
    finally:
        engine.close()
    assert out.completion_ids.shape[0] == 4 and out.completion_mask.sum() > 0
