"""A testing helper shipped with the package: tiny random Llamas with a real tokenizer, for tests and benchmarks of
the training mechanics (never a model to train for real)."""

from __future__ import annotations

import os
from typing import Union


def save_tiny_llama(
    dest: Union[str, os.PathLike],
    tokenizer_path: Union[str, os.PathLike],
    *,
    hidden_size: int,
    intermediate_size: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    head_dim: int,
    tie_word_embeddings: bool,
    num_hidden_layers: int = 2,
) -> str:
    """Save a tiny random Llama (float32, seed 0) with the tokenizer at ``tokenizer_path`` into ``dest`` (its
    vocabulary, BOS/EOS/pad ids) for tests and benchmarks of the training mechanics. Returns ``dest`` as a str.
    vLLM's CPU attention needs ``head_dim`` in 32, 64, 80, ... (16 fails)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=2048,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(dest))
    tokenizer.save_pretrained(str(dest))
    return str(dest)


def save_tiny_reward_model(dest: Union[str, os.PathLike], tokenizer_path: Union[str, os.PathLike], *,
                           hidden_size: int = 64, num_hidden_layers: int = 2, seed: int = 0) -> str:
    """Save a tiny random reward model, a ``LlamaForSequenceClassification`` with one label (float32, ``seed``),
    with the tokenizer at ``tokenizer_path`` (its vocabulary, chat template and pad id) into ``dest``, for tests of
    :class:`lightning_grpo.rewards.reward_model.RewardModel`. Returns ``dest`` as a str."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=2, num_key_value_heads=1,
        head_dim=hidden_size // 2, max_position_embeddings=2048, num_labels=1,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(config).to(torch.float32)
    with torch.no_grad():  # a random head of std 0.02 gives scores ~1e-2 apart: widen it so they differ clearly
        model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(str(dest))
    tokenizer.save_pretrained(str(dest))
    return str(dest)
