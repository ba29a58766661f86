"""What one episode was: its turns (token spans of the trained sequence, with their messages), tool counts, limits
hit, the environment's reward and the weight version that sampled it. Plain data, so a rollout that holds these
records goes into a checkpoint and loads with ``torch.load(weights_only=True)`` (:meth:`EpisodeRecord.state`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Optional

#: Who wrote a turn: the model (sampled, trained) or the environment (tool results, observations: context only).
TurnSource = Literal["model", "env"]


@dataclass
class Turn:
    """One turn of an episode, as a span of its completion region (the tokens after the prompt).

    Attributes:
        source: "model" (sampled ids, trained) or "env" (encoded once with the chat template, never trained).
        start, end: the turn's tokens are ``completion_ids[start:end]`` of its row.
        messages: the chat messages of the turn: one ``{"role": "assistant", "content": text}`` for a model turn
            (the sampled ids decoded, special tokens skipped), the environment's messages (e.g. ``{"role": "tool",
            "name": ..., "content": ...}``) for an environment turn.
    """

    source: TurnSource
    start: int
    end: int
    messages: list[dict[str, Any]]


@dataclass
class SampleRecord:
    """One training sample of an agent's episode (:mod:`lightning_grpo.episodes.agents.session`): a token sequence that
    one or more of the session's model calls extended in turn.

    Attributes:
        calls: the session's calls it holds, in order (0 = the session's first call).
        prompt_tokens: its prompt's tokens (the first call's rendering).
        model_tokens, env_tokens: its sampled tokens, and the tokens of the messages the agent added between calls.
        trained: it is the episode's training row (the last sample); the others are recorded, not trained.
    """

    calls: list[int]
    prompt_tokens: int
    model_tokens: int
    env_tokens: int
    trained: bool


@dataclass
class EpisodeRecord:
    """One episode of a rollout: every row of a :class:`~lightning_grpo.protocols.rollout.RolloutOutput` has one. A
    multi-turn rollout's (:class:`lightning_grpo.episodes.turn_loop.EpisodeRunner`, the agents) are its turns; a
    single-turn rollout's row is a one-turn episode (:meth:`one_turn`, as verl's ``single_turn_agent_loop`` and
    prime-rl's training samples have it).

    Attributes:
        turns: its turns in order (model, env, model, ...; it always ends with a model turn).
        model_turns: how many model turns it had (<= ``episode.max_turns``).
        tool_calls: tool calls it made (parsed from its model turns; 0 for environments without tools).
        tool_errors: those that failed: unknown tool, arguments that do not parse or fit, an exception, a timeout
            (each became an error observation the model saw).
        tool_timeouts: those of ``tool_errors`` that ran past ``episode.tool_timeout_s``.
        truncated: its last model turn has no EOS (cut by ``max_new_tokens`` or the episode budget) or an
            observation did not fit the budget (``budget_exceeded``): the same meaning as ``RolloutOutput.truncated``.
        budget_exceeded: an observation would have overflowed ``episode.max_tokens``; it was not appended.
        env_reward: the last non-None reward the environment's ``step`` returned, else None.
        weight_version: the oldest weight version of its model tokens (rollout servers count syncs; an episode may
            span versions when the engine takes weights while it runs: each token's is in the rollout's
            ``completion_versions``), else None.
        done: the environment ended the episode (a final answer, a finished game), as opposed to a limit; for an
            agent's episode, the agent returned.
        samples: an agent's episode (``GRPOModule(agent=...)``): its samples (calls that extended one another), the
            last one trained; empty for the turn loop's episodes.
        error: an agent's episode: why its agent failed (``"TypeName: message"``, or a timeout), else None.
        single_turn: a single-turn rollout's row (:meth:`one_turn`: one model turn, no environment), which the
            rollout events and the completion table show as a plain completion; False for the turn loop's and the
            agents' episodes.
    """

    turns: list[Turn] = field(default_factory=list)
    model_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    truncated: bool = False
    budget_exceeded: bool = False
    env_reward: Optional[float] = None
    weight_version: Optional[int] = None
    done: bool = False
    samples: list[SampleRecord] = field(default_factory=list)
    error: Optional[str] = None
    single_turn: bool = False

    @classmethod
    def one_turn(cls, text: str, num_tokens: int, truncated: bool,
                 weight_version: Optional[int] = None) -> "EpisodeRecord":
        """A single-turn rollout's row as an episode: one model turn of its ``num_tokens`` completion tokens (through
        the EOS) writing ``text``; ``done`` when it ended with an EOS (not ``truncated``)."""
        turn = Turn("model", 0, num_tokens, [{"role": "assistant", "content": text}])
        return cls(turns=[turn], model_turns=1, truncated=truncated, weight_version=weight_version,
                   done=not truncated, single_turn=True)

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The transcript after the prompt: every turn's messages in order (what the ``transcript`` column of the
        reward functions holds)."""
        return [m for turn in self.turns for m in turn.messages]

    @property
    def final_text(self) -> str:
        """The text of the last model turn (the episode's answer; what reward functions get as the completion)."""
        for turn in reversed(self.turns):
            if turn.source == "model":
                return str(turn.messages[0]["content"]) if turn.messages else ""
        return ""

    def transcript(self, trained: bool = True) -> str:
        """The episode as text, one block per turn with its boundary marked: ``[model, 37 tokens, trained]`` or
        ``[env, 15 tokens, context]`` and the turn's messages (an environment message as ``role (name): content``).
        ``trained``: whether the row got a loss (False for a masked or unscored row: its model turns say
        "not trained")."""
        blocks = []
        for turn in self.turns:
            n = turn.end - turn.start
            if turn.source == "model":
                head = f"[model, {n} tokens, {'trained' if trained else 'not trained'}]"
                body = "\n".join(str(m.get("content", "")) for m in turn.messages)
            else:
                head = f"[env, {n} tokens, context]"
                body = "\n".join(f"{m.get('role', '')}" + (f" ({m['name']})" if m.get("name") else "")
                                 + f": {m.get('content', '')}" for m in turn.messages)
            blocks.append(f"{head}\n{body}")
        return "\n".join(blocks)

    def state(self) -> dict[str, Any]:
        """As plain data (dicts, lists, numbers, strings)."""
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "EpisodeRecord":
        """The record :meth:`state` returned."""
        values = dict(state)
        values["turns"] = [Turn(**t) for t in values.get("turns", [])]
        values["samples"] = [SampleRecord(**s) for s in values.get("samples", [])]
        return cls(**values)
