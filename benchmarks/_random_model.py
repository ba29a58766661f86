"""A random Qwen2-shaped policy and a byte-level BPE tokenizer, built from code alone (no hub, no file to carry).

The GPU benchmark (``benchmarks/gpu.py``) runs on a machine that can fetch nothing, so its model is made there:

* ``"random-0.5b"``: the shape of Qwen2.5-0.5B-Instruct (Qwen Team 2024, the model's ``config.json``): 24 layers,
  hidden 896, 14 attention heads of 64, 2 KV heads, MLP 4,864, RMSNorm eps 1e-6, RoPE theta 1e6, tied embeddings,
  a vocabulary of 151,936 rows of which the tokenizer uses the first 151,646 (Qwen2.5's is 151,665: the rest are
  padding rows, as there). 494,032,768 parameters; saved in bfloat16 (about 0.99 GB), as that checkpoint is.
* ``"random-tiny"``: 2 layers, hidden 64, 2 heads of 32, 1 KV head, MLP 128, a vocabulary of 1,024 (the dry run
  on a CPU; same code, same tokenizer recipe).

Weights: transformers' own initialisation of ``Qwen2ForCausalLM`` (normal, std 0.02), ``torch.manual_seed(seed)``.
A random policy almost never samples EOS, so its completions run to ``max_new_tokens``: a step's work is set by the
settings, not by what the model happens to write.

The tokenizer: ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n``, the generation prompt
``<|im_start|>assistant\\n``), eos ``<|im_end|>``, pad ``<|endoftext|>``, as Qwen2.5's. Its byte-level BPE merges
are first those that ``tokenizers``' ``BpeTrainer`` learns from the arithmetic task's prompts and answers
(:mod:`lightning_grpo.data.synthetic`, level 4; at most 4,096 tokens), then filler merges (each token so far with each
byte, in id order) up to the vocabulary's size, so that every id the policy samples decodes to text and the
benchmark's prompts take about as many tokens as with a trained tokenizer (checked by the tests).
"""

from __future__ import annotations

import json
import os
from typing import Any, Union

#: Qwen2Config fields of each size (the rest are Qwen2Config's defaults); ``tokenizer_size`` <= ``vocab_size``.
SIZES: dict[str, dict[str, Any]] = {
    "random-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                        num_key_value_heads=2, vocab_size=151936, tokenizer_size=151646, max_position_embeddings=32768,
                        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, dtype="bfloat16"),
    "random-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, vocab_size=1024, tokenizer_size=1024, max_position_embeddings=2048,
                        rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, dtype="float32"),
}
#: The special tokens, last in the vocabulary as in Qwen2.5's (pad, start of a turn, end of a turn = eos).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
#: Most merges learned from the corpus (the rest of the vocabulary is filler).
TRAINED_VOCAB = 4096


def corpus() -> list[str]:
    """The tokenizer's training text: the arithmetic task's chat-formatted prompts and worked answers (level 4, 2,000
    questions, seed 0) under the default system prompt."""
    from lightning_grpo.data.presets import DEFAULT_SYSTEM_PROMPT
    from lightning_grpo.data.synthetic import ARITHMETIC_INSTRUCTION, FEWSHOT, arithmetic_rows

    rows = arithmetic_rows(train_size=2000, test_size=0, seed=0, level=4)["train"]
    texts = [DEFAULT_SYSTEM_PROMPT, *(m["content"] for m in FEWSHOT)]
    for row in rows:
        question, answer = row["question"], row["answer"]
        texts.append(ARITHMETIC_INSTRUCTION.format(question=question))
        texts.append(f"{question.removeprefix('What is ').rstrip('?')} = {answer}\n#### {answer}")
    return texts


def build_tokenizer(size: int) -> Any:
    """A ``PreTrainedTokenizerFast`` of exactly ``size`` tokens (``size - 3`` byte-level BPE tokens, then
    :data:`SPECIAL_TOKENS`) with the ChatML template (see the module docstring).

    Raises:
        ValueError: ``size`` is below 512 (the 256 byte symbols and room for merges).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if size < 512:
        raise ValueError(f"tokenizer size={size}: needs at least 512 tokens (256 byte symbols and merges)")
    regular = size - len(SPECIAL_TOKENS)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(regular, TRAINED_VOCAB), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus(), trainer)
    data = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    merges: list = data["model"]["merges"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = sorted(vocab, key=vocab.__getitem__)
    index = 0
    while len(vocab) < regular:  # filler: each token so far with each byte, in id order
        for byte in alphabet:
            candidate = tokens[index] + byte
            if candidate not in vocab and len(vocab) < regular:
                vocab[candidate] = len(vocab)
                tokens.append(candidate)
                merges.append([tokens[index], byte])
        index += 1
    data["added_tokens"] = [
        {"id": regular + i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, token in enumerate(SPECIAL_TOKENS)
    ]
    tokenizer = Tokenizer.from_str(json.dumps(data))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)


def model_config(size: str, eos_token_id: int, pad_token_id: int) -> Any:
    """The ``Qwen2Config`` of ``size`` (:data:`SIZES`) with these special token ids.

    Raises:
        ValueError: an unknown ``size`` (the known ones are named).
    """
    from transformers import Qwen2Config

    if size not in SIZES:
        raise ValueError(f"model size={size!r}: choose one of {sorted(SIZES)}")
    fields = {k: v for k, v in SIZES[size].items() if k not in ("tokenizer_size", "dtype")}
    return Qwen2Config(**fields, bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=pad_token_id)


def save_random_model(dest: Union[str, os.PathLike], size: str = "random-0.5b", seed: int = 0) -> dict[str, Any]:
    """Build the random policy ``size`` (:data:`SIZES`) and its tokenizer and save both into ``dest`` (weights in
    ``SIZES[size]["dtype"]``).

    Returns:
        ``{"path": dest, "size": size, "parameters": int, **SIZES[size]}``.

    Raises:
        ValueError: an unknown ``size`` (the known ones are named).
    """
    import torch
    from transformers import Qwen2ForCausalLM

    if size not in SIZES:
        raise ValueError(f"model size={size!r}: choose one of {sorted(SIZES)}")
    tokenizer = build_tokenizer(SIZES[size]["tokenizer_size"])
    eos, pad = tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(model_config(size, eos, pad)).to(getattr(torch, SIZES[size]["dtype"]))
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = pad
    model.save_pretrained(str(dest))
    tokenizer.save_pretrained(str(dest))
    parameters = sum(p.numel() for p in model.parameters())
    return {"path": str(dest), "size": size, "parameters": parameters, **SIZES[size]}
