"""A sampled model turn as the OpenAI assistant message the agent gateway answers with: reasoning split off first,
then tool calls parsed from what remains, then the text around them as ``content``.

Order matters (verl #6424: a tool call the model wrote inside its ``<think>`` block was parsed and run): the reasoning
(``<think>...</think>``, the tags configurable) becomes ``reasoning_content`` and is never searched for tool calls. A
turn whose template opened the think block in the generation prompt has only the closing tag (TRL PR #6363's case):
everything before it is reasoning. A turn with an opening tag and no closing one (cut by the token limit) is
reasoning to its end: no content, no calls.

Calls that cannot be parsed (malformed JSON, no name) are not returned; they are counted (``tool_errors``) and, when
no call parsed, the turn's text is the ``content`` as the model wrote it, so the agent sees what went wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Optional

from lightning_grpo.episodes.parsers import AnswerParser


@dataclass(frozen=True)
class ReasoningTags:
    """The tags around a model's reasoning (Qwen3, DeepSeek-R1: ``<think>``, ``</think>``)."""

    start: str = "<think>"
    end: str = "</think>"


@dataclass
class Answer:
    """A model turn as an OpenAI message.

    Attributes:
        content: the text outside reasoning and tool calls (None when empty and the turn calls tools).
        reasoning: the reasoning text (None when the turn has none).
        tool_calls: OpenAI ``tool_calls`` (``{"id", "type": "function", "function": {"name", "arguments"}}``, the
            arguments as a JSON string).
        tool_errors: calls that could not be parsed.
    """

    content: Optional[str]
    reasoning: Optional[str] = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    tool_errors: int = 0

    def message(self) -> dict[str, Any]:
        """The OpenAI assistant message (``reasoning_content`` when there is reasoning, ``tool_calls`` when any)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


def split_reasoning(text: str, tags: Optional[ReasoningTags]) -> tuple[Optional[str], str]:
    """``(reasoning, rest)`` of a turn's text (see the module docstring); ``(None, text)`` without tags or without
    reasoning."""
    if tags is None:
        return None, text
    if tags.end in text:
        head, _, rest = text.partition(tags.end)
        reasoning = head.split(tags.start, 1)[1] if tags.start in head else head
        return reasoning.strip("\n"), rest.lstrip("\n")
    if tags.start in text:
        head, _, reasoning = text.partition(tags.start)
        return reasoning.strip("\n"), head
    return None, text


def parse_answer(text: str, parser: AnswerParser, tags: Optional[ReasoningTags], call_id_prefix: str) -> Answer:
    """The :class:`Answer` of one model turn's text (special tokens removed).

    Args:
        text: the turn's text.
        parser: the tool-call format (its :meth:`~lightning_grpo.episodes.parsers.AnswerParser.split`).
        tags: the reasoning tags, or None (no reasoning split).
        call_id_prefix: tool-call ids are ``f"{call_id_prefix}_{k}"`` (unique within a session).
    """
    reasoning, rest = split_reasoning(text, tags)
    if tags is not None and tags.start in text and tags.end not in text:  # unfinished reasoning: nothing else
        return Answer(content=None, reasoning=reasoning)
    content, calls = parser.split(rest)
    good = [c for c in calls if c.error is None]
    errors = len(calls) - len(good)
    tool_calls = [{"id": f"{call_id_prefix}_{k}", "type": "function",
                   "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for k, c in enumerate(good)]
    if not good:
        return Answer(content=rest, reasoning=reasoning, tool_errors=errors)
    return Answer(content=content or None, reasoning=reasoning, tool_calls=tool_calls, tool_errors=errors)
