"""A testing helper shipped with the package: tiny random vision-language models built from a config, with a local
image processor and SmolLM2's tokenizer plus the vision tokens (TRL's recipe for its tiny test models: 2 layers,
small hidden sizes), so tests and benchmarks of images in prompts never touch the hub. Never models to train for
real, except :func:`save_smol_llava` (SmolLM2 as the language model), the CPU recipe's (docs/vision.md).

The text sizes default to what vLLM's CPU attention takes (head dim 32); the image processors are transformers' PIL
ones (no torchvision).
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

#: A ChatML template (SmolLM2's and Qwen's turn format) whose user content may be a list of parts: a text part is
#: written as is, an image part as ``{image}`` (the family's placeholder, with its delimiters).
VISION_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{image}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

QWEN_VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def _tokenizer(tokenizer_path: Union[str, os.PathLike], dest: str, vocab_size: Optional[int], tokens: tuple,
               image: str) -> Any:
    from transformers import AutoTokenizer

    from lightning_grpo.demos.tiny_models import save_tiny_tokenizer

    if vocab_size is not None:
        tokenizer_path = save_tiny_tokenizer(tokenizer_path, dest, vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path))
    tokenizer.add_special_tokens({"additional_special_tokens": list(tokens)})
    tokenizer.chat_template = VISION_CHAT_TEMPLATE.replace("{image}", image)
    return tokenizer


def _text(tokenizer: Any, hidden_size: int, num_heads: int, head_dim: int, **extra: Any) -> dict:
    return dict(vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                num_hidden_layers=2, num_attention_heads=num_heads, num_key_value_heads=1, head_dim=head_dim,
                max_position_embeddings=2048, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, **extra)


def _save(model: Any, tokenizer: Any, processor: Any, dest: str) -> str:
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
    processor.save_pretrained(dest)
    if model.config.model_type == "llava":  # LlavaProcessor's own settings too (vLLM and AutoProcessor read them)
        from transformers import LlavaProcessor

        vision = model.config.vision_config
        LlavaProcessor(image_processor=processor, tokenizer=tokenizer, patch_size=vision.patch_size,
                       vision_feature_select_strategy=model.config.vision_feature_select_strategy,
                       chat_template=tokenizer.chat_template, num_additional_image_tokens=1).save_pretrained(dest)
    return dest


def save_tiny_qwen_vl(dest: Union[str, os.PathLike], tokenizer_path: Union[str, os.PathLike], *, version: str = "2.5",
                      vocab_size: Optional[int] = 2048, hidden_size: int = 64, num_heads: int = 2, head_dim: int = 32,
                      max_pixels: int = 56 * 56 * 4, seed: int = 0) -> str:
    """Save a tiny random Qwen2.5-VL (``version="2.5"``) or Qwen3-VL (``"3"``) into ``dest`` (float32, ``seed``):
    text 2 layers (``hidden_size``, ``num_heads`` heads of ``head_dim``, 1 KV head, mRoPE sections summing to
    ``head_dim / 2``), vision 2 blocks of hidden 32 (Qwen2.5: ``fullatt_block_indexes [1]``; Qwen3:
    ``deepstack_visual_indexes [1]``), with the tokenizer at ``tokenizer_path`` (cut to ``vocab_size``) plus
    ``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>`` and a ChatML chat template that
    writes an image as ``<|vision_start|><|image_pad|><|vision_end|>``; the image processor (PIL) takes images of
    ``56*56`` to ``max_pixels`` pixels (4 to 16 tokens at patch 14, merge 2). Returns ``dest``."""
    import torch
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    if version not in ("2.5", "3"):
        raise ValueError(f"version={version!r}: '2.5' or '3'")
    dest = str(dest)
    os.makedirs(dest, exist_ok=True)
    tokenizer = _tokenizer(tokenizer_path, dest, vocab_size, QWEN_VISION_TOKENS,
                           "<|vision_start|><|image_pad|><|vision_end|>")
    ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"))}
    half = head_dim // 2
    sections = [half - 2 * (half // 3), half // 3, half // 3]
    patch = 14 if version == "2.5" else 16
    processor = Qwen2VLImageProcessorPil(min_pixels=(2 * patch) ** 2, max_pixels=max_pixels, patch_size=patch,
                                         merge_size=2, temporal_patch_size=2)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": sections}
    torch.manual_seed(seed)
    if version == "2.5":
        from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

        config = Qwen2_5_VLConfig(
            text_config=_text(tokenizer, hidden_size, num_heads, head_dim, rope_parameters=rope),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden_size,
                               fullatt_block_indexes=[1], window_size=56, patch_size=14, spatial_merge_size=2,
                               temporal_patch_size=2),
            tie_word_embeddings=False, **ids)
        model: Any = Qwen2_5_VLForConditionalGeneration(config)
    else:
        from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

        rope["mrope_interleaved"] = True
        config = Qwen3VLConfig(
            text_config=_text(tokenizer, hidden_size, num_heads, head_dim, rope_parameters=rope),
            vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden_size,
                               deepstack_visual_indexes=[1], patch_size=16, spatial_merge_size=2,
                               temporal_patch_size=2, num_position_embeddings=64),
            tie_word_embeddings=False, **ids)
        model = Qwen3VLForConditionalGeneration(config)
    return _save(model.to(torch.float32), tokenizer, processor, dest)


def save_tiny_llava(dest: Union[str, os.PathLike], tokenizer_path: Union[str, os.PathLike], *,
                    vocab_size: Optional[int] = 2048, hidden_size: int = 64, num_heads: int = 2, head_dim: int = 32,
                    image_size: int = 56, patch_size: int = 14, vision_hidden: int = 32, vision_layers: int = 2,
                    seed: int = 0) -> str:
    """Save a tiny random LLaVA into ``dest`` (float32, ``seed``): a CLIP vision tower (``vision_layers`` layers of
    ``vision_hidden``, ``image_size`` square input, ``patch_size`` patches: ``(image_size / patch_size)**2`` image
    tokens), LLaVA's 2-layer projector, a 2-layer Llama (``hidden_size``, heads of ``head_dim``), with the tokenizer
    at ``tokenizer_path`` (cut to ``vocab_size``) plus ``<image>`` and the ChatML template writing an image as
    ``<image>``; the CLIP image processor (PIL) resizes and crops to ``image_size``. Returns ``dest``."""
    import torch
    from transformers import LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    dest = str(dest)
    os.makedirs(dest, exist_ok=True)
    tokenizer = _tokenizer(tokenizer_path, dest, vocab_size, ("<image>",), "<image>")
    processor, vision_config = _small_clip(image_size, patch_size, vision_hidden, vision_layers)
    config = LlavaConfig(
        vision_config=vision_config,
        text_config=LlamaConfig(**_text(tokenizer, hidden_size, num_heads, head_dim)),
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_select_strategy="default",
        vision_feature_layer=-1, projector_hidden_act="gelu", tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    return _save(model, tokenizer, processor, dest)


def _small_clip(image_size: int, patch_size: int, vision_hidden: int, vision_layers: int) -> tuple[Any, Any]:
    """The CLIP image processor (PIL: resize and crop to ``image_size``) and a small random CLIP vision config
    (``vision_layers`` layers of ``vision_hidden``, two heads) of the test LLaVAs."""
    from transformers import CLIPVisionConfig
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    processor = CLIPImageProcessorPil(size={"shortest_edge": image_size},
                                      crop_size={"height": image_size, "width": image_size})
    config = CLIPVisionConfig(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                              num_hidden_layers=vision_layers, num_attention_heads=2, image_size=image_size,
                              patch_size=patch_size, projection_dim=vision_hidden)
    return processor, config


def save_smol_llava(dest: Union[str, os.PathLike], smollm2_path: Union[str, os.PathLike], *, image_size: int = 28,
                    patch_size: int = 14, vision_hidden: int = 64, vision_layers: int = 1, seed: int = 0) -> str:
    """Save a LLaVA whose language model is the SmolLM2 checkpoint at ``smollm2_path`` (its weights, tokenizer and
    vocabulary, plus ``<image>``) and whose vision tower is a small random CLIP (``vision_layers`` layers of
    ``vision_hidden``, ``image_size`` input, ``(image_size / patch_size)**2`` image tokens) with a random projector:
    the CPU recipe's model (docs/vision.md), which learns to look by training the projector and LoRA on the
    language model. Returns ``dest``."""
    import torch
    from transformers import AutoModelForCausalLM, LlavaConfig, LlavaForConditionalGeneration

    dest = str(dest)
    os.makedirs(dest, exist_ok=True)
    tokenizer = _tokenizer(smollm2_path, dest, None, ("<image>",), "<image>")
    language = AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32)
    text_config = language.config
    text_config.vocab_size = len(tokenizer)
    processor, vision_config = _small_clip(image_size, patch_size, vision_hidden, vision_layers)
    config = LlavaConfig(
        vision_config=vision_config,
        text_config=text_config, image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        vision_feature_select_strategy="default", vision_feature_layer=-1, projector_hidden_act="gelu",
        tie_word_embeddings=bool(getattr(text_config, "tie_word_embeddings", False)))
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    language.resize_token_embeddings(len(tokenizer))
    missing = model.model.language_model.load_state_dict(language.model.state_dict(), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys
    with torch.no_grad():
        model.lm_head.weight.copy_(language.lm_head.weight)
    return _save(model, tokenizer, processor, dest)
