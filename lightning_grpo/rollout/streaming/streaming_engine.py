"""Streaming engines by name, and a streaming engine seen as a plain rollout engine.

:func:`make_streaming_engine` makes the :class:`~lightning_grpo.protocols.streaming.StreamingEngine` that
``streaming.enabled`` samples with: for ``engine.name="vllm_server"`` the rollout servers' pool (its factory in
:data:`STREAMING_ENGINES`, imported on first use; ``spec.config.engine`` holds its URLs, secret and timeouts), or one a
user registered (:func:`register_streaming_engine`); any other engine is an error naming the fields. Nothing else in
the package asks which streaming engine it is.

:class:`StreamingRolloutEngine` is that engine as a :class:`~lightning_grpo.protocols.engine.RolloutEngine` (the
rollout worker's engine in streaming mode): validation, ``GRPOModule.generate`` and every other one-off rollout call
its ``generate``, which samples each prompt's group on the streaming engine, all at once, and waits for them. It
owns the engine's event loop (:class:`~lightning_grpo.rollout.streaming.event_loop.EngineLoop`), which the producer
runs on too. Its weights are sent with a version by the worker (``StreamingEngine.update_weights``), never by
``sync_weights``.
"""

from __future__ import annotations

import asyncio
import importlib
from typing import Any, Callable, Optional, Sequence

from lightning_grpo.protocols.engine import EngineCapabilities
from lightning_grpo.protocols.rollout import RolloutOutput
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.protocols.streaming import GroupRequest, StreamingEngine
from lightning_grpo.protocols.weights import PolicyWeights
from lightning_grpo.rollout.adapter import declared_members
from lightning_grpo.rollout.engine_registry import EngineSpec
from lightning_grpo.rollout.streaming.event_loop import EngineLoop
from lightning_grpo.rollout.streaming.scored_groups import group_rollout

StreamingEngineFactory = Callable[[EngineSpec], StreamingEngine]

#: Built-in streaming engines: ``engine.name`` -> "module:factory", imported when first made. The rollout servers'
#: pool (``ServerPool``, one vLLM AsyncLLM server per URL with in-flight weight updates) lives beside the server.
STREAMING_ENGINES: dict[str, str] = {
    "vllm_server": "lightning_grpo.rollout.server.server_pool:make_pool",
}
_REGISTERED: dict[str, StreamingEngineFactory] = {}


def register_streaming_engine(name: str, factory: StreamingEngineFactory) -> None:
    """Make ``streaming.enabled`` with ``engine.name=name`` sample with ``factory(spec)``.

    Raises:
        ValueError: ``name`` is a built-in streaming engine's, or already registered.
    """
    if name in STREAMING_ENGINES or name in _REGISTERED:
        raise ValueError(f"streaming engine name {name!r} is taken: choose another")
    _REGISTERED[name] = factory


def make_streaming_engine(spec: EngineSpec) -> StreamingEngine:
    """The streaming engine for ``spec.name`` (``engine.name``, "auto" resolved).

    Raises:
        ValueError: no streaming engine has that name (the fields and the alternatives named).
        ImportError: the rollout servers' pool is not in this installation (named).
    """
    factory = _REGISTERED.get(spec.name)
    if factory is None:
        if spec.name not in STREAMING_ENGINES:
            names = ", ".join(repr(n) for n in [*STREAMING_ENGINES, *_REGISTERED])
            raise ValueError(
                f"GRPOConfig.streaming.enabled=True samples groups on engines that take weights in flight "
                f"(a StreamingEngine): GRPOConfig.engine.name={spec.name!r} has none. Use engine.name in ({names}) "
                "(the rollout servers: engine.name='vllm_server' with engine.server_urls), give one "
                "(GRPOModule.streaming_engine = engine), or use the fixed schedule (streaming.enabled=False, "
                "max_staleness=k)")
        module, function = STREAMING_ENGINES[spec.name].split(":")
        try:
            imported = importlib.import_module(module)
        except ImportError as err:
            raise ImportError(f"GRPOConfig.streaming.enabled=True with engine.name={spec.name!r} needs {module} "
                              f"(the rollout servers' pool), which this installation lacks: {err}") from err
        factory = getattr(imported, function)
    return factory(spec)


