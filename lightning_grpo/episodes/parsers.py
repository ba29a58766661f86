"""Tool-call formats: how a model turn's text becomes tool calls, and how the tools are described to a model whose
chat template does not render them.

The built-in format is Hermes / Qwen's (what Qwen2.5, Qwen3 and Hermes templates write and what TRL's response
schemas parse), one block per call::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "123 * 456"}}
    </tool_call>

It is also the format the embedded SmolLM2-135M-Instruct is given: its chat template has no tool support, so the
tools and this format are described in the system message (:meth:`HermesToolCallParser.instructions`, the text
Qwen2.5's template writes) and tool results are rendered as ``tool`` turns (``<|im_start|>tool\\n...<|im_end|>``).
Another format is a class with the two methods of :class:`ToolCallParser`, passed as ``GRPOModule(tool_parser=...)``;
the agent gateway's (``AgentRollout(tool_parser=...)``) also needs :meth:`AnswerParser.split`.
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol, runtime_checkable

from lightning_grpo.episodes.tools import ToolCall


@runtime_checkable
class ToolCallParser(Protocol):
    """A tool-call format."""

    def parse(self, text: str) -> list[ToolCall]:
        """The tool calls in one model turn's text (special tokens already removed), in order; [] when the turn
        calls no tool (it is the final answer). A call that cannot be parsed is a :class:`ToolCall` with
        ``error`` set (the model reads the error), never an exception."""
        ...

    def instructions(self, schemas: list[dict[str, Any]]) -> str:
        """The system-message text that describes ``schemas`` (JSON schemas of the tools) and this format, for
        chat templates that do not render tools themselves."""
        ...


@runtime_checkable
class AnswerParser(ToolCallParser, Protocol):
    """A tool-call format that also gives the text around the calls: what the agent gateway needs to answer with
    OpenAI's ``content`` and ``tool_calls`` (:mod:`lightning_grpo.episodes.agents.answer`)."""

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        """``(content, calls)``: the turn's text without its tool-call blocks (stripped), and the calls as
        :meth:`ToolCallParser.parse` gives them."""
        ...

    def write(self, calls: list[ToolCall]) -> str:
        """``calls`` as the model writes them in this format (for chat templates that do not render an assistant
        message's ``tool_calls``: SmolLM2's)."""
        ...


_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


class HermesToolCallParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (see the module docstring). ``arguments``
    may also be a JSON string holding the object; an unclosed last block is read to the end of the turn."""

    def parse(self, text: str) -> list[ToolCall]:
        """See :meth:`ToolCallParser.parse`."""
        return [self._call(block.strip()) for block in _BLOCK.findall(text)]

    def split(self, text: str) -> tuple[str, list[ToolCall]]:
        """See :meth:`AnswerParser.split`."""
        return _BLOCK.sub("", text).strip(), self.parse(text)

    def write(self, calls: list[ToolCall]) -> str:
        """See :meth:`AnswerParser.write`: one ``<tool_call>`` block per call, on lines of their own."""
        return "\n".join("<tool_call>\n" + json.dumps({"name": c.name, "arguments": c.arguments}) + "\n</tool_call>"
                         for c in calls)

    @staticmethod
    def _call(block: str) -> ToolCall:
        try:
            value = json.loads(block)
        except json.JSONDecodeError as err:
            return ToolCall("", error=f"the tool call is not valid JSON ({err.msg} at character {err.pos})")
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
            return ToolCall("", error='a tool call must be a JSON object {"name": ..., "arguments": {...}}')
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return ToolCall(value["name"], error="the tool call's arguments are not a JSON object")
        if not isinstance(arguments, dict):
            return ToolCall(value["name"], error="the tool call's arguments are not a JSON object")
        return ToolCall(value["name"], arguments)

    def instructions(self, schemas: list[dict[str, Any]]) -> str:
        """See :meth:`ToolCallParser.instructions` (Qwen2.5's wording)."""
        lines = "\n".join(json.dumps(s) for s in schemas)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                f"<tools>\n{lines}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
