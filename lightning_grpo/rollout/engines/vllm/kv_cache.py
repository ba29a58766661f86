"""The size of a CPU vLLM engine's KV cache for one rollout (``GRPOConfig.engine.kv_cache_space_gib="auto"``).

A rollout of P prompts with G completions each holds at most ``P * G`` sequences of ``max_prompt_length +
max_new_tokens`` tokens; vLLM's CPU backend allocates the cache in blocks of :data:`CPU_BLOCK_SIZE` tokens, and
each token of each attention layer stores a key and a value of ``num_key_value_heads * head_dim`` elements:

    bytes = P * G * ceil(tokens / block) * block * 2 * layers * kv_heads * head_dim * dtype bytes

(SmolLM2-135M in float32: 45 KiB per token; 16 sequences of 768 tokens: 0.53 GiB instead of a fixed 2 GiB). A
smaller cache than this is still correct (vLLM then runs fewer sequences at once); at least one sequence of
``max_model_len`` tokens must fit, which this always gives.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

from lightning_grpo.config import GRPOConfig

log = logging.getLogger(__name__)

#: vLLM's CPU attention block size when none is given (``vllm/platforms/cpu.py``).
CPU_BLOCK_SIZE = 128


def kv_bytes_per_token(config: Any, dtype_bytes: int) -> int:
    """Bytes of the keys and values of one token over all layers, from a transformers ``PretrainedConfig``."""
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return 2 * int(text.num_hidden_layers) * kv_heads * head_dim * int(dtype_bytes)


def rollout_kv_cache_bytes(config: Any, dtype_bytes: int, sequences: int, sequence_tokens: int,
                           block_size: int = CPU_BLOCK_SIZE) -> int:
    """Bytes of KV cache that ``sequences`` sequences of ``sequence_tokens`` tokens occupy at once (module docstring).

    Raises:
        ValueError: ``sequences < 1`` or ``sequence_tokens < 1``.
    """
    if sequences < 1 or sequence_tokens < 1:
        raise ValueError(f"sequences={sequences} and sequence_tokens={sequence_tokens} must be >= 1")
    blocks = math.ceil(sequence_tokens / block_size)
    return sequences * blocks * block_size * kv_bytes_per_token(config, dtype_bytes)


def kv_cache_space_gib(config: GRPOConfig, model_config: Any, dtype_bytes: int,
                       rollout_prompts: Optional[int]) -> float:
    """``config.engine.kv_cache_space_gib``; "auto": one rollout's sequences at their longest
    (:func:`rollout_kv_cache_bytes`), 2 GiB when the prompts per rollout are unknown."""
    if config.engine.kv_cache_space_gib != "auto":
        return float(config.engine.kv_cache_space_gib)
    if rollout_prompts is None:
        log.info("engine.kv_cache_space_gib='auto' without the prompts per rollout: 2 GiB")
        return 2.0
    tokens = config.max_prompt_length + max(config.max_new_tokens, config.eval.max_new_tokens or 0)
    size = rollout_kv_cache_bytes(model_config, dtype_bytes, rollout_prompts * config.num_generations, tokens) / 2**30
    log.info("engine.kv_cache_space_gib='auto': %.3f GiB for %d sequences of %d tokens", size,
             rollout_prompts * config.num_generations, tokens)
    return size
