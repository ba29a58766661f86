"""Unmodified agents as rollouts: ``GRPOModule(agent=fn)`` (docs/agents.md).

``fn(base_url, api_key, row)`` is any agent code (a plain function or ``async def``) that talks to the model through
an OpenAI client pointed at ``base_url`` with ``api_key`` (the OpenAI Agents SDK, LangGraph, the ``openai`` client,
...); ``row`` is the episode's dataset row (every column, "prompt" included). It may return the episode's reward (a
number: the ``env_reward`` column, as an environment's), else the reward functions score the final answer
(``completions``: the content of the episode's last model call) and the ``transcript``.

Each rollout (training, asynchronous prefetch, evaluation) starts a gateway (:mod:`lightning_grpo.episodes.agents.
gateway`, on 127.0.0.1, a new key per rollout) with one session per episode, G per prompt, runs the ``B * G`` agents
at once (each on a thread of its own; an ``async def`` agent in its own event loop there), and batches their
concurrent calls into ``engine.generate`` calls (:mod:`lightning_grpo.episodes.agents.batcher`) on the rollout's
thread, the one that owns the engine, as the turn loop does; the gateway stops when every agent is done. The
sessions own the tokenization (:mod:`lightning_grpo.episodes.agents.session`); each episode becomes one training row
(:mod:`lightning_grpo.episodes.agents.output`).

An agent that raises (any exception, ``SystemExit`` included) or runs past ``timeout_s`` (its own time: the time its
calls wait for the engine does not count) never stops the trainer: its
episode is recorded (``agent/errors``, ``agent/timeouts``, the ``agent_error`` column, :attr:`EpisodeRecord.error`)
and scored as ``on_error`` says. A timed-out agent's thread cannot be stopped by Python: its session is closed, so its
next call fails (404) and a call it was waiting for is answered 408.
"""

from __future__ import annotations

import asyncio
import inspect
import secrets
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal, Optional, Sequence

from lightning_grpo.episodes.agents.answer import ReasoningTags
from lightning_grpo.episodes.agents.batcher import CallBatcher, PendingCall
from lightning_grpo.episodes.agents.openai_schema import ChatCompletionRequest, GatewayError
from lightning_grpo.episodes.agents.output import agent_output, describe, reward_value
from lightning_grpo.episodes.agents.session import AgentSession, SessionRenderer
from lightning_grpo.episodes.parsers import AnswerParser, HermesToolCallParser
from lightning_grpo.protocols.engine import RolloutEngine
from lightning_grpo.protocols.rollout import RolloutInterrupted, RolloutOutput, StopFlag
from lightning_grpo.protocols.sampler import AnyProcess, EncodedPrompts
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.rollout.prompts import TemplatePrompts

#: An agent: ``fn(base_url, api_key, row) -> reward or None`` (or an ``async def`` returning one).
AgentFn = Callable[[str, str, dict], Any]


