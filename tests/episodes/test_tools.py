"""Tools from plain functions, their timeouts and errors, the Hermes tool-call parser, the ToolEnvironment and the
Python tool in the sandbox of the code rewards (lightning_grpo.sandbox)."""

import asyncio
import json
import time

import pytest

from lightning_grpo.episodes import (
    EnvStep,
    HermesToolCallParser,
    Tool,
    ToolCall,
    ToolEnvironment,
    as_tools,
    python_tool,
)
from lightning_grpo.episodes.environment import step_all
from lightning_grpo.sandbox import Sandbox, SandboxLimits


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor.
        b: the second factor.
    """
    return a * b


def slow(seconds: float) -> str:
    """Sleep, then answer.

    Args:
        seconds: how long to sleep.
    """
    time.sleep(seconds)
    return "done"


async def slow_async(seconds: float) -> str:
    """Sleep without blocking, then answer.

    Args:
        seconds: how long to sleep.
    """
    await asyncio.sleep(seconds)
    return "done"


def failing(x: str) -> str:
    """Always fails.

    Args:
        x: anything.
    """
    raise KeyError(x)


def test_schema_from_type_hints_and_docstring():
    tool = Tool(multiply)
    assert tool.name == "multiply"
    assert tool.schema["function"]["parameters"] == {
        "type": "object", "required": ["a", "b"],
        "properties": {"a": {"type": "integer", "description": "the first factor."},
                       "b": {"type": "integer", "description": "the second factor."}}}
    assert Tool(multiply, name="times").schema["function"]["name"] == "times"
    with pytest.raises(ValueError, match="cannot make its JSON schema"):
        Tool(lambda x: x)


def test_call_results_and_errors():
    tool = Tool(multiply)
    assert tool({"a": 6, "b": 7}, 1.0).content == "42"
    bad = tool({"a": 6}, 1.0)
    assert bad.error and not bad.timed_out and "missing a required argument: 'b'" in json.loads(bad.content)["error"]
    assert tool({"a": 1, "b": 2, "c": 3}, 1.0).error
    assert tool([1, 2], 1.0).error  # type: ignore[arg-type]
    raised = Tool(failing)({"x": "boom"}, 1.0)
    assert raised.error and json.loads(raised.content) == {"error": "KeyError: 'boom'"}
    assert raised.message == {"role": "tool", "name": "failing", "content": raised.content}


class Unprintable:
    def __str__(self):
        raise RuntimeError("no text")


class UnprintableError(Exception):
    def __str__(self):
        raise RuntimeError("no text")


class Abort(BaseException):
    pass


def _raiser(error: BaseException):
    def leave(x: str) -> str:
        """Fails in its own way.

        Args:
            x: anything.
        """
        raise error

    return leave


async def exits_async(x: str) -> str:
    """Calls sys.exit from a coroutine.

    Args:
        x: anything.
    """
    raise SystemExit(3)


def unprintable(x: str) -> object:
    """Returns a value that is neither JSON nor printable.

    Args:
        x: anything.
    """
    return Unprintable()


@pytest.mark.parametrize("function, message", [
    (_raiser(SystemExit(0)), "SystemExit: 0"),
    (_raiser(SystemExit("bye")), "SystemExit: bye"),
    (_raiser(KeyboardInterrupt()), "KeyboardInterrupt: "),
    (_raiser(GeneratorExit()), "GeneratorExit: "),
    (_raiser(Abort("x")), "Abort: x"),
    (_raiser(UnprintableError()), "UnprintableError: <the message could not be read>"),
    (exits_async, "SystemExit: 3"),
    (unprintable, "RuntimeError: no text"),
])
def test_every_way_a_tool_fails_is_an_error_result(function, message):
    """``sys.exit`` in a tool, any other ``BaseException``, an exception that cannot be printed, a value that cannot
    be written as text: an error result the model reads, counted as an error of the turn (docs/multiturn.md)."""
    result = Tool(function)({"x": "a"}, 5.0)
    assert result.error and not result.timed_out and json.loads(result.content) == {"error": message}
    env = ToolEnvironment([Tool(function, name="leave")], timeout_s=5.0)
    step = env.step('<tool_call>{"name": "leave", "arguments": {"x": "a"}}</tool_call>')
    assert (step.tool_calls, step.tool_errors, step.messages[0]["content"]) == (1, 1, result.content)


@pytest.mark.parametrize("function", [slow, slow_async])
def test_timeout_is_an_error_result_not_a_hang(function):
    tool = Tool(function)
    start = time.perf_counter()
    result = tool({"seconds": 5.0}, 0.2)
    assert time.perf_counter() - start < 2.0
    assert result.error and result.timed_out and "did not finish within 0.2 s" in result.content
    assert tool({"seconds": 0.0}, 2.0).content == "done"


def test_as_tools():
    tools = as_tools(["calculator", multiply, Tool(slow)])
    assert [t.name for t in tools] == ["calculator", "multiply", "slow"]
    with pytest.raises(ValueError, match="unknown tool 'abacus'"):
        as_tools(["abacus"])
    with pytest.raises(ValueError, match=r"share the name\(s\) \['multiply'\]"):
        as_tools([multiply, multiply])


def test_hermes_parser():
    parser = HermesToolCallParser()
    text = ('Let me compute.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 3, "b": 4}}\n</tool_call>\n'
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>')
    assert parser.parse(text) == [ToolCall("multiply", {"a": 3, "b": 4}), ToolCall("calculator", {"expression": "1+1"})]
    assert parser.parse("The answer is 12.") == []
    assert parser.parse('<tool_call>{"name": "f", "arguments": {}}') == [ToolCall("f", {})]  # unclosed last block
    broken = parser.parse("<tool_call>{name: f}</tool_call>")
    assert broken[0].name == "" and "not valid JSON" in broken[0].error
    assert "JSON object" in parser.parse('<tool_call>["f"]</tool_call>')[0].error
    assert "arguments" in parser.parse('<tool_call>{"name": "f", "arguments": 3}</tool_call>')[0].error
    text = parser.instructions([Tool(multiply).schema])
    assert "<tools>\n" + json.dumps(Tool(multiply).schema) + "\n</tools>" in text and "<tool_call>" in text


def test_tool_environment_step():
    env = ToolEnvironment(as_tools(["calculator", multiply]), timeout_s=1.0)
    step = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "123 * 456"}}</tool_call>'
                    '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
                    '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>'
                    "<tool_call>not json</tool_call>")
    assert not step.done and step.tool_calls == 4 and step.tool_errors == 3 and step.tool_timeouts == 0
    assert step.messages[0] == {"role": "tool", "name": "calculator", "content": "56088"}
    assert "unknown tool 'nope'" in step.messages[1]["content"]
    assert "division by zero" in step.messages[2]["content"]
    assert step.messages[3]["name"] == "unknown"
    assert env.step("#### 56088") == EnvStep(done=True)
    with pytest.raises(ValueError, match="timeout_s"):
        ToolEnvironment([], timeout_s=0)


def test_step_all_keeps_order_in_threads():
    envs = [ToolEnvironment(as_tools([slow]), timeout_s=2.0) for _ in range(4)]
    turns = ['<tool_call>{"name": "slow", "arguments": {"seconds": 0.3}}</tool_call>'] * 4
    start = time.perf_counter()
    steps = step_all(envs, turns, workers=4)
    assert time.perf_counter() - start < 1.0  # four 0.3 s calls at once, not one after the other
    assert [s.messages[0]["content"] for s in steps] == ["done"] * 4

    class Wrong:
        def step(self, turn):
            return "observation"

    with pytest.raises(TypeError, match="returned str, not an EnvStep"):
        step_all([Wrong()], ["x"], workers=1)


def _check_python_tool(sandbox):
    tool = Tool(python_tool(sandbox, max_output_chars=50))
    assert tool.name == "python" and "code" in tool.schema["function"]["parameters"]["properties"]
    assert tool({"code": "print(123 * 456)"}, 30.0).content == "56088\n"
    failed = tool({"code": "raise ValueError('nope')"}, 30.0)
    assert failed.error and "error" in failed.content and "ValueError: nope" in failed.content
    long = tool({"code": "print('x' * 500)"}, 30.0)
    assert long.content == "..." + "x" * 49 + "\n"


def test_python_tool_in_the_sandbox():
    _check_python_tool(Sandbox())
    _check_python_tool(None)  # the default: a Sandbox with its default limits
    (by_name,) = as_tools(["python"])  # the built-in name: the same tool on a default Sandbox
    assert by_name.name == "python" and by_name({"code": "print(6 * 7)"}, 30.0).content == "42\n"
    timed = Tool(python_tool(Sandbox(SandboxLimits(wall_s=0.5))))({"code": "import time; time.sleep(30)"}, 30.0)
    assert timed.error and "timeout" in timed.content
    with pytest.raises(TypeError, match="run_python"):
        python_tool(object())  # type: ignore[arg-type]
