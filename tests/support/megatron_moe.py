"""Mixture-of-experts helpers shared by the Megatron MoE tests (in this process) and their torchrun worker
(``tests/support/megatron_moe_worker.py``): tiny random Qwen3-MoE / Mixtral checkpoints (with dense layers between
the mixtures and random norms, which :func:`lightning_grpo.demos.tiny_models.save_tiny_moe` does not make), and an
Experience carrying the routing an HF forward pass chooses for each token (``prompt_routed_experts``,
``completion_routed_experts``), as a rollout under ``GRPOConfig.routing_replay="R3"`` records it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from lightning_grpo.protocols.routing import ROUTED_DTYPE, mask_routed
from lightning_grpo.training.experience import Experience


def save_tiny_moe(root: str, tokenizer_path: str, model_type: str = "qwen3_moe", vocab_size: int = 2048,
                  num_hidden_layers: int = 2, mlp_only_layers: tuple[int, ...] = ()) -> str:
    """A tiny random mixture of experts with SmolLM2's tokenizer cut to ``vocab_size`` tokens, saved into ``root``:
    hidden 64, 4 query heads of 16, 2 key/value heads, 4 experts of inner size 32, top-2 routing; Qwen3-MoE
    (``norm_topk_prob=True``, per-head q/k norms, ``mlp_only_layers`` dense layers of size 96) or Mixtral. Routers are
    drawn N(0, 1) (the families' initializations of std 0.02 or 0 tie within float noise) and the norms near 1."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, MixtralConfig, Qwen3MoeConfig

    from lightning_grpo.demos.tiny_models import save_tiny_tokenizer

    save_tiny_tokenizer(tokenizer_path, root, vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(root)
    common = dict(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=num_hidden_layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts_per_tok=2,
                  max_position_embeddings=512, tie_word_embeddings=False, rms_norm_eps=1e-6,
                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    if model_type == "qwen3_moe":
        config: Any = Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                                     norm_topk_prob=True, mlp_only_layers=list(mlp_only_layers))
    else:
        config = MixtralConfig(**common, intermediate_size=32, num_local_experts=4)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.normal_(0.0, 1.0)
            elif "norm" in name:
                param.normal_(1.0, 0.1)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


def experience(pad_id: int, rows: int = 3, seed: int = 0) -> Experience:
    """``rows`` rows (3: left-padded prompts of lengths 5, 3, 4, right-padded completions of lengths 4, 2, 3) of
    ids in [200, 2000)."""
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1], [0, 1, 1, 1, 1]] * 2)[:rows]
    completion_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]] * 2)[:rows]
    prompt_ids = torch.randint(200, 2000, prompt_mask.shape, generator=g)
    completion_ids = torch.randint(200, 2000, completion_mask.shape, generator=g)
    prompt_ids[prompt_mask == 0] = pad_id
    completion_ids[completion_mask == 0] = pad_id
    return Experience(prompt_ids, prompt_mask, completion_ids, completion_mask, torch.zeros(rows))


@torch.no_grad()
def hf_routing(hf: Any, batch: Experience) -> Experience:
    """``batch`` with the experts the HF model's routers choose for each real token in a left-padded forward pass
    (position ids from the mask, as the sampler's), -1 on padding, ``int16``: what a rollout records."""
    input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)
    chosen: list[Tensor] = []
    handles = [layer.mlp.gate.register_forward_hook(lambda m, a, out: chosen.append(out[2]))
               for layer in hf.model.layers if hasattr(layer.mlp, "gate")]
    try:
        hf(input_ids=input_ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0))
    finally:
        for handle in handles:
            handle.remove()
    routing = torch.stack([c.view(*input_ids.shape, -1) for c in chosen], dim=2)  # [B, P+T, layers, k]
    routing = mask_routed(routing.to(ROUTED_DTYPE), mask)
    p = batch.prompt_ids.shape[1]
    return dataclasses.replace(batch, prompt_routed_experts=routing[:, :p].clone(),
                               completion_routed_experts=routing[:, p:].clone())
