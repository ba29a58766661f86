"""Tools the model can call: plain Python functions with type hints and a Google-style docstring (as in TRL's
``GRPOTrainer(tools=[...])`` and transformers' chat templates), run with a timeout; whatever goes wrong becomes an
error result the model reads, never an exception in the trainer: an exception of any kind (``SystemExit`` and
``KeyboardInterrupt`` included), a return value that cannot be written as text, a timeout.

A tool's JSON schema (name, description, parameters) comes from :func:`transformers.utils.get_json_schema`, so the
chat template sees exactly what it would see from ``apply_chat_template(tools=[fn])``. A call runs in a thread of
its own and is waited for at most ``timeout_s`` seconds; an ``async def`` tool is cancelled at the timeout, a plain
function cannot be stopped by Python and keeps running in its (daemon) thread until it returns: give long-running
tools their own limits (the Python tool runs in the sandbox, which kills the code at its wall-clock limit).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

from transformers.utils import get_json_schema

from lightning_grpo.episodes.calculator import calculator
from lightning_grpo.episodes.python_tool import python_tool


@dataclass(frozen=True)
class ToolCall:
    """A tool call parsed from a model turn.

    Attributes:
        name: the tool's name ("" when the call could not be parsed).
        arguments: its keyword arguments.
        error: why the call could not be parsed (malformed JSON, no name, ...), else None; such a call is not run
            and its error is what the model reads.
    """

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: Optional[str] = None


@dataclass(frozen=True)
class ToolResult:
    """What one tool call returned, as the tool message the model reads next.

    Attributes:
        name: the tool's name.
        content: the result as text (a string as is, anything else as JSON), or ``{"error": "..."}`` as JSON.
        error: the call failed (unknown tool, bad arguments, an exception, a timeout, unparseable).
        timed_out: the call ran past the timeout.
    """

    name: str
    content: str
    error: bool = False
    timed_out: bool = False

    @property
    def message(self) -> dict[str, Any]:
        """``{"role": "tool", "name": name, "content": content}``."""
        return {"role": "tool", "name": self.name, "content": self.content}


def error_result(name: str, message: str, timed_out: bool = False) -> ToolResult:
    """A failed call's result: ``{"error": message}`` as JSON."""
    return ToolResult(name, json.dumps({"error": message}), error=True, timed_out=timed_out)


def result_text(value: Any) -> str:
    """A tool's return value as the text the model reads: a string as is, anything else as JSON (``str`` where it is
    not JSON-serializable)."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


class Tool:
    """A function the model can call.

    Args:
        function: a function (or ``async def``) with type hints and a Google-style docstring describing every
            argument (``Args:``); its return value is converted by :func:`result_text`.
        name: the name the model calls it by; default ``function.__name__``.
        schema: the JSON schema (``{"type": "function", "function": {...}}``); default
            :func:`transformers.utils.get_json_schema` of ``function``.

    Raises:
        ValueError: ``function`` is not callable, or its schema cannot be made (no docstring, an argument without a
            description or type hint: transformers' message is included).
    """

    def __init__(self, function: Callable[..., Any], name: Optional[str] = None,
                 schema: Optional[dict[str, Any]] = None) -> None:
        if not callable(function):
            raise ValueError(f"a tool must be callable, got {type(function).__name__}")
        self.function = function
        if schema is None:
            try:
                schema = get_json_schema(function)
            except Exception as err:  # transformers raises its own DocstringParsingException / TypeHintParsingException
                raise ValueError(f"tool {getattr(function, '__name__', function)!r}: cannot make its JSON schema from "
                                 f"its type hints and docstring: {err}") from err
        self.name = name or schema["function"]["name"]
        self.schema = {"type": "function", "function": {**schema["function"], "name": self.name}}
        self._signature = inspect.signature(function)

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"

    def __call__(self, arguments: dict[str, Any], timeout_s: float) -> ToolResult:
        """Run the tool with ``arguments`` for at most ``timeout_s`` seconds (see the module docstring); never
        raises: a failure (any ``BaseException`` the call or the conversion of its value raises, or a timeout) is an
        error result."""
        if not isinstance(arguments, dict):
            return error_result(self.name, f"the arguments must be a JSON object, got {type(arguments).__name__}")
        try:
            self._signature.bind(**arguments)
        except TypeError as err:
            return error_result(self.name, f"bad arguments for {self.name}: {err}")
        outcome: dict[str, Any] = {}

        def target() -> None:
            try:
                if inspect.iscoroutinefunction(self.function):
                    value = asyncio.run(asyncio.wait_for(self.function(**arguments), timeout_s))
                else:
                    value = self.function(**arguments)
                outcome["text"] = result_text(value)  # here: a value whose conversion fails is the tool's failure
            except asyncio.TimeoutError:
                outcome["timeout"] = True
            except BaseException as err:  # noqa: BLE001 - SystemExit, KeyboardInterrupt, ...: the model's observation
                outcome["error"] = _describe(err)

        thread = threading.Thread(target=target, name=f"tool-{self.name}", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive() or outcome.get("timeout"):
            return error_result(self.name, f"{self.name} did not finish within {timeout_s:g} s", timed_out=True)
        if "error" in outcome:
            return error_result(self.name, outcome["error"])
        if "text" not in outcome:  # the thread ended without a result or an exception: not a success either
            return error_result(self.name, f"{self.name} ended without a result")
        return ToolResult(self.name, outcome["text"])


def _describe(err: BaseException) -> str:
    """``"<type>: <message>"`` of an exception, also when its ``__str__`` raises."""
    try:
        return f"{type(err).__name__}: {err}"
    except BaseException:  # noqa: BLE001 - the message of an exception whose __str__ fails
        return f"{type(err).__name__}: <the message could not be read>"


#: Built-in tools by name (``GRPOModule(tools=["calculator"])``, YAML ``tools: [calculator]``).
#: Tools by name (``tools=["calculator", "python"]``, also in YAML): the safe calculator, and the Python tool in a
#: :class:`lightning_grpo.sandbox.Sandbox` with its default limits (a new one per ``as_tools`` call).
BUILTIN_TOOLS: dict[str, Callable[[], Callable[..., Any]]] = {"calculator": lambda: calculator, "python": python_tool}

ToolSpec = Union[Tool, Callable[..., Any], str]


def as_tools(specs: Sequence[ToolSpec]) -> list[Tool]:
    """Tools from functions, :class:`Tool` objects or built-in names (:data:`BUILTIN_TOOLS`).

    Raises:
        ValueError: an unknown name, a function without a usable schema, or two tools with the same name.
    """
    tools: list[Tool] = []
    for spec in specs:
        if isinstance(spec, Tool):
            tools.append(spec)
        elif isinstance(spec, str):
            if spec not in BUILTIN_TOOLS:
                raise ValueError(f"unknown tool {spec!r}; built-in tools: {sorted(BUILTIN_TOOLS)} (or pass a function)")
            tools.append(Tool(BUILTIN_TOOLS[spec]()))
        else:
            tools.append(Tool(spec))
    names = [t.name for t in tools]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"two tools share the name(s) {repeated}: tool names must be unique")
    return tools
