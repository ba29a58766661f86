"""An agent rollout's sessions as a :class:`~lightning_grpo.protocols.rollout.RolloutOutput`: one training row per
episode (docs/agents.md, "What is trained").

A row is its episode's *last* sample (the one whose last call gave the final answer the reward scores): its prompt,
then every token after it, the model's (sampled ids, sampler logprobs, trained) and the environment's (the messages
the agent added between calls, context only) as in the turn loop's episodes. The episode's earlier samples (calls
that did not extend the sample before them) are recorded (:attr:`EpisodeRecord.samples`, with the calls each holds)
and counted (``agent/samples_per_episode``, ``agent/untrained_calls``), not trained. An episode whose agent made no
call is an empty row (no loss).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from lightning_grpo.episodes.agents.session import AgentSession
from lightning_grpo.episodes.episode_metrics import episode_columns, episode_metrics
from lightning_grpo.protocols.episode import EpisodeRecord, SampleRecord
from lightning_grpo.protocols.rollout import RolloutOutput, RowMetric, left_pad


def _per_row(values: Sequence[float]) -> torch.Tensor:
    return torch.tensor([float(v) for v in values], dtype=torch.float64)


def agent_output(sessions: Sequence[AgentSession], prompt_ids: Sequence[Sequence[int]], g: int, pad: int,
                 errors: dict[int, str], rewards: dict[int, Optional[float]], timed_out: set[int],
                 skip_failed: bool) -> RolloutOutput:
    """The rollout of ``B * G`` sessions (prompt-major; ``prompt_ids``: the dataset's encoded prompts, the rows of
    episodes without a call). ``errors``: the sessions whose agent raised or timed out (``timed_out``) and why;
    ``rewards``: what the agents returned; ``skip_failed``: failed episodes are unscored (no loss, out of their
    group's statistics).

    Each model token's weight version goes into ``completion_versions`` (-1 on the environment's tokens; None when
    no call reported a version); an episode's record holds its oldest.
    """
    n = len(sessions)
    rows = []
    for k, session in enumerate(sessions):
        last = session.samples[-1] if session.samples else None
        prompt = list(last.prompt) if last is not None else [int(t) for t in prompt_ids[k // g]]
        rows.append((prompt, last))
    t = max([1] + [len(s.ids) for _, s in rows if s is not None])
    completion_ids = torch.full((n, t), pad, dtype=torch.long)
    model = torch.zeros((n, t), dtype=torch.long)
    logprobs = torch.zeros((n, t), dtype=torch.float32)
    token_versions = torch.full((n, t), -1, dtype=torch.long)
    records: list[EpisodeRecord] = []
    versions: set[int] = set()
    for k, (session, (_, last)) in enumerate(zip(sessions, rows, strict=True)):
        episode_versions = set().union(*(s.versions for s in session.samples))
        versions |= episode_versions
        if last is not None:
            length = len(last.ids)
            completion_ids[k, :length] = torch.tensor(last.ids, dtype=torch.long)
            model[k, :length] = torch.tensor(last.model, dtype=torch.long)
            logprobs[k, :length] = torch.tensor(last.logprobs, dtype=torch.float32)
            token_versions[k, :length] = torch.tensor(last.token_versions, dtype=torch.long)
        records.append(_record(session, errors.get(k), rewards.get(k), k in timed_out, episode_versions))
    env = torch.zeros_like(model)
    for k, (_, last) in enumerate(rows):
        if last is not None:
            env[k, : len(last.ids)] = 1 - model[k, : len(last.ids)]
    made_calls = any(s.samples for s in sessions)
    reports = made_calls and all(s.reports_logprobs for s in sessions)
    ids, mask = left_pad([p for p, _ in rows], pad, torch.device("cpu"))
    columns = episode_columns(records)
    columns["agent_error"] = [errors.get(k) for k in range(n)]
    metrics = episode_metrics(records, model, env)
    metrics.update(_agent_metrics(sessions, records, timed_out))
    failed = torch.tensor([k in errors for k in range(n)], dtype=torch.bool)
    return RolloutOutput(
        prompt_ids=ids, prompt_mask=mask, completion_ids=completion_ids, completion_mask=model, env_mask=env,
        truncated=torch.tensor([r.truncated for r in records], dtype=torch.bool),
        completions=[s.last_answer for s in sessions], sampler_logprobs=logprobs if reports else None,
        weight_version=min(versions) if versions else None, episodes=records, columns=columns, metrics=metrics,
        unscored=failed if skip_failed else None, completion_versions=token_versions if versions else None,
    )


def _record(session: AgentSession, error: Optional[str], reward: Optional[float], timed_out: bool,
            versions: set[int]) -> EpisodeRecord:
    last = session.samples[-1] if session.samples else None
    samples = [SampleRecord(calls=list(s.calls), prompt_tokens=len(s.prompt), model_tokens=sum(s.model),
                            env_tokens=len(s.model) - sum(s.model), trained=s is last) for s in session.samples]
    transcript_turns = list(last.turns) if last is not None else []
    return EpisodeRecord(
        turns=transcript_turns, model_turns=sum(len(s.calls) for s in session.samples),
        tool_calls=session.tool_calls, tool_errors=session.tool_errors,
        truncated=(last is not None and not last.finished) or session.budget_exceeded,
        budget_exceeded=session.budget_exceeded, env_reward=reward,
        weight_version=min(versions) if versions else None, done=error is None and not timed_out,
        samples=samples, error=error,
    )


def _agent_metrics(sessions: Sequence[AgentSession], records: Sequence[EpisodeRecord],
                   timed_out: set[int]) -> dict[str, RowMetric]:
    """``agent/errors`` (episodes whose agent raised or timed out), ``agent/timeouts``, ``agent/refused_calls``
    (requests answered with an error, per episode), ``agent/samples_per_episode`` and ``agent/untrained_calls``
    (calls outside the trained sample / calls; 0 without calls)."""
    calls = _per_row([r.model_turns for r in records])
    untrained = _per_row([sum(len(s.calls) for s in r.samples if not s.trained) for r in records])
    return {
        "agent/errors": RowMetric(_per_row([r.error is not None for r in records])),
        "agent/timeouts": RowMetric(_per_row([k in timed_out for k in range(len(records))])),
        "agent/refused_calls": RowMetric(_per_row([s.refused for s in sessions])),
        "agent/samples_per_episode": RowMetric(_per_row([len(r.samples) for r in records])),
        "agent/untrained_calls": RowMetric(untrained, calls, empty=0.0),
    }


def describe(err: BaseException, limit: int = 500) -> str:
    """An exception as ``"TypeName: message"``, cut to ``limit`` characters (also one whose ``str`` raises)."""
    try:
        text = f"{type(err).__name__}: {err}"
    except Exception:  # noqa: BLE001 - a message that cannot be printed
        text = f"{type(err).__name__}: <unprintable message>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def reward_value(value: Any) -> Optional[float]:
    """What an agent returned, as its episode's reward: None, or a finite number (bools count as 0/1).

    Raises:
        TypeError: anything else.
    """
    if value is None:
        return None
    if isinstance(value, (bool, int, float)) and torch.isfinite(torch.tensor(float(value))):
        return float(value)
    raise TypeError(f"the agent returned {value!r}: an agent returns its episode's reward (a finite number) or None")
