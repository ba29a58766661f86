"""The architecture matrix's tiny random models: one table, :data:`ARCHITECTURES`, of the causal-LM families users
bring (Llama, Qwen2.5, Qwen3, Qwen3-MoE, OLMoE, Gemma 3, Mistral, Phi-3, GPT-OSS, Qwen3.5), each a transformers
config class and its keyword arguments, and one builder, :func:`save_tiny_architecture` (random weights, seed 0,
float32, with a tokenizer such as SmolLM2's cut to its first 2,048 tokens:
:func:`~lightning_grpo.demos.tiny_models.save_tiny_tokenizer`).

Every model has hidden size 64, two decoder layers and attention heads of 32 (vLLM's CPU attention takes head sizes
32 to 128 in steps of 16; 16 fails), so that every cell of the matrix (docs/models.md) runs in seconds. Each keeps
its family's quirks: Qwen2.5's attention biases and tied head, Qwen3's q/k norms, Gemma 3's sliding and global
layers, scaled embeddings and final-logit soft-capping (on here, at 1.0: the tiny model's logits have a standard
deviation of ~0.2, so the cap bends them as Gemma 2's 30 bends a real model's), Phi-3's fused ``qkv_proj`` /
``gate_up_proj``, GPT-OSS's attention sinks, sliding layers and clamped SwiGLU experts, Qwen3.5's hybrid stack whose
first layer is Gated DeltaNet linear attention (the second is full attention), and the mixtures of experts'
routers, initialized N(0, 1) (random routers of std 0.02 tie within float noise).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Union

#: The attention shape every tiny architecture shares: 2 query heads of 32 over 1 key/value head (grouped-query).
_ATTENTION = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=2048)


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One row of the matrix: a family's transformers config and what the matrix's tests read of it.

    Attributes:
        name: the matrix's name of the family ("llama", "qwen2.5", ...), a key of :data:`ARCHITECTURES`.
        title: its name in docs/models.md.
        config_class: the ``transformers`` config class (its ``model_type`` picks ``AutoModelForCausalLM``'s class).
        config: the config's keyword arguments besides the vocabulary and the special token ids.
        lora_targets: the recommended LoRA ``target_modules``: the attention projections of every decoder layer
            (a hybrid's linear-attention layers have their own names), never the fused experts.
        routers: the name ending of the routers' weights of a mixture of experts (initialized N(0, 1)), "" for a
            dense model.
    """

    name: str
    title: str
    config_class: str
    config: dict[str, Any]
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    routers: str = ""


_TABLE = (
    Architecture("llama", "Llama", "LlamaConfig",
                 dict(_ATTENTION, intermediate_size=128, head_dim=32, tie_word_embeddings=False)),
    Architecture("qwen2.5", "Qwen2.5", "Qwen2Config",
                 dict(_ATTENTION, intermediate_size=128, tie_word_embeddings=True)),  # q/k/v biases, tied head
    Architecture("qwen3", "Qwen3", "Qwen3Config",
                 dict(_ATTENTION, intermediate_size=128, head_dim=32, tie_word_embeddings=False)),
    Architecture("qwen3_moe", "Qwen3-MoE", "Qwen3MoeConfig",
                 dict(_ATTENTION, intermediate_size=128, moe_intermediate_size=64, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True, head_dim=32, tie_word_embeddings=False),
                 routers="mlp.gate.weight"),
    Architecture("olmoe", "OLMoE", "OlmoeConfig",
                 dict(_ATTENTION, intermediate_size=64, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                      tie_word_embeddings=False),
                 routers="mlp.gate.weight"),
    Architecture("gemma3", "Gemma 3", "Gemma3TextConfig",
                 dict(_ATTENTION, intermediate_size=128, head_dim=32, query_pre_attn_scalar=32, sliding_window=8,
                      layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=1.0,
                      tie_word_embeddings=True)),
    Architecture("mistral", "Mistral", "MistralConfig",
                 dict(_ATTENTION, intermediate_size=128, head_dim=32, tie_word_embeddings=False)),
    Architecture("phi3", "Phi-3", "Phi3Config",
                 dict(_ATTENTION, intermediate_size=128, tie_word_embeddings=False),
                 lora_targets=("qkv_proj", "o_proj")),
    Architecture("gpt_oss", "GPT-OSS", "GptOssConfig",
                 dict(_ATTENTION, intermediate_size=64, head_dim=32, num_local_experts=4, num_experts_per_tok=2,
                      sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                      max_position_embeddings=131072, tie_word_embeddings=False),  # YaRN x32 of 4,096
                 routers="mlp.router.weight"),
    Architecture("qwen3.5", "Qwen3.5 (hybrid)", "Qwen3_5TextConfig",
                 dict(_ATTENTION, intermediate_size=128, head_dim=32, linear_num_key_heads=2,
                      linear_num_value_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
                      layer_types=["linear_attention", "full_attention"], tie_word_embeddings=False),
                 lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj")),
)

#: The matrix's architectures by name, in docs/models.md's order.
ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in _TABLE}


def save_tiny_architecture(dest: Union[str, os.PathLike], tokenizer_path: Union[str, os.PathLike], name: str, *,
                           vocab_size: Union[int, None] = None) -> str:
    """Save the tiny random model of the architecture ``name`` (:data:`ARCHITECTURES`; float32, seed 0, routers
    N(0, 1)) with the tokenizer at ``tokenizer_path`` (its vocabulary, BOS/EOS/pad ids; ``vocab_size``: cut to its
    first ``vocab_size`` tokens first) into ``dest``, loadable by ``AutoModelForCausalLM`` and vLLM alike. Returns
    ``dest`` as a str.

    Raises:
        ValueError: an unknown ``name`` (the architectures are named).
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lightning_grpo.demos.tiny_models import save_tiny_tokenizer

    if name not in ARCHITECTURES:
        raise ValueError(f"name={name!r} is invalid: choose one of {list(ARCHITECTURES)}")
    architecture = ARCHITECTURES[name]
    if vocab_size is not None:
        tokenizer_path = save_tiny_tokenizer(tokenizer_path, dest, vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    config = getattr(transformers, architecture.config_class)(
        **architecture.config, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    if architecture.routers:
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if param_name.endswith(architecture.routers):
                    param.normal_(0.0, 1.0)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(dest))
    tokenizer.save_pretrained(str(dest))
    return str(dest)
