"""Prompt encoding for rollouts: raw strings and chat-message lists to token ids, with exactly the BOS the model
was trained with.

The rule (docs/algorithm.md, "Prompts"):

* A tokenizer that puts BOS in front of raw text (``tokenizer("", add_special_tokens=True)`` starts with
  ``bos_token_id``: Llama, Gemma, Mistral) gives every prompt exactly one leading BOS, whether it is a string
  (encoded without special tokens, then BOS prepended, so no EOS or other suffix a tokenizer may add) or messages
  (the chat template's output, BOS prepended when the template does not write it, a doubled one dropped).
* Any other tokenizer (SmolLM2, Qwen) encodes a string as its bare tokens and messages as the chat template
  writes them; a leading BOS is never doubled.
* Left truncation to ``max_prompt_length`` keeps that leading BOS when the tokenizer adds BOS (the prompt keeps its
  first token and loses the oldest ones after it): a Llama/Gemma model conditioned without BOS is out of its
  training distribution. Other tokenizers' prompts lose their oldest tokens, whatever they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional, Sequence

from transformers import PreTrainedTokenizerBase


def adds_bos(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether ``tokenizer`` puts its BOS token in front of raw text (``add_special_tokens=True``)."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return False
    ids = tokenizer("", add_special_tokens=True)["input_ids"]
    return len(ids) > 0 and int(ids[0]) == int(bos)


def _chat_ids(tokenizer: PreTrainedTokenizerBase, messages: list, index: int,
              tools: Optional[list[dict]] = None) -> list[int]:
    if getattr(tokenizer, "chat_template", None) is None:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(
            f"prompts[{index}] is a list of chat messages, but the tokenizer {name!r} has no chat template: set "
            "tokenizer.chat_template (a Jinja template, e.g. from the instruct version of the model) or give the "
            "prompts as raw strings"
        )
    extra = {} if tools is None else {"tools": tools}
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **extra)
    if isinstance(ids, Mapping) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def image_parts(prompt: Any) -> list[tuple[int, int]]:
    """The ``(message, part)`` positions of a chat-message prompt's image parts (``{"type": "image", ...}`` in a
    content list, TRL's format; docs/vision.md), in order; none for a string."""
    if isinstance(prompt, str) or not isinstance(prompt, Sequence):
        return []
    found = []
    for m, message in enumerate(prompt):
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):
            found += [(m, p) for p, part in enumerate(content) if isinstance(part, Mapping)
                      and part.get("type") == "image"]
    return found


def refuse_images(prompts: Sequence[Any]) -> None:
    """Refuse prompts with images for a policy without an image encoder (a causal LM): the chat template would
    drop them, or fail on the list content, and the model would be trained on the prompt without its pictures.

    Raises:
        ValueError: the first prompt with an image part (its index, message and part named).
    """
    for index, prompt in enumerate(prompts):
        parts = image_parts(prompt)
        if parts:
            m, p = parts[0]
            raise ValueError(
                f"prompts[{index}] has {len(parts)} image part(s) (message {m} part {p} is {{'type': 'image'}}), but "
                "the policy is not a vision-language model (it has no image processor): its images would be "
                "dropped. Train a vision-language checkpoint (docs/vision.md) or give prompts without image parts "
                "(PromptDataModule(image_field=None))")


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, prompt: Any, index: int = 0, with_bos: Optional[bool] = None,
    tools: Optional[list[dict]] = None,
) -> list[int]:
    """Token ids of one prompt (a string or a list of ``{"role", "content"}`` messages), BOS as in the module
    docstring, not truncated. ``with_bos``: whether a leading BOS is required; None = :func:`adds_bos`. ``tools``: JSON
    schemas of tools the chat template renders (``apply_chat_template(tools=...)``; messages only).

    Raises:
        ValueError: messages with a tokenizer that has no chat template, or an empty message list.
        TypeError: a prompt that is neither a string nor a list of message mappings.
    """
    if isinstance(prompt, str):
        ids = [int(t) for t in tokenizer(prompt, add_special_tokens=False)["input_ids"]]
    elif isinstance(prompt, Sequence) and all(isinstance(m, Mapping) for m in prompt):
        if len(prompt) == 0:
            raise ValueError(f"prompts[{index}] is an empty list of chat messages")
        ids = _chat_ids(tokenizer, list(prompt), index, tools)
    else:
        raise TypeError(
            f"prompts[{index}] must be a string or a list of chat messages (dicts with 'role' and 'content'), "
            f"got {type(prompt).__name__}"
        )
    bos = tokenizer.bos_token_id
    if bos is None:
        return ids
    bos = int(bos)
    while len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    if (adds_bos(tokenizer) if with_bos is None else with_bos) and (not ids or ids[0] != bos):
        ids = [bos] + ids
    return ids


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[Any], max_prompt_length: int,
    tools: Optional[list[dict]] = None,
) -> tuple[list[list[int]], int]:
    """Encode rollout prompts: strings as text, message lists through the chat template
    (``apply_chat_template(add_generation_prompt=True)``), with exactly the BOS the model expects (one when the
    tokenizer adds BOS to raw text, never two), then left-truncated to ``max_prompt_length`` tokens (keeping
    that leading BOS).

    Args:
        tokenizer: the policy's tokenizer.
        prompts: strings or lists of ``{"role": ..., "content": ...}`` messages (may be mixed).
        max_prompt_length: most tokens per prompt (>= 1).
        tools: JSON schemas of tools for the chat template to render (message-list prompts), or None.

    Returns:
        ``(ids, num_truncated)``: one token-id list per prompt, and how many prompts were left-truncated.

    Raises:
        ValueError: ``max_prompt_length < 1``; a message list with a tokenizer without chat template.
        TypeError: a prompt of another type.
    """
    if max_prompt_length < 1:
        raise ValueError(f"max_prompt_length={max_prompt_length} must be >= 1")
    with_bos = adds_bos(tokenizer)
    encoded: list[list[int]] = []
    truncated = 0
    for index, prompt in enumerate(prompts):
        ids = encode_prompt(tokenizer, prompt, index, with_bos, tools)
        if len(ids) > max_prompt_length:
            truncated += 1
            if with_bos and max_prompt_length >= 2:  # ids[0] is the BOS
                ids = ids[:1] + ids[len(ids) - (max_prompt_length - 1) :]
            else:
                ids = ids[len(ids) - max_prompt_length :]
        encoded.append(ids)
    return encoded, truncated


class TemplatePrompts:
    """The single-turn prompt encoding (a :class:`~lightning_grpo.protocols.sampler.PromptEncoder`):
    :func:`encode_prompts` with ``tokenizer``, strings as text and message lists through its chat template.

    Args:
        tokenizer: the policy's tokenizer.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer

    def encode_prompts(self, prompts: Sequence[Any], max_prompt_length: int) -> tuple[list[list[int]], int]:
        """:func:`encode_prompts`: ``(ids, num_truncated)``; raises as it."""
        return encode_prompts(self.tokenizer, prompts, max_prompt_length)
