"""A testing helper shipped with the package: tiny random Llamas and mixtures of experts (Qwen3-MoE, OLMoE, Mixtral)
with a real tokenizer, for tests and benchmarks of the training mechanics (never a model to train for real).

A tiny Llama with SmolLM2's 49,152-token vocabulary spends about 97 % of each token's FLOPs in its output layer; with
``vocab_size`` its tokenizer is SmolLM2's cut to the first ``vocab_size`` tokens (:func:`save_tiny_tokenizer`: the
same special tokens, chat template and byte-level BPE, only fewer merges, so a text takes more, shorter tokens).
"""

from __future__ import annotations

import json
import os
from typing import Optional, Union


def save_tiny_tokenizer(tokenizer_path: Union[str, os.PathLike], dest: Union[str, os.PathLike], vocab_size: int) -> str:
    """Save the byte-level BPE tokenizer at ``tokenizer_path`` cut to its first ``vocab_size`` ids into ``dest``:
    every token with a smaller id, every merge whose parts and result are kept, the special tokens, the chat template
    and the other settings unchanged. Any text still encodes (the byte alphabet is kept) and decodes to itself.

    Raises:
        ValueError: the tokenizer is not a BPE whose ids ``0..vocab_size-1`` hold its special tokens and its whole
            byte alphabet, or ``vocab_size`` is not smaller than its vocabulary.
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    tokenizer.save_pretrained(str(dest))
    path = os.path.join(str(dest), "tokenizer.json")
    with open(path) as f:
        data = json.load(f)
    model = data["model"]
    if model.get("type") != "BPE" or not 0 < vocab_size < len(model["vocab"]):
        raise ValueError(f"vocab_size={vocab_size} is invalid: needs a BPE tokenizer.json with more than that many "
                         f"tokens ({model.get('type')}, {len(model.get('vocab', {}))} tokens at {tokenizer_path})")
    vocab = {token: i for token, i in model["vocab"].items() if i < vocab_size}
    special = [t for t in data.get("added_tokens", []) if t["id"] >= vocab_size]
    alphabet = {chr(c) for c in range(33, 127)}  # the printable ASCII bytes of a byte-level BPE alphabet
    if len(vocab) != vocab_size or special or not alphabet <= vocab.keys():
        raise ValueError(f"vocab_size={vocab_size} is invalid: the first {vocab_size} ids of {tokenizer_path} do not "
                         "hold every special token and the byte alphabet")

    def pair(merge: Union[str, list]) -> tuple[str, str]:
        a, b = merge.split(" ", 1) if isinstance(merge, str) else merge
        return a, b

    model["vocab"] = vocab
    model["merges"] = [m for m in model["merges"] if all(p in vocab for p in (*pair(m), "".join(pair(m))))]
    with open(path, "w") as f:
        json.dump(data, f, ensure_ascii=False)
    return str(dest)


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
    vocab_size: Optional[int] = None,
) -> str:
    """Save a tiny random Llama (float32, seed 0) with the tokenizer at ``tokenizer_path`` into ``dest`` (its
    vocabulary, BOS/EOS/pad ids) for tests and benchmarks of the training mechanics. Returns ``dest`` as a str.
    vLLM's CPU attention needs ``head_dim`` in 32, 64, 80, ... (16 fails). ``vocab_size``: the tokenizer cut to its
    first ``vocab_size`` tokens (:func:`save_tiny_tokenizer`); None keeps it whole."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if vocab_size is not None:
        tokenizer_path = save_tiny_tokenizer(tokenizer_path, dest, vocab_size)
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


#: The tiny mixture-of-experts families :func:`save_tiny_moe` builds: ``model_type`` -> (experts, whether the top-k
#: weights are renormalized). Qwen3-MoE renormalizes (``norm_topk_prob=True``, as Qwen3-30B-A3B), OLMoE does not
#: (``norm_topk_prob=False``, as OLMoE-1B-7B), Mixtral always does.
TINY_MOE_FAMILIES = {"qwen3_moe": (8, True), "olmoe": (4, False), "mixtral": (4, True)}


def save_tiny_moe(
    dest: Union[str, os.PathLike],
    tokenizer_path: Union[str, os.PathLike],
    model_type: str,
    *,
    hidden_size: int = 64,
    expert_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 1,
    top_k: int = 2,
    num_experts: Optional[int] = None,
    vocab_size: Optional[int] = None,
) -> str:
    """Save a tiny random mixture-of-experts causal LM (float32, seed 0) of family ``model_type`` ("qwen3_moe",
    "olmoe" or "mixtral": :data:`TINY_MOE_FAMILIES`) with the tokenizer at ``tokenizer_path`` into ``dest``, loadable
    by transformers and vLLM alike. Every decoder layer is a mixture of ``num_experts`` (default: the family's entry)
    experts of ``expert_size`` hidden units with top-``top_k`` routing; the attention heads have
    ``hidden_size // num_attention_heads`` dimensions (vLLM's CPU attention needs 32, 64, 80, ...: 16 fails). The
    routers are initialized N(0, 1) instead of the families' 0 or N(0, 0.02), so that a token's top-k experts are
    clearly ahead of the others (random routers of std 0.02 tie within float noise, and every test of routing would
    then test noise). ``vocab_size``: the tokenizer cut to its first ``vocab_size`` tokens
    (:func:`save_tiny_tokenizer`). Returns ``dest`` as a str.

    Raises:
        ValueError: an unknown ``model_type`` (the families are named).
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, MixtralConfig, OlmoeConfig, Qwen3MoeConfig

    if model_type not in TINY_MOE_FAMILIES:
        raise ValueError(f"model_type={model_type!r} is invalid: choose one of {sorted(TINY_MOE_FAMILIES)}")
    experts, normalized = TINY_MOE_FAMILIES[model_type]
    experts = num_experts or experts
    if vocab_size is not None:
        tokenizer_path = save_tiny_tokenizer(tokenizer_path, dest, vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    common = dict(vocab_size=len(tokenizer), hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
                  num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
                  num_experts_per_tok=top_k, max_position_embeddings=2048, tie_word_embeddings=False,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    config: object
    if model_type == "qwen3_moe":
        config = Qwen3MoeConfig(**common, intermediate_size=2 * expert_size, moe_intermediate_size=expert_size,
                                num_experts=experts, norm_topk_prob=normalized,
                                head_dim=hidden_size // num_attention_heads)
    elif model_type == "olmoe":
        config = OlmoeConfig(**common, intermediate_size=expert_size, num_experts=experts, norm_topk_prob=normalized)
    else:
        config = MixtralConfig(**common, intermediate_size=expert_size, num_local_experts=experts,
                               head_dim=hidden_size // num_attention_heads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # the routers of all three families
                param.normal_(0.0, 1.0)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(dest))
    tokenizer.save_pretrained(str(dest))
    return str(dest)
