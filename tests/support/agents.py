"""Helpers of the agent-gateway tests: run agent functions through an :class:`~lightning_grpo.episodes.AgentSampler`
on a scripted engine (whose model turns depend on the prompt it is given), and agents written against the real
``openai`` client."""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

from openai import OpenAI

from lightning_grpo.episodes import AgentRollout, AgentSampler
from lightning_grpo.protocols.sampler import EncodedPrompts
from lightning_grpo.protocols.sampling import SamplingConfig
from support.episodes import ScriptedEngine

EOS = 2  # SmolLM2's <|im_end|>
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123 * 456"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object",
                                                          "properties": {"expression": {"type": "string"}},
                                                          "required": ["expression"]}}}]


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def by_prompt(tokenizer, first: list[int], later: list[int], marker: str = "<|im_start|>tool") -> Callable:
    """A script: ``later`` when the prompt's last turn is a tool result (its decoded text holds ``marker`` after the
    last user turn), else ``first``."""

    def script(call: int, row: int, prompt: list[int]) -> list[int]:
        text = tokenizer.decode(prompt)
        tail = text[text.rfind("<|im_start|>user"):]
        return later if marker in tail else first

    return script


class Recorder:
    """What the agents saw: every answer (as a dict) by session, and the agents' own notes."""

    def __init__(self) -> None:
        self.answers: dict[int, list[dict]] = {}
        self.notes: dict[int, Any] = {}
        self.lock = threading.Lock()

    def add(self, row: dict, answer: Any) -> None:
        with self.lock:
            self.answers.setdefault(row.get("k", 0), []).append(answer.model_dump())


def run_agents(tokenizer, agent: Callable, script: Optional[Callable] = None, *, rows: Optional[list[dict]] = None,
               g: int = 1, engine: Any = None, max_turns: int = 8, max_tokens: int = 400,
               sampling: Optional[SamplingConfig] = None, **settings: Any):
    """``B * G`` episodes of ``agent`` (``rows``: one per prompt, default one row ``{"question": ...}``) on
    ``engine`` (default a :class:`ScriptedEngine` of ``script``); returns ``(rollout, engine, sampler)``."""
    rows = rows if rows is not None else [{"prompt": "q", "question": "What is 123 * 456?"}]
    engine = engine if engine is not None else ScriptedEngine(tokenizer, script)
    sampler = AgentSampler(AgentRollout(agent, **settings), tokenizer, [EOS], max_turns=max_turns,
                           max_tokens=max_tokens, max_prompt_length=2048)
    ids, _ = sampler.encode_prompts([r.get("prompt", "q") for r in rows], 512)
    out = sampler.sample(engine, EncodedPrompts.of(ids, rows), g, sampling or SamplingConfig(max_new_tokens=64))
    return out, engine, sampler


def client(base_url: str, api_key: str) -> OpenAI:
    """The real ``openai`` client, no retries (a test sees every error)."""
    return OpenAI(base_url=base_url, api_key=api_key, max_retries=0)


def tool_loop_agent(recorder: Recorder, result: str = "56088", calls: int = 2, **create: Any) -> Callable:
    """An agent written against the ``openai`` client: asks the question with the calculator tool, answers each of
    the model's tool calls with ``result``, until the model answers without a call or ``calls`` calls were made;
    records every answer."""

    def agent(base_url: str, api_key: str, row: dict) -> None:
        chat = client(base_url, api_key)
        messages: list[dict] = [{"role": "user", "content": row["question"]}]
        for _ in range(calls):
            answer = chat.chat.completions.create(model="policy", messages=messages, tools=TOOLS, **create)
            recorder.add(row, answer)
            message = answer.choices[0].message
            messages.append(message.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio",
                                                                           "function_call"}))
            if not message.tool_calls:
                return
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})

    return agent
