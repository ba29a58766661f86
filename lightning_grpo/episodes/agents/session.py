"""An agent's session: the gateway owns its tokenization, so the trained ids are the sampled ids.

A session holds one or more *samples*, each a token sequence: the prompt ids of its first call, then, call after
call, the ids the model sampled (through its EOS, with the sampler's logprobs) and the ids of the messages the agent
added between calls (tool results, user turns: the environment's tokens, context only). A new call either extends the
last sample or starts a new one (prime-rl's extension rule; never a silent splice):

* ``history="keep"`` (default): the call extends the sample when its messages are the sample's messages (the
  request's, then each answer as it was returned, compared by role, content and tool calls; ``reasoning_content`` a
  client sends back is ignored) followed by new ones, the sample's last call ended with EOS and ``tools`` are the
  same. Only the new messages are rendered, cut from the chat template's rendering as for tool results
  (:meth:`lightning_grpo.episodes.chat.ChatFormat.env_turn_ids`), and appended: the model's earlier turns are never
  re-encoded (TRL #5224, eval-protocol PR #457) and keep their reasoning exactly as sampled, so a thinking model's
  episode stays one sample even where its template would drop past ``<think>`` blocks (prime-rl #1334, NeMo-RL
  #2821).
* ``history="strip"``: each call's messages are rendered by the chat template as a whole (the gateway's own answers
  with their reasoning where the messages match them), as the template would show them to the model, which drops
  past reasoning where the template does (Qwen3's, before the last user message); the call extends the sample only
  when the sample's ids are a prefix of that rendering (the rest is appended as environment tokens), else it starts
  a new sample whose prompt is that rendering.

A call that extends nothing (the first, one whose messages rewrote, summarized or dropped turns, other ``tools``, a
sample whose last turn was cut without EOS) starts a new sample: its prompt is the template's rendering of its
messages. Every sample records its calls. Limits: ``max_calls`` per session; a sample's tokens after its prompt within
``budget`` (each call's ``max_tokens`` is cut to what is left; a call with no room left is refused); a new sample's
prompt within ``max_prompt_length``.

A turn cut without EOS (by the call's ``max_tokens`` or the budget) is answered with ``finish_reason: "length"`` and
its text as ``content`` (reasoning split off): a tool call in it is never parsed, so the agent never runs a call the
model did not finish (the turn loop never runs a truncated turn's call either).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from lightning_grpo.episodes.agents.answer import Answer, ReasoningTags, parse_answer, split_reasoning
from lightning_grpo.episodes.agents.openai_schema import ChatCompletionRequest, ChatMessage, GatewayError
from lightning_grpo.episodes.chat import ChatFormat
from lightning_grpo.episodes.parsers import AnswerParser
from lightning_grpo.episodes.tools import ToolCall
from lightning_grpo.protocols.episode import Turn
from lightning_grpo.protocols.sampling import SamplingConfig

_NO_LIMIT = 1 << 40
_PROBE = "lightning-grpo-probe-call-5c1e"


def _arguments(raw: str) -> Any:
    try:
        value = json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        return raw
    return value if isinstance(value, dict) else raw


def template_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """The request's messages as chat templates take them: text content, ``developer`` as ``system``, tool-call
    arguments as objects, each ``tool`` message named after the call it answers."""
    names: dict[str, str] = {}
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.role == "assistant":
            if m.tool_calls:
                d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
                names.update({c.id: c.function.name for c in m.tool_calls})
            if m.reasoning_content is not None:
                d["reasoning_content"] = m.reasoning_content
        elif m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
            d["name"] = m.name or names.get(m.tool_call_id or "", "tool")
        elif m.name:
            d["name"] = m.name
        out.append(d)
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two template messages render alike for the extension rule (reasoning and call ids aside)."""
    def key(m: dict[str, Any]) -> tuple:
        calls = tuple((c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                      for c in m.get("tool_calls") or [])
        return m["role"], m.get("content") or "", calls, m.get("tool_call_id"), m.get("name")
    return key(a) == key(b)


class SessionRenderer:
    """The chat template of a run's sessions: new prompts and appended messages, for any request's ``tools``
    (one :class:`~lightning_grpo.episodes.chat.ChatFormat` per distinct tool list). A template that does not render
    an assistant message's ``tool_calls`` (SmolLM2's) gets them written into its content in the parser's format
    (:meth:`~lightning_grpo.episodes.parsers.AnswerParser.write`), as the model writes them."""

    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int], parser: AnswerParser) -> None:
        self.tokenizer, self.eos_token_ids, self.parser = tokenizer, [int(i) for i in eos_token_ids], parser
        self._formats: dict[str, ChatFormat] = {}
        probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": _PROBE, "arguments": {}}}]}]
        try:
            self.renders_tool_calls = _PROBE in str(tokenizer.apply_chat_template(probe, tokenize=False))
        except Exception:  # noqa: BLE001 - jinja's TemplateError and whatever a template raises for the field
            self.renders_tool_calls = False

    def written(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` with assistant tool calls written into the content where the template drops them."""
        if self.renders_tool_calls:
            return messages
        out = []
        for m in messages:
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = [ToolCall(c["function"]["name"], c["function"]["arguments"]
                                  if isinstance(c["function"]["arguments"], dict) else {}) for c in m["tool_calls"]]
                text = "\n".join(t for t in (m.get("content") or "", self.parser.write(calls)) if t)
                m = {k: v for k, v in m.items() if k != "tool_calls"} | {"content": text}
            out.append(m)
        return out

    def chat(self, tools_key: str, tools: list[dict[str, Any]]) -> ChatFormat:
        if tools_key not in self._formats:
            self._formats[tools_key] = ChatFormat(self.tokenizer, self.eos_token_ids, tools, self.parser)
        return self._formats[tools_key]

    def prompt_ids(self, messages: list[dict[str, Any]], chat: ChatFormat) -> list[int]:
        """The template's rendering of ``messages`` with the generation prompt (tools as the template or the
        parser's instructions describe them)."""
        return chat.encode_prompts([chat.rendered_messages(self.written(messages))], _NO_LIMIT)[0][0]

    def tail_ids(self, messages: list[dict[str, Any]], chat: ChatFormat) -> list[int]:
        """The ids of ``messages`` appended after a model turn's EOS, with the next generation prompt."""
        return chat.env_turn_ids(self.written(messages))


@dataclass
class PreparedCall:
    """One call, tokenized, waiting for the engine."""

    call: int
    new_sample: bool
    prompt_ids: list[int]  # what the engine continues: the sample's ids and the tail, or a new prompt
    tail_ids: list[int]  # the environment's tokens appended to the extended sample ([] for a new sample)
    tail_messages: list[dict[str, Any]]
    messages: list[dict[str, Any]]  # the history the new sample starts from (its prompt's messages)
    tools_key: str
    max_new_tokens: int
    parse_calls: bool
    want_logprobs: bool


@dataclass
class SampleState:
    """One sample of a session while it grows."""

    prompt: list[int]
    history: list[dict[str, Any]]
    tools_key: str
    ids: list[int] = field(default_factory=list)  # after the prompt
    model: list[int] = field(default_factory=list)  # 1 = sampled by the model
    logprobs: list[float] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    finished: bool = False  # its last model turn ended with EOS
    versions: set = field(default_factory=set)
    token_versions: list[int] = field(default_factory=list)  # each token's weight version, -1 = not sampled


class AgentSession:
    """One episode's session (see the module docstring).

    Args:
        index: the episode's row in the rollout.
        renderer: the run's chat template.
        history: ``"keep"`` or ``"strip"``.
        tags: the reasoning tags, or None.
        max_calls: most calls (``episode.max_turns``).
        budget: most tokens of a sample after its prompt (``episode.max_tokens``, else ``max_new_tokens``).
        max_prompt_length: most tokens of a new sample's prompt.
        model_name: the ``model`` of the answers.
    """

    def __init__(self, index: int, renderer: SessionRenderer, *, history: str, tags: Optional[ReasoningTags],
                 max_calls: int, budget: int, max_prompt_length: int, model_name: str) -> None:
        self.index, self.renderer, self.history, self.tags = index, renderer, history, tags
        self.max_calls, self.budget, self.max_prompt_length, self.model_name = (max_calls, budget,
                                                                                 max_prompt_length, model_name)
        self.samples: list[SampleState] = []
        self.calls = 0
        self.refused = 0
        self.tool_calls = 0
        self.tool_errors = 0
        self.budget_exceeded = False
        self.reports_logprobs = True
        self.last_answer = ""
        self.closed = False

    # ------------------------------------------------------------------ a call in
    def prepare(self, request: ChatCompletionRequest, sampling: SamplingConfig) -> PreparedCall:
        """Tokenize one request (see the module docstring).

        Raises:
            GatewayError: 400 for a request the session cannot honour (the field named): sampling fields other than
                the trainer's, a last message from the assistant, ``max_calls`` reached, no room in the budget, a
                prompt over ``max_prompt_length`` (counted in :attr:`refused` by the gateway, as every request
                answered with an error).
        """
        _check_sampling(request, sampling)
        if request.messages[-1].role == "assistant":
            raise GatewayError(400, "the last message is the assistant's: the gateway samples the next assistant "
                               "turn and does not continue a given one", param="messages")
        if self.calls >= self.max_calls:
            raise GatewayError(400, f"this session already made {self.calls} calls, the most an episode may make "
                               "(GRPOConfig.episode.max_turns)", param="messages", code="max_turns_exceeded")
        tools = request.tool_schemas()
        tools_key = json.dumps(tools, sort_keys=True)
        chat = self.renderer.chat(tools_key, tools)
        messages = template_messages(request.messages)
        last = self.samples[-1] if self.samples else None
        if self.history == "strip" and last is not None:
            messages = _with_own_answers(messages, last.history)
        extension = self._extension(last, messages, tools_key, chat)
        if extension is not None and last is not None:
            tail_ids, tail_messages = extension
            prompt_ids, used, new = last.prompt + last.ids + tail_ids, len(last.ids) + len(tail_ids), False
        else:
            tail_ids, tail_messages, new = [], [], True
            prompt_ids, used = self.renderer.prompt_ids(messages, chat), 0
            if len(prompt_ids) > self.max_prompt_length:
                raise GatewayError(400, f"the conversation renders to {len(prompt_ids)} prompt tokens, over "
                                   f"max_prompt_length={self.max_prompt_length}", param="messages",
                                   code="context_length_exceeded")
        room = self.budget - used
        if room < 1:
            self.budget_exceeded = True
            raise GatewayError(400, f"the episode's token budget ({self.budget} tokens after its prompt, "
                               "GRPOConfig.episode.max_tokens) leaves no room for another turn", param="messages",
                               code="context_length_exceeded")
        limit = request.completion_limit() or _NO_LIMIT
        self.calls += 1
        return PreparedCall(self.calls - 1, new, prompt_ids, tail_ids, tail_messages, messages, tools_key,
                            min(sampling.max_new_tokens, limit, room), request.tool_choice != "none",
                            bool(request.logprobs))

    def _extension(self, last: Optional[SampleState], messages: list[dict[str, Any]], tools_key: str,
                   chat: ChatFormat) -> Optional[tuple[list[int], list[dict[str, Any]]]]:
        """``(tail ids, tail messages)`` when the call extends ``last``, else None."""
        if last is None or last.tools_key != tools_key:
            return None
        history = last.history
        matches = len(messages) > len(history) and all(_same(m, h) for m, h in zip(messages, history, strict=False))
        tail = messages[len(history):] if matches else []
        if self.history == "keep":
            if not matches or not last.finished:
                return None
            return self.renderer.tail_ids(tail, chat), tail
        held = last.prompt + last.ids
        full = self.renderer.prompt_ids(messages, chat)
        if len(full) <= len(held) or full[: len(held)] != held:
            return None
        return full[len(held):], tail

    # ------------------------------------------------------------------ the engine's answer
    def record(self, call: PreparedCall, ids: list[int], logprobs: Optional[list[float]],
               versions: Optional[list[int]]) -> dict[str, Any]:
        """Append the sampled turn to its sample and build the OpenAI answer (``prompt_token_ids`` = the ids the
        engine continued, ``choices[0].token_ids`` = the sampled ids, ``logprobs`` the sampler's when asked and
        reported, else null). ``versions``: the weight version of each sampled id (-1 = unknown), or None when the
        engine reported none."""
        tokenizer = self.renderer.tokenizer
        if call.new_sample:
            self.samples.append(SampleState(list(call.prompt_ids), list(call.messages), call.tools_key))
        sample = self.samples[-1]
        if call.tail_ids:
            start = len(sample.ids)
            sample.ids += call.tail_ids
            sample.model += [0] * len(call.tail_ids)
            sample.logprobs += [0.0] * len(call.tail_ids)
            sample.token_versions += [-1] * len(call.tail_ids)
            sample.turns.append(Turn("env", start, len(sample.ids), [dict(m) for m in call.tail_messages]))
            sample.history += call.tail_messages
        text = tokenizer.decode(ids, skip_special_tokens=True)
        finished = bool(ids) and ids[-1] in self.renderer.eos_token_ids
        if call.parse_calls and finished:
            answer = parse_answer(text, self.renderer.parser, self.tags, f"call_{call.call}")
        else:  # tool_choice "none", or a turn cut without EOS: its calls are never run (as in the turn loop)
            reasoning, rest = split_reasoning(text, self.tags)
            answer = Answer(content=rest, reasoning=reasoning)
        start = len(sample.ids)
        sample.ids += ids
        sample.model += [1] * len(ids)
        sample.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)
        self.reports_logprobs &= logprobs is not None
        own = _template_answer(answer)
        sample.turns.append(Turn("model", start, len(sample.ids), [own]))
        sample.history.append(own)
        sample.calls.append(call.call)
        sample.finished = finished
        turn_versions = [-1] * len(ids) if versions is None else [int(v) for v in versions]
        sample.token_versions += turn_versions
        sample.versions.update(v for v in turn_versions if v >= 0)
        self.tool_calls += len(answer.tool_calls) + answer.tool_errors  # every call the model wrote, as the turn loop
        self.tool_errors += answer.tool_errors
        self.last_answer = answer.content or ""
        finish = "tool_calls" if answer.tool_calls else ("stop" if sample.finished else "length")
        lp = None
        if call.want_logprobs and logprobs is not None:
            lp = {"content": [{"token": tokenizer.decode([t]), "logprob": float(v), "bytes": None,
                               "top_logprobs": []} for t, v in zip(ids, logprobs, strict=True)]}
        return {
            "id": f"chatcmpl-{self.index}-{call.call}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name, "prompt_token_ids": list(call.prompt_ids),
            "choices": [{"index": 0, "message": answer.message(), "finish_reason": finish, "logprobs": lp,
                         "token_ids": list(ids)}],
            "usage": {"prompt_tokens": len(call.prompt_ids), "completion_tokens": len(ids),
                      "total_tokens": len(call.prompt_ids) + len(ids)},
        }


def _template_answer(answer: Answer) -> dict[str, Any]:
    """The session's own answer as a template message (arguments as objects, reasoning kept)."""
    out: dict[str, Any] = {"role": "assistant", "content": answer.content or ""}
    if answer.tool_calls:
        out["tool_calls"] = [{"id": c["id"], "type": "function",
                              "function": {"name": c["function"]["name"],
                                           "arguments": json.loads(c["function"]["arguments"])}}
                             for c in answer.tool_calls]
    if answer.reasoning is not None:
        out["reasoning_content"] = answer.reasoning
    return out


def _with_own_answers(messages: list[dict[str, Any]], history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with each assistant message that matches the history's at its position replaced by the
    history's (the gateway's own answer, with its reasoning), as long as the two agree."""
    out = list(messages)
    for i, (m, h) in enumerate(zip(messages, history, strict=False)):
        if not _same(m, h):
            break
        if m["role"] == "assistant":
            out[i] = h
    return out


def _check_sampling(request: ChatCompletionRequest, sampling: SamplingConfig) -> None:
    """The request's sampling fields may only repeat the trainer's (it scores the distribution it samples)."""
    temperature = 0.0 if sampling.greedy else sampling.temperature
    if request.temperature is not None and abs(request.temperature - temperature) > 1e-9:
        raise GatewayError(400, f"temperature={request.temperature} differs from the trainer's sampling "
                           f"(temperature={temperature}): the trainer scores the distribution it samples from; leave "
                           "it unset", param="temperature")
    if request.top_p is not None and not sampling.greedy and abs(request.top_p - sampling.top_p) > 1e-9:
        raise GatewayError(400, f"top_p={request.top_p} differs from the trainer's sampling (top_p={sampling.top_p}):"
                           " leave it unset", param="top_p")