@dataclass
class AgentRollout:
    """An agent and how its episodes are run (``GRPOModule(agent=AgentRollout(fn, ...))``; a plain ``fn`` gets the
    defaults).

    Attributes:
        fn: the agent, ``fn(base_url, api_key, row)`` (see the module docstring).
        timeout_s: most seconds one episode's agent may run, not counting the time its calls wait for the engine
            (a slow engine is not the agent's doing).
        on_error: an episode whose agent raised or timed out: ``"score"`` (the reward functions score what it
            produced; its ``agent_error`` column says what happened) or ``"skip"`` (no reward: no loss, left out of
            its group's statistics).
        history: ``"keep"`` (append new messages to the sampled ids; past reasoning stays as sampled) or ``"strip"``
            (render each call as the chat template does, which drops past reasoning where it does; a call whose
            rendering does not extend the sample starts a new one): :mod:`lightning_grpo.episodes.agents.session`.
        reasoning_tags: the tags around reasoning, split into ``reasoning_content`` before tool calls are parsed;
            None: no reasoning split.
        tool_parser: the model's tool-call format (:class:`~lightning_grpo.episodes.parsers.AnswerParser`);
            default Hermes / Qwen ``<tool_call>`` JSON.
        batch_window_s: how long a call waits for other agents' calls to share its engine call.
        max_concurrent_requests: most requests the gateway serves at once (more get 429); None: two per episode of
            the rollout, plus 16.
        max_body_mib: the largest request body.
        model_name: the model's name in answers and ``/v1/models`` (any ``model`` a request names is accepted).

    Raises:
        TypeError: ``fn`` is not callable.
        ValueError: a setting out of range (named).
    """

    fn: AgentFn
    timeout_s: float = 600.0
    on_error: Literal["score", "skip"] = "score"
    history: Literal["keep", "strip"] = "keep"
    reasoning_tags: Optional[ReasoningTags] = field(default_factory=ReasoningTags)
    tool_parser: Optional[AnswerParser] = None
    batch_window_s: float = 0.05
    max_concurrent_requests: Optional[int] = None
    max_body_mib: float = 16.0
    model_name: str = "policy"

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise TypeError(f"AgentRollout.fn must be callable fn(base_url, api_key, row), got {self.fn!r}")
        for name in ("timeout_s", "batch_window_s", "max_body_mib"):
            if not getattr(self, name) > 0:
                raise ValueError(f"AgentRollout.{name}={getattr(self, name)!r} must be > 0")
        if self.max_concurrent_requests is not None and self.max_concurrent_requests < 1:
            raise ValueError(f"AgentRollout.max_concurrent_requests={self.max_concurrent_requests} must be >= 1")
        if self.on_error not in ("score", "skip"):
            raise ValueError(f"AgentRollout.on_error={self.on_error!r} is invalid: 'score' or 'skip'")
        if self.history not in ("keep", "strip"):
            raise ValueError(f"AgentRollout.history={self.history!r} is invalid: 'keep' or 'strip'")


@dataclass
class _Run:
    """One rollout's sessions while it runs: the gateway's
    :class:`~lightning_grpo.episodes.agents.gateway.ChatBackend` for that rollout."""

    sessions: dict[str, AgentSession]
    order: list[AgentSession]
    batcher: CallBatcher
    sampling: SamplingConfig
    deadlines: list[float]
    model_name: str
    errors: dict[int, str] = field(default_factory=dict)
    rewards: dict[int, Optional[float]] = field(default_factory=dict)
    timed_out: set[int] = field(default_factory=set)
    locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    guard: threading.Lock = field(default_factory=threading.Lock)

    def has_session(self, session: str) -> bool:
        return session in self.sessions and not self.sessions[session].closed

    def refused(self, session_id: str) -> None:
        """A request of ``session_id`` was answered with an error (``agent/refused_calls``; an unknown one: none)."""
        with self.guard:
            if session_id in self.sessions:
                self.sessions[session_id].refused += 1

    async def chat(self, session_id: str, request: ChatCompletionRequest) -> dict[str, Any]:
        """One call of a session: tokenize, wait for its batch's engine call, answer (see :mod:`.session`)."""
        if not self.has_session(session_id):
            raise GatewayError(404, f"no open session {session_id!r}", kind="not_found_error")
        session = self.sessions[session_id]
        lock = self.locks.setdefault(session_id, asyncio.Lock())
        async with lock:
            with self.guard:
                if session.closed:
                    raise GatewayError(404, f"session {session_id!r} is over", kind="not_found_error")
                prepared = session.prepare(request, self.sampling)
                try:
                    future = self.batcher.submit(session.index, prepared)
                except RuntimeError as err:
                    raise GatewayError(404, f"session {session_id!r} is over", kind="not_found_error") from err
            waiting = time.monotonic()
            result = await asyncio.wrap_future(future)
            with self.guard:
                self.deadlines[session.index] += time.monotonic() - waiting  # engine time is not the agent's
                if session.closed:
                    raise GatewayError(408, "the episode timed out while this call was generated", code="timeout")
                return session.record(prepared, *result)


