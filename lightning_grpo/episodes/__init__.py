"""Multi-turn episodes: tools, environments, tool-call formats and the turn loop (docs/multiturn.md).

``GRPOModule(agent=fn)`` trains an unmodified agent through an OpenAI-compatible gateway (:mod:`lightning_grpo.episodes.
agents`, docs/agents.md).
``GRPOModule(tools=[fn, ...])`` or ``GRPOModule(environment_factory=MyEnv)`` makes every rollout a batch of
episodes: the model's turn is sampled, the environment answers (tool results, an observation), the model samples its
next turn, ... until the environment says it is done or a limit (``GRPOConfig.episode``) ends it. The trained
sequence is the prompt's ids, the sampled ids of every model turn and the environment turns' ids, concatenated
(:mod:`lightning_grpo.episodes.turn_loop`); only the model's tokens get a loss.
"""

from lightning_grpo.episodes.agents.agent_sampler import AgentFn, AgentRollout, AgentSampler
from lightning_grpo.episodes.agents.answer import ReasoningTags
from lightning_grpo.episodes.build import episode_runner, rollout_path
from lightning_grpo.episodes.calculator import CalculatorError, calculator
from lightning_grpo.episodes.chat import ChatFormat
from lightning_grpo.episodes.environment import BaseEnvironment, Environment, EnvStep, ToolEnvironment
from lightning_grpo.episodes.parsers import AnswerParser, HermesToolCallParser, ToolCallParser
from lightning_grpo.episodes.python_tool import PythonSandbox, python_tool
from lightning_grpo.episodes.tools import BUILTIN_TOOLS, Tool, ToolCall, ToolResult, as_tools
from lightning_grpo.episodes.turn_loop import EpisodeRunner
from lightning_grpo.protocols.episode import EpisodeRecord, Turn

__all__ = [
    "AgentFn",
    "AgentRollout",
    "AgentSampler",
    "AnswerParser",
    "BUILTIN_TOOLS",
    "BaseEnvironment",
    "CalculatorError",
    "ChatFormat",
    "EnvStep",
    "Environment",
    "EpisodeRecord",
    "EpisodeRunner",
    "HermesToolCallParser",
    "PythonSandbox",
    "ReasoningTags",
    "Tool",
    "ToolCall",
    "ToolCallParser",
    "ToolEnvironment",
    "ToolResult",
    "Turn",
    "as_tools",
    "calculator",
    "episode_runner",
    "python_tool",
    "rollout_path",
]
