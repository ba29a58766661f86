"""The environment protocol: one object per episode that reads each model turn and answers with the next
observation, or ends the episode, optionally with the episode's reward (SkyRL's ``BaseTextEnv.step``, NeMo-RL's
``EnvironmentInterface.step``, TRL's ``environment_factory`` objects).

``GRPOModule(environment_factory=MyEnv)`` calls ``MyEnv()`` once per episode (G episodes per prompt), then
``reset(**row)`` with the dataset row of its prompt (every column, ``prompt`` included), then ``step(text)`` with each
finished model turn (the sampled ids decoded, special tokens skipped) until a step says ``done`` or a limit ends the
episode (``episode.max_turns``, the token budget), then ``close()``. ``GRPOModule(tools=[...])`` uses
:class:`ToolEnvironment`: each turn's tool calls are run and their results are the observation; a turn without a
tool call is the final answer.

The environment's reward reaches the reward functions as the ``env_reward`` column (the last non-None ``reward`` a
step returned; the ``env_reward`` reward function returns it), the whole transcript as the ``transcript`` column (a
list of chat messages per episode): plain data, recorded when the episode ends, so a checkpointed rollout scores the
same after a resume.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, Sequence, runtime_checkable

from lightning_grpo.episodes.parsers import HermesToolCallParser, ToolCallParser
from lightning_grpo.episodes.tools import Tool, ToolResult, error_result


@dataclass
class EnvStep:
    """What the environment answers to one model turn.

    Attributes:
        messages: the observation, as chat messages (``{"role": "tool" | "user" | ..., "content": str}``), rendered
            with the chat template's turn format and appended to the episode; ignored when ``done``.
        done: the episode is over (no observation is appended).
        reward: the episode's reward so far (the last non-None one is the episode's ``env_reward``), or None.
        tool_calls, tool_errors, tool_timeouts: tool calls this turn made, failed and timed out (metrics).
    """

    messages: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    reward: Optional[float] = None
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0

    @classmethod
    def observe(cls, content: str, role: str = "user", reward: Optional[float] = None) -> "EnvStep":
        """An observation of one message (default role "user")."""
        return cls([{"role": role, "content": content}], reward=reward)

    @classmethod
    def finish(cls, reward: Optional[float] = None) -> "EnvStep":
        """The end of the episode, with its reward."""
        return cls(done=True, reward=reward)


@runtime_checkable
class Environment(Protocol):
    """An episode's environment (see the module docstring); :class:`BaseEnvironment` gives ``reset`` and ``close``
    that do nothing."""

    def reset(self, **row: Any) -> None:
        """Start the episode of the dataset ``row`` (its columns as keyword arguments)."""
        ...

    def step(self, turn: str) -> EnvStep:
        """The answer to the model turn ``turn``."""
        ...

    def close(self) -> None:
        """The episode is over: release what it holds."""
        ...


EnvironmentFactory = Callable[[], Environment]


class BaseEnvironment:
    """Base of environments: ``reset`` and ``close`` do nothing; subclasses define ``step``."""

    def reset(self, **row: Any) -> None:
        """Nothing to do."""

    def step(self, turn: str) -> EnvStep:
        """Subclasses answer the turn."""
        raise NotImplementedError(f"{type(self).__name__}.step")

    def close(self) -> None:
        """Nothing to release."""


class ToolEnvironment(BaseEnvironment):
    """Runs the tool calls of each model turn (``GRPOModule(tools=[...])`` gives each episode one).

    A turn without a tool call ends the episode (it is the answer). Otherwise each call is parsed by ``parser`` and
    run with ``timeout_s`` (:class:`~lightning_grpo.episodes.tools.Tool`), several calls of a turn in order, and
    their results, one ``tool`` message each, are the observation; an unknown tool, arguments that do not fit, an
    exception or a timeout become an error result the model reads (counted in ``tools/error_rate``).

    Subclass it for stateful tools or a reward: override :meth:`reset` and :meth:`step` (calling
    ``super().step(turn)``).

    Args:
        tools: the tools.
        parser: the tool-call format (default :class:`~lightning_grpo.episodes.parsers.HermesToolCallParser`).
        timeout_s: most seconds one call may take (> 0).

    Raises:
        ValueError: ``timeout_s <= 0``.
    """

    def __init__(self, tools: Sequence[Tool], parser: Optional[ToolCallParser] = None,
                 timeout_s: float = 10.0) -> None:
        if not timeout_s > 0:
            raise ValueError(f"ToolEnvironment timeout_s={timeout_s!r} must be > 0")
        self.tools = {tool.name: tool for tool in tools}
        self.parser = parser or HermesToolCallParser()
        self.timeout_s = float(timeout_s)

    def run(self, turn: str) -> Optional[list[ToolResult]]:
        """The results of the tool calls in ``turn``, in order; None when it calls no tool."""
        calls = self.parser.parse(turn)
        if not calls:
            return None
        results = []
        for call in calls:
            if call.error is not None:
                results.append(error_result(call.name or "unknown", call.error))
            elif call.name not in self.tools:
                results.append(error_result(call.name, f"unknown tool {call.name!r}; the tools are "
                                                       f"{sorted(self.tools)}"))
            else:
                results.append(self.tools[call.name](call.arguments, self.timeout_s))
        return results

    def step(self, turn: str) -> EnvStep:
        """The tool results of ``turn`` as ``tool`` messages, or ``done`` when it calls no tool."""
        results = self.run(turn)
        if results is None:
            return EnvStep.finish()
        return EnvStep([r.message for r in results], tool_calls=len(results),
                       tool_errors=sum(r.error for r in results), tool_timeouts=sum(r.timed_out for r in results))


def step_all(environments: Sequence[Environment], turns: Sequence[str], workers: int) -> list[EnvStep]:
    """``environments[i].step(turns[i])`` for every i, in up to ``workers`` threads at once (each environment is
    stepped by one thread; results in order).

    Raises:
        TypeError: a step returned something other than an :class:`EnvStep` (the episode is named).
        Exception: whatever a step raised (an environment's own error stops the rollout; a tool's never does).
    """
    def one(i: int) -> EnvStep:
        result = environments[i].step(turns[i])
        if not isinstance(result, EnvStep):
            raise TypeError(f"{type(environments[i]).__name__}.step returned {type(result).__name__}, not an EnvStep")
        return result

    if workers <= 1 or len(environments) <= 1:
        return [one(i) for i in range(len(environments))]
    with ThreadPoolExecutor(min(workers, len(environments)), thread_name_prefix="lightning_grpo_env") as pool:
        return list(pool.map(one, range(len(environments))))
