"""The chat template's turn format for episodes: prompts with their tools, and each environment turn encoded once.

Token exactness (docs/multiturn.md): the trained sequence is the prompt's ids, then each model turn's *sampled* ids
(through the EOS the model sampled, never decoded and encoded again), then each environment turn's ids, and so on.
An environment turn is everything the chat template writes between the end of the model's turn (its EOS) and the
start of the model's next turn: for ChatML (SmolLM2, Qwen) ``"\\n<|im_start|>tool\\n{result}<|im_end|>\\n"`` followed
by the generation prompt ``"<|im_start|>assistant\\n"``. It is cut from the template's own rendering, as TRL does
(``GRPOTrainer._get_tool_suffix_ids``): the ids of ``[user, assistant, *observation]`` with the generation prompt
minus the ids of ``[user, assistant]`` up to and including the assistant turn's last EOS (where the template renders
that assistant turn differently once a message follows it, as Qwen3's does with its empty ``<think>`` block: what
follows the same number of EOS ids). So the separator the
template puts after the EOS (ChatML's ``"\\n"``, the token verl PR #6921 dropped) belongs to the environment turn,
and the concatenation equals ``apply_chat_template`` of the whole conversation wherever the template renders earlier
turns unchanged (tested for SmolLM2 and Qwen2.5's template).

Tools in the prompt: a template that renders ``tools`` (Qwen2.5, Qwen3, Hermes, Llama 3.1) gets them through
``apply_chat_template(tools=...)``; a template that ignores them (SmolLM2's: the rendering with and without tools is
the same) gets the parser's :meth:`~lightning_grpo.episodes.parsers.ToolCallParser.instructions` appended to the
system message (a system message is added when the prompt has none). Tool results use the template's ``tool`` role;
a template that rejects it or drops its content gets them as ``user`` turns wrapped in
``<tool_response>...</tool_response>`` (Qwen2.5's rendering of tool results).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Sequence

from transformers import PreTrainedTokenizerBase

from lightning_grpo.episodes.parsers import ToolCallParser
from lightning_grpo.rollout.prompts import encode_prompts

_PROBE = "lightning-grpo-probe-7f3a"


def _ids(value: Any) -> list[int]:
    if isinstance(value, Mapping) or hasattr(value, "keys"):
        value = value["input_ids"]
    return [int(t) for t in value]


class ChatFormat:
    """Prompt and environment-turn encoding of one tokenizer's chat template (see the module docstring).

    Args:
        tokenizer: the policy's tokenizer (with a chat template).
        eos_token_ids: the ids that end a model turn (the engine's).
        tool_schemas: JSON schemas of the tools the prompt describes ([] for none).
        parser: the tool-call format (its instructions describe the tools to templates that do not render them).

    Raises:
        ValueError: the tokenizer has no chat template.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: Sequence[int],
                 tool_schemas: Sequence[dict[str, Any]], parser: ToolCallParser) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("multi-turn episodes need a tokenizer with a chat template (the environment's turns are "
                             "rendered with it): set tokenizer.chat_template")
        self.tokenizer = tokenizer
        self.eos_token_ids = {int(i) for i in eos_token_ids}
        self.tool_schemas = [dict(s) for s in tool_schemas]
        self.parser = parser
        self.renders_tools = bool(self.tool_schemas) and self._renders_tools()
        self.tool_role = self._tool_role_works()

    # ------------------------------------------------------------------ probes of the template
    def _render(self, messages: list[dict], **kwargs: Any) -> str:
        return str(self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs))

    def _renders_tools(self) -> bool:
        """Whether the template writes the tools into the prompt (rendering with and without them differs)."""
        messages = [{"role": "user", "content": _PROBE}]
        with_tools = self._render(messages, add_generation_prompt=True, tools=self.tool_schemas)
        return with_tools != self._render(messages, add_generation_prompt=True)

    def _tool_role_works(self) -> bool:
        """Whether the template renders a ``tool`` message with its content (else the fallback user turn)."""
        messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                    {"role": "tool", "name": "probe", "content": _PROBE}]
        try:
            return _PROBE in self._render(messages, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - jinja's TemplateError and whatever a template raises for the role
            return False

    # ------------------------------------------------------------------ prompts
    def prompt_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` with the tools described in the system message when the template does not render them."""
        messages = [dict(m) for m in messages]
        if not self.tool_schemas or self.renders_tools:
            return messages
        text = self.parser.instructions(self.tool_schemas)
        if messages and messages[0].get("role") == "system":
            messages[0]["content"] = f"{messages[0].get('content', '')}\n\n{text}"
            return messages
        return [{"role": "system", "content": text}, *messages]

    def encode_prompts(self, prompts: Sequence[Any], max_prompt_length: int) -> tuple[list[list[int]], int]:
        """The prompts' ids with their tools (:func:`lightning_grpo.rollout.prompts.encode_prompts`).

        Raises:
            TypeError: a prompt is not a list of chat messages.
        """
        converted = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str) or not all(isinstance(m, Mapping) for m in prompt):
                raise TypeError(f"prompts[{i}] must be a list of chat messages for multi-turn episodes (the "
                                "environment's turns are rendered with the chat template), got "
                                f"{type(prompt).__name__}")
            converted.append(self.prompt_messages(prompt))
        tools = self.tool_schemas if self.renders_tools else None
        return encode_prompts(self.tokenizer, converted, max_prompt_length, tools=tools)

    # ------------------------------------------------------------------ environment turns
    def rendered_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The observation's messages as the template gets them (``tool`` turns as fallback ``user`` turns where
        the template has no tool role)."""
        out = []
        for m in messages:
            m = dict(m)
            if m.get("role") == "tool" and not self.tool_role:
                m = {"role": "user", "content": f"<tool_response>\n{m.get('content', '')}\n</tool_response>"}
            out.append(m)
        return out

    def env_turn_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The ids of one environment turn: what the template writes after the model's EOS for ``messages``, with
        the generation prompt of the model's next turn (see the module docstring).

        Raises:
            ValueError: the template's assistant turn does not end with one of the EOS ids, or the rendering with
                the observation has fewer EOS ids before it than the rendering without it (the turn cannot be cut
                out).
        """
        rendered = self.rendered_messages(messages)
        names = [m.get("name") or "tool" for m in rendered if m.get("role") == "tool"]
        assistant: dict[str, Any] = {"role": "assistant", "content": ""}
        if names:  # some templates (GPT-OSS) take the tool result's header from the assistant's call
            assistant["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": {}}} for n in names]
        dummy = [{"role": "user", "content": "dummy"}, assistant]
        prefix = _ids(self.tokenizer.apply_chat_template(dummy, add_generation_prompt=False, tokenize=True))
        full = _ids(self.tokenizer.apply_chat_template(dummy + rendered, add_generation_prompt=True, tokenize=True))
        ends = [i for i, t in enumerate(prefix) if t in self.eos_token_ids]
        if not ends:
            raise ValueError(f"the chat template's assistant turn does not end with an EOS id "
                             f"{sorted(self.eos_token_ids)}: an environment turn cannot follow the model's EOS")
        prefix = prefix[: ends[-1] + 1]
        if full[: len(prefix)] == prefix:
            return full[len(prefix):]
        # the template renders the dummy assistant turn differently once a message follows it (Qwen3 writes an
        # empty <think> block into the last assistant turn only): cut after as many EOS ids as the prefix holds
        full_ends = [i for i, t in enumerate(full) if t in self.eos_token_ids]
        if len(full_ends) < len(ends):
            raise ValueError("the chat template renders the conversation before an observation differently with the "
                             "observation appended: its environment turn cannot be cut out token-exactly")
        return full[full_ends[len(ends) - 1] + 1:]
