"""A scripted :class:`~lightning_grpo.protocols.streaming.StreamingEngine` for the streaming tests: deterministic
tokens, each stamped with the weight version the engine holds when it is "sampled", and timing controlled by gates
(events), never by sleeps.

A group's G completions are sampled token by token in lockstep (token t of every completion, then t + 1), yielding
to the event loop between tokens, so groups in flight interleave. Before token t a group passes its gates in order:

* ``Gate(at=t, version=v)``: wait until the engine holds weights of version >= v (the trainer's update);
* ``Gate(at=t, after=k)``: wait until group ``k`` has been sampled (so groups finish in an order the test fixes);
* ``Gate(at=t, lose=n)``: on the group's ``n``-th attempt, the engine is lost here (``EngineUnavailable``).

Logprobs: ``logprob(prompt_ids, ids)`` (the sampler's logprob of ``ids[-1]`` after ``prompt_ids + ids[:-1]``) under the
weights held (a :class:`ModelLogprobs` scores with a copy of the policy loaded from each update), else
``-0.1 * (position + 1)``.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from lightning_grpo.protocols.streaming import (
    EngineUnavailable,
    GroupRequest,
    SampledCompletion,
    SampledGroup,
    WeightUpdate,
)
from lightning_grpo.protocols.weights import PolicyWeights


@dataclass(frozen=True)
class Gate:
    """Something a group waits for, or a loss it meets, before its token ``at`` (see the module docstring)."""

    at: int
    version: Optional[int] = None
    after: Optional[int] = None
    lose: Optional[int] = None


class ModelLogprobs:
    """The sampler's logprobs under a copy of the policy: loaded from every weight update's tensors (temperature 1,
    the full vocabulary, float32 on the CPU), scored with a full forward pass per token."""

    def __init__(self, model: torch.nn.Module) -> None:
        import copy

        self.model = copy.deepcopy(model).eval()
        self.lock = threading.Lock()

    def load(self, weights: PolicyWeights) -> None:
        state = dict(weights.tensors())
        with self.lock, torch.no_grad():
            self.model.load_state_dict(state, strict=False)

    def __call__(self, prompt_ids: list[int], ids: list[int]) -> float:
        sequence = torch.tensor([prompt_ids + ids])
        with self.lock, torch.no_grad():
            logits = self.model(sequence).logits[0, -2].float()
        return float(torch.log_softmax(logits, dim=-1)[ids[-1]])


class ScriptedStreamingEngine:
    """See the module docstring.

    Args:
        script: ``script(key, j) -> ids`` of completion j of group ``key`` (cut at ``max_new_tokens``; it ends with
            finish reason "stop" when its last id is ``eos``, else "length").
        eos: the EOS id.
        gates: ``key -> gates`` of that group.
        logprob: the sampler's logprobs (see the module docstring), or None.
        paused_s: ``paused_s(version)``, what an update to ``version`` reports as the time generation paused.

    Attributes:
        version: the weight version held (-1 before the first update).
        updates: ``(version, thread name)`` of every update, in order.
        requests: ``(key, attempt, seed)`` of every group requested.
        sampled: ``(key, attempt) -> versions`` of each token of completion 0 of every group sampled to its end.
        finished: keys in the order their groups were sampled to the end.
        lost: ``(key, attempt)`` of every group lost.
    """

    def __init__(self, script: Callable[[int, int], list[int]], eos: int = 2,
                 gates: Optional[dict[int, list[Gate]]] = None, logprob: Optional[ModelLogprobs] = None,
                 paused_s: Callable[[int], float] = lambda version: 0.0) -> None:
        self.script, self.eos, self.gates = script, eos, dict(gates or {})
        self.logprob, self.paused_s = logprob, paused_s
        self.version = -1
        self.updates: list[tuple[int, str]] = []
        self.requests: list[tuple[int, int, Optional[int]]] = []
        self.sampled: dict[tuple[int, int], list[int]] = {}
        self.finished: list[int] = []
        self.lost: list[tuple[int, int]] = []
        self.closed = False
        self._attempts: dict[int, int] = {}
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._waiters: list[tuple[Callable[[], bool], asyncio.Future]] = []

    # ---------------------------------------------------------------- waiting, on the loop's thread
    def _changed(self) -> None:
        for waiter in list(self._waiters):
            ready, future = waiter
            if ready() and not future.done():
                future.set_result(None)
            if future.done():
                self._waiters.remove(waiter)

    async def _until(self, ready: Callable[[], bool]) -> None:
        if ready():
            return
        assert self._loop is not None
        future = self._loop.create_future()
        self._waiters.append((ready, future))
        await future

    async def _pass(self, gate: Gate, key: int, attempt: int) -> None:
        if gate.lose is not None and gate.lose == attempt:
            self.lost.append((key, attempt))
            raise EngineUnavailable(f"scripted engine lost group {key} (attempt {attempt})")
        if gate.version is not None:
            await self._until(lambda: self.version >= gate.version)
        if gate.after is not None:
            await self._until(lambda: gate.after in self.finished)

    # ---------------------------------------------------------------- StreamingEngine
    async def sample_group(self, request: GroupRequest) -> SampledGroup:
        self._loop = asyncio.get_running_loop()
        key = request.key
        attempt = self._attempts[key] = self._attempts.get(key, 0) + 1
        self.requests.append((key, attempt, request.seed))
        g, limit = request.num_generations, request.sampling.max_new_tokens
        scripts = [list(self.script(key, j))[:limit] for j in range(g)]
        versions: list[list[int]] = [[] for _ in range(g)]
        logprobs: list[list[float]] = [[] for _ in range(g)]
        gates = sorted(self.gates.get(key, []), key=lambda gate: gate.at)
        length = max(len(s) for s in scripts)
        prompt = list(request.prompt_ids)
        for t in range(length + 1):
            for gate in (gate for gate in gates if gate.at == t):
                await self._pass(gate, key, attempt)
            if t == length:
                break
            await asyncio.sleep(0)  # the other groups in flight sample too
            held = self.version
            for j, ids in enumerate(scripts):
                if t < len(ids):
                    versions[j].append(held)
                    logprobs[j].append(self.logprob(prompt, ids[: t + 1]) if self.logprob is not None
                                       else -0.1 * (t + 1))
        self.sampled[(key, attempt)] = versions[0]
        self.finished.append(key)
        self._changed()
        completions = [SampledCompletion(ids, lp, v, "stop" if ids and ids[-1] == self.eos else "length")
                       for ids, lp, v in zip(scripts, logprobs, versions, strict=True)]
        return SampledGroup(request, completions, engine="scripted", attempts=attempt)

    def update_weights(self, weights: PolicyWeights, version: int) -> WeightUpdate:
        if self.logprob is not None:
            self.logprob.load(weights)
        self.version = version
        self.updates.append((version, threading.current_thread().name))
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._changed)
        return WeightUpdate(version=version, seconds=0.0, paused_s=self.paused_s(version), engines=1)

    def close(self) -> None:
        self.closed = True