class AgentSampler:
    """The rollout path of ``GRPOModule(agent=...)``: a :class:`~lightning_grpo.protocols.sampler.Sampler` and
    :class:`~lightning_grpo.protocols.sampler.PromptEncoder` (the dataset's prompts with the chat template: only the
    rows of episodes without a call use them; the agent writes its own prompts).

    Args:
        agent: the agent and its settings.
        tokenizer: the policy's tokenizer (with a chat template).
        eos_token_ids: the ids that end a model turn.
        max_turns: most model calls per episode (``episode.max_turns``).
        max_tokens: a sample's token budget after its prompt (``episode.max_tokens``; None = ``max_new_tokens``).
        max_prompt_length: most tokens of a sample's prompt (``GRPOConfig.max_prompt_length``).
        stop: polled while the agents run.

    Raises:
        ValueError: the tokenizer has no chat template.
    """

    def __init__(self, agent: AgentRollout, tokenizer: Any, eos_token_ids: Sequence[int], *, max_turns: int,
                 max_tokens: Optional[int], max_prompt_length: int, stop: Optional[StopFlag] = None) -> None:
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("GRPOModule(agent=...) needs a tokenizer with a chat template (the agents' messages are "
                             "rendered with it): set tokenizer.chat_template")
        self.agent = agent
        self.model_name = agent.model_name
        self.renderer = SessionRenderer(tokenizer, eos_token_ids, agent.tool_parser or HermesToolCallParser())
        self.prompts = TemplatePrompts(tokenizer)
        self.max_turns, self.max_tokens, self.max_prompt_length = max_turns, max_tokens, max_prompt_length
        self.stop = stop if stop is not None else StopFlag()

    def encode_prompts(self, prompts: Sequence[Any], max_prompt_length: int) -> tuple[list[list[int]], int]:
        """The dataset's prompts with the chat template (:class:`~lightning_grpo.rollout.prompts.TemplatePrompts`)."""
        return self.prompts.encode_prompts(prompts, max_prompt_length)

    # ------------------------------------------------------------------ the rollout
    def sample(self, engine: RolloutEngine, prompts: EncodedPrompts, num_generations: int, sampling: SamplingConfig,
               any_process: Optional[AnyProcess] = None) -> RolloutOutput:
        """Run ``B * G`` agent episodes (prompt-major) through a gateway (see the module docstring); the agents of
        prompt i get its dataset row ``prompts.rows[i]``, and ``prompts.ids[i]`` is the row of an episode without a
        call (text prompts: the agent gateway serves text).

        Raises:
            RolloutInterrupted: the stop flag was set (on any process, with lockstep).
            RuntimeError: an episode was sampled by more than one weight version; the engine failed.
        """
        b, g, prompt_ids = len(prompts), num_generations, prompts.ids
        n = b * g
        budget = self.max_tokens or sampling.max_new_tokens
        order = [AgentSession(k, self.renderer, history=self.agent.history, tags=self.agent.reasoning_tags,
                              max_calls=self.max_turns, budget=budget, max_prompt_length=self.max_prompt_length,
                              model_name=self.model_name) for k in range(n)]
        ids = [f"{k}-{secrets.token_hex(8)}" for k in range(n)]
        now = time.monotonic()
        run = _Run(dict(zip(ids, order, strict=True)), order, CallBatcher(range(n), self.agent.batch_window_s),
                   sampling, [now + self.agent.timeout_s] * n, self.model_name)
        from lightning_grpo.episodes.agents.gateway import Gateway  # FastAPI and uvicorn, imported when used

        gateway = Gateway(run, max_body_bytes=int(self.agent.max_body_mib * 2**20),
                          max_concurrent=self.agent.max_concurrent_requests or 2 * n + 16).start()
        try:
            for k in range(n):
                threading.Thread(target=self._agent, args=(run, k, gateway.base_url(ids[k]),
                                                           gateway.session_key(ids[k]), dict(prompts.rows[k // g])),
                                 name=f"agent-{k}", daemon=True).start()
            lockstep = engine.capabilities.uses_policy_parameters  # HF under FSDP: the processes agree on the calls
            self._serve(run, engine, sampling, prompt_ids, any_process if lockstep else None)
        except BaseException as err:
            run.batcher.fail_all(GatewayError(503, f"the rollout stopped: {describe(err)}", kind="server_error"))
            raise
        finally:
            with run.guard:
                for session in order:
                    session.closed = True
            gateway.close()
        return agent_output(order, prompt_ids, g, int(engine.pad_token_id), dict(run.errors), dict(run.rewards),
                            set(run.timed_out), self.agent.on_error == "skip")

    def _agent(self, run: _Run, k: int, base_url: str, api_key: str, row: dict) -> None:
        """Episode ``k``'s agent, on its own thread; what it returns or raises is recorded, never raised."""
        try:
            result = self.agent.fn(base_url, api_key, row)
            if inspect.isawaitable(result):
                result = asyncio.run(_awaited(result))
            reward = reward_value(result)
            with run.guard:
                if k not in run.timed_out:
                    run.rewards[k] = reward
        except BaseException as err:  # noqa: BLE001 - agent code: SystemExit and the rest are its episode's outcome
            with run.guard:
                if k not in run.timed_out:
                    run.errors[k] = describe(err)
        finally:
            run.batcher.finish(k)

    def _tick(self, run: _Run, lockstep: bool) -> None:
        """While waiting for calls: time out agents past their deadline; raise on a stop request."""
        if not lockstep:
            self.stop.check("the agent episodes")
        now = time.monotonic()
        for k, deadline in enumerate(run.deadlines):
            if now > deadline and k in run.batcher.running and k not in run.batcher.pending:
                with run.guard:
                    run.timed_out.add(k)
                    run.errors[k] = f"TimeoutError: the agent ran past timeout_s={self.agent.timeout_s:g} s"
                    run.order[k].closed = True
                run.batcher.finish(k, GatewayError(408, "the episode timed out", code="timeout"))

    def _serve(self, run: _Run, engine: RolloutEngine, sampling: SamplingConfig,
               prompt_ids: Sequence[Sequence[int]], any_process: Optional[AnyProcess]) -> None:
        """Answer batches of calls with the engine until every agent is done (with ``any_process``: until every
        process's are, a process without calls joining the others' engine calls with a one-token ``generate``)."""
        lockstep = any_process is not None
        rounds = 0
        while True:
            batch = run.batcher.collect(lambda: self._tick(run, lockstep), return_empty=lockstep)
            if any_process is not None:
                if any_process(self.stop.is_set()):
                    raise RolloutInterrupted("the agent episodes were stopped by a stop request (e.g. SIGTERM)")
                if not any_process(batch is not None):
                    return
                if not batch:
                    engine.generate([list(prompt_ids[0])], 1, replace(sampling, max_new_tokens=1))
                    continue
            elif batch is None:
                return
            assert batch is not None
            seed = None if sampling.seed is None else sampling.seed + rounds * len(run.order)
            self._generate(engine, batch, replace(sampling, seed=seed))
            rounds += 1

    @staticmethod
    def _generate(engine: RolloutEngine, batch: list[PendingCall], sampling: SamplingConfig) -> None:
        """One engine call for ``batch``; each call's completion cut to its own ``max_new_tokens``."""
        limit = max(p.call.max_new_tokens for p in batch)
        try:
            out = engine.generate([p.call.prompt_ids for p in batch], 1, replace(sampling, max_new_tokens=limit))
        except BaseException as err:
            for pending in batch:
                pending.future.set_exception(GatewayError(503, f"the engine failed: {describe(err)}",
                                                          kind="server_error"))
            raise
        for r, pending in enumerate(batch):
            length = min(int(out.completion_mask[r].sum()), pending.call.max_new_tokens)
            ids = [int(t) for t in out.completion_ids[r, :length].tolist()]
            logprobs = None if out.sampler_logprobs is None else [float(v) for v in out.sampler_logprobs[r, :length]]
            if out.completion_versions is not None:  # per token: the engine took weights while it generated
                versions: Optional[list[int]] = [int(v) for v in out.completion_versions[r, :length].tolist()]
            else:
                versions = None if out.weight_version is None else [int(out.weight_version)] * length
            if not pending.future.done():
                pending.future.set_result((ids, logprobs, versions))


async def _awaited(value: Any) -> Any:
    return await value