class StreamingRolloutEngine:
    """A :class:`StreamingEngine` as a rollout engine (see the module docstring).

    Args:
        engine: the streaming engine.
        tokenizer: decodes the completions' texts.
        pad_token_id: pads the ids.

    Attributes:
        streaming: the streaming engine.
        loop: the event loop it is driven from.
        capabilities: per-request seeds, and the routed experts when the streaming engine declares
            ``returns_routed_experts`` (a capability declared as a user engine declares one: the rollout servers' pool
            under routing replay "R3"), its completions then carrying them among their ``extra`` fields.
    """

    def __init__(self, engine: StreamingEngine, tokenizer: Any, pad_token_id: int) -> None:
        routed = bool(declared_members(engine).get("returns_routed_experts", False))
        self.capabilities = EngineCapabilities(seeds_per_request=True, returns_routed_experts=routed)
        self.streaming = engine
        self.tokenizer = tokenizer
        self._pad_token_id = int(pad_token_id)
        self.loop = EngineLoop()

    @property
    def pad_token_id(self) -> int:
        return self._pad_token_id

    def generate(self, prompt_ids: Sequence[Sequence[int]], num_generations: int,
                 sampling: SamplingConfig) -> RolloutOutput:
        """``num_generations`` completions of each prompt (prompt-major), each prompt's group sampled on the
        streaming engine, all at once; completion ``j`` of prompt ``i`` seeded with ``sampling.seed + i * G + j`` as
        the other engines do, on the engine's event loop; the calling thread waits. The groups' keys are negative
        (``-1 - i``), so a one-off rollout during a streaming fit (a validation) never shares a key with the stream's
        groups, whose keys are places in the data order (>= 0).

        Raises:
            EngineUnavailable: the engine lost a group (a one-off rollout is not sampled again).
        """
        requests = [GroupRequest(key=-1 - i, prompt_ids=tuple(int(t) for t in ids), num_generations=num_generations,
                                 sampling=sampling,
                                 seed=None if sampling.seed is None else sampling.seed + i * num_generations)
                    for i, ids in enumerate(prompt_ids)]

        async def sample_all() -> list:
            return list(await asyncio.gather(*(self.streaming.sample_group(r) for r in requests)))

        groups = self.loop.submit(sample_all()).result()
        parts = [group_rollout(group, self.tokenizer, self._pad_token_id) for group in groups]
        return RolloutOutput.cat(parts, self._pad_token_id)

    def sync_weights(self, weights: PolicyWeights) -> None:
        """Never called: the rollout worker sends a streaming engine's weights with their version
        (:meth:`~lightning_grpo.rollout.worker.RolloutWorker.sync`).

        Raises:
            RuntimeError: always (a versionless sync would break the tokens' versions).
        """
        raise RuntimeError("a streaming engine takes weights with a version (StreamingEngine.update_weights, "
                           "sent by RolloutWorker.sync), not sync_weights")

    def set_lockstep(self, enabled: bool) -> None:
        """Nothing to do: each process samples on its own."""

    def wake_up(self) -> None:
        """Nothing to do: a streaming engine stays awake."""

    def sleep(self, level: int = 1) -> None:
        """Nothing to do: a streaming engine stays awake."""

    def close(self) -> None:
        """Close the streaming engine and stop its event loop (the rollout worker closes only an engine it made)."""
        try:
            self.streaming.close()
        finally:
            self.loop.close()

    @property
    def version(self) -> Optional[int]:
        """The weight version the streaming engine holds."""
        return self.streaming.version
