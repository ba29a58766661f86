"""The rollout-engine protocols: token ids in; completions, masks and optional sampler logprobs out.

Every engine (HF ``generate`` in :mod:`lightning_grpo.rollout.engines.hf`, vLLM in
:mod:`lightning_grpo.rollout.engines.vllm`, the rollout servers' client in :mod:`lightning_grpo.rollout.engines.remote`)
implements :class:`RolloutEngine`; a user's engine may implement only :class:`CoreRolloutEngine`
(:func:`lightning_grpo.rollout.adapter.as_rollout_engine` adds the rest). :class:`EngineWrapper` is the base of the
engines that wrap another (the backends' gathering and tensor-parallel wrappers). The trainer never depends on an
engine's internals, and an engine never sees the trainer's model: it generates from token ids and is synced with a
:class:`~lightning_grpo.protocols.weights.PolicyWeights` stream that the trainer's backend produces.
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence, runtime_checkable

from lightning_grpo.protocols import multimodal
from lightning_grpo.protocols.images import RowImages
from lightning_grpo.protocols.rollout import RolloutOutput
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.protocols.weights import PolicyWeights

#: The optional members of :class:`RolloutEngine` that say what an engine is, and the value an engine that does not
#: declare one is taken to have (:func:`lightning_grpo.rollout.adapter.as_rollout_engine`, logged once).
CAPABILITY_DEFAULTS: dict[str, bool] = {
    "uses_policy_parameters": False,
    "seeds_per_request": False,
    "sync_is_collective": False,
}
#: The optional lifecycle methods of :class:`RolloutEngine`: an engine that does not define one gets a no-op.
LIFECYCLE_METHODS = ("wake_up", "sleep", "close", "set_lockstep")


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a generator: every member the rest of the package uses on an engine.

    An engine says what it is through capabilities, which the backends, the worker and the experience maker read
    instead of asking for its type: :attr:`uses_policy_parameters`, :attr:`seeds_per_request` and
    :attr:`sync_is_collective`. A user engine may implement only the core (:class:`CoreRolloutEngine`: ``generate``,
    ``sync_weights``, ``pad_token_id``) and any of the rest:
    :func:`lightning_grpo.rollout.adapter.as_rollout_engine` honours each member it declares and gives it the
    defaults of :data:`CAPABILITY_DEFAULTS` (and no-op :data:`LIFECYCLE_METHODS`) for the others.
    """

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], num_generations: int, sampling: SamplingConfig
    ) -> RolloutOutput:
        """Sample ``num_generations`` completions for each prompt (given as token ids, no padding)."""
        ...

    def sync_weights(self, weights: PolicyWeights) -> None:
        """Make the engine generate with the policy's current weights, read from ``weights`` (called after optimizer
        steps; every process calls it when ``weights.collective``). An engine that generates with the policy's own
        parameters (:attr:`uses_policy_parameters`) has nothing to do."""
        ...

    @property
    def pad_token_id(self) -> int:
        """The id that pads prompts (left) and completions (right) in :class:`RolloutOutput`."""
        ...

    @property
    def uses_policy_parameters(self) -> bool:
        """True: the engine generates with the policy module itself (HF ``generate``): its weights are always the
        trainer's, a sharding backend gathers the parameters around :meth:`generate`, and it cannot generate while
        the trainer trains (no asynchronous rollouts). False: it holds its own copy, updated by
        :meth:`sync_weights`."""
        ...

    @property
    def seeds_per_request(self) -> bool:
        """Whether ``SamplingConfig.seed`` seeds each request (completion j of prompt i with ``seed + i*G + j``), so
        a rollout is reproducible whatever the batch; False: the engine samples from torch's global generator."""
        ...

    @property
    def sync_is_collective(self) -> bool:
        """Whether :meth:`sync_weights` must be called by every trainer process together (the rollout servers:
        global rank 0 streams the weights, the others wait); False: each process syncs its own engine."""
        ...

    def set_lockstep(self, enabled: bool) -> None:
        """With ``enabled``, every process runs as many forward passes per :meth:`generate` as the longest one
        (transformers' ``synced_gpus``): needed where each forward of the policy is a collective (FSDP1 with nested
        units). A no-op for engines that do not use the policy's parameters."""
        ...

    def wake_up(self) -> None:
        """Bring the engine's weights and cache back onto the accelerator before a rollout (no-op if never slept)."""
        ...

    def sleep(self, level: int = 1) -> None:
        """Free the engine's accelerator memory until the next :meth:`wake_up` (vLLM sleep mode; a no-op where the
        engine keeps nothing between rollouts)."""
        ...

    def close(self) -> None:
        """Release the engine (processes, memory); it is not used afterwards."""
        ...


@runtime_checkable
class CoreRolloutEngine(Protocol):
    """The least a user's engine implements: ``generate``, ``sync_weights`` and ``pad_token_id`` (as in
    :class:`RolloutEngine`)."""

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], num_generations: int, sampling: SamplingConfig
    ) -> RolloutOutput: ...

    def sync_weights(self, weights: PolicyWeights) -> None: ...

    @property
    def pad_token_id(self) -> int: ...


class EngineWrapper:
    """Base of engines that wrap another engine (FSDP's gathered generation, Megatron's tensor-parallel
    broadcast): forwards each :class:`RolloutEngine` member to ``self.engine`` explicitly; subclasses override
    what they change.

    Args:
        engine: the wrapped engine.
    """

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], num_generations: int, sampling: SamplingConfig,
        images: Optional[Sequence[Optional[RowImages]]] = None,
    ) -> RolloutOutput:
        """``engine.generate`` (with ``images`` when a prompt has some: :func:`~lightning_grpo.protocols.multimodal.
        generate`)."""
        return multimodal.generate(self.engine, prompt_ids, num_generations, sampling, images)

    @property
    def accepts_images(self) -> bool:
        """``engine.accepts_images`` (:class:`~lightning_grpo.protocols.multimodal.ImageRolloutEngine`; an engine
        is wrapped only after it entered the rollout worker, which reads what it declares)."""
        return bool(self.engine.accepts_images)  # type: ignore[attr-defined]

    @property
    def returns_routed_experts(self) -> bool:
        """``engine.returns_routed_experts`` (routing replay; read, like ``accepts_images``, when the engine entered
        the rollout worker)."""
        return bool(self.engine.returns_routed_experts)  # type: ignore[attr-defined]

    def sync_weights(self, weights: PolicyWeights) -> None:
        """``engine.sync_weights``."""
        self.engine.sync_weights(weights)

    def wake_up(self) -> None:
        """``engine.wake_up()``."""
        self.engine.wake_up()

    def sleep(self, level: int = 1) -> None:
        """``engine.sleep(level)``."""
        self.engine.sleep(level)

    def close(self) -> None:
        """``engine.close()``."""
        self.engine.close()

    def set_lockstep(self, enabled: bool) -> None:
        """``engine.set_lockstep(enabled)``."""
        self.engine.set_lockstep(enabled)

    @property
    def pad_token_id(self) -> int:
        """``engine.pad_token_id``."""
        return self.engine.pad_token_id

    @property
    def uses_policy_parameters(self) -> bool:
        """``engine.uses_policy_parameters``."""
        return self.engine.uses_policy_parameters

    @property
    def seeds_per_request(self) -> bool:
        """``engine.seeds_per_request``."""
        return self.engine.seeds_per_request

    @property
    def sync_is_collective(self) -> bool:
        """``engine.sync_is_collective``."""
        return self.engine.sync_is_collective
