"""The rollout-engine protocols: token ids in; completions, masks and optional sampler logprobs out.

Every engine (HF ``generate`` in :mod:`lightning_grpo.rollout.engines.hf`, vLLM in
:mod:`lightning_grpo.rollout.engines.vllm.colocated`, the rollout servers' client in
:mod:`lightning_grpo.rollout.server.remote`) implements :class:`RolloutEngine`; a user's engine may implement only
:class:`CoreRolloutEngine` (:func:`lightning_grpo.rollout.adapter.as_rollout_engine` adds the rest).
:class:`EngineWrapper` is the base of the engines that wrap another (the backends' gathering and tensor-parallel
wrappers). The trainer never depends on an engine's internals, and an engine never sees the trainer's model: it
generates from token ids and is synced with a :class:`~lightning_grpo.protocols.weights.PolicyWeights` stream that
the trainer's backend produces.

Images in prompts (vision-language policies, docs/vision.md) take one declared path: an engine whose
``capabilities.accepts_images`` is True is an :class:`ImageRolloutEngine` (its ``generate`` also takes each prompt's
images), and :func:`generate` is how the samplers and the wrappers call any engine: the core three-argument
``generate`` without images, the image one with them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Protocol, Sequence, cast, runtime_checkable

from lightning_grpo.protocols.rollout import RolloutOutput
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.protocols.vision import RowImages
from lightning_grpo.protocols.weights import PolicyWeights


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine is, declared once per engine (:attr:`RolloutEngine.capabilities`) and read by the backends, the
    worker, the samplers and the experience maker instead of its type; a wrapper forwards it whole.

    Attributes:
        uses_policy_parameters: True: the engine generates with the policy module itself (HF ``generate``): its
            weights are always the trainer's, a sharding backend gathers the parameters around ``generate``, and it
            cannot generate while the trainer trains (no asynchronous rollouts). False: it holds its own copy,
            updated by ``sync_weights``.
        seeds_per_request: whether ``SamplingConfig.seed`` seeds each request (completion j of prompt i with
            ``seed + i*G + j``), so a rollout is reproducible whatever the batch; False: the engine samples from
            torch's global generator.
        sync_is_collective: whether ``sync_weights`` must be called by every trainer process together (the rollout
            servers: global rank 0 streams the weights, the others wait); False: each process syncs its own engine.
        returns_routed_experts: whether its rollouts carry the experts a mixture-of-experts policy routed each token to
            (``prompt_routed_experts``, ``completion_routed_experts``: routing replay "R3"); False: none.
        accepts_images: whether the engine takes images with its prompts (it is an :class:`ImageRolloutEngine`: HF
            ``generate`` on a vision-language policy, vLLM and the rollout servers serving one); False: it would drop
            them, so prompts with images are refused before it is called.
    """

    uses_policy_parameters: bool = False
    seeds_per_request: bool = False
    sync_is_collective: bool = False
    returns_routed_experts: bool = False
    accepts_images: bool = False


#: What an engine that does not declare a capability is taken to have: its own weights, no per-request seeds, a
#: per-process sync (:func:`lightning_grpo.rollout.adapter.as_rollout_engine`, logged once).
CAPABILITY_DEFAULTS = EngineCapabilities()
#: The names of the capabilities, which a user engine may also declare one by one (``uses_policy_parameters = True``).
CAPABILITY_NAMES = tuple(f.name for f in fields(EngineCapabilities))
#: The optional lifecycle methods of :class:`RolloutEngine`: an engine that does not define one gets a no-op.
LIFECYCLE_METHODS = ("wake_up", "sleep", "close", "set_lockstep")


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a generator: every member the rest of the package uses on an engine.

    An engine says what it is through one record, :attr:`capabilities` (:class:`EngineCapabilities`), which the
    backends, the worker and the experience maker read instead of asking for its type. A user engine may implement
    only the core (:class:`CoreRolloutEngine`: ``generate``, ``sync_weights``, ``pad_token_id``) and any of the rest,
    capabilities one by one included (``seeds_per_request = True``): :func:`lightning_grpo.rollout.adapter.
    as_rollout_engine` honours each member it declares and gives it the defaults of :data:`CAPABILITY_DEFAULTS` (and
    no-op :data:`LIFECYCLE_METHODS`) for the others.
    """

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], num_generations: int, sampling: SamplingConfig
    ) -> RolloutOutput:
        """Sample ``num_generations`` completions for each prompt (given as token ids, no padding)."""
        ...

    def sync_weights(self, weights: PolicyWeights) -> None:
        """Make the engine generate with the policy's current weights, read from ``weights`` (called after optimizer
        steps; every process calls it when ``weights.collective``). Never called for an engine that generates with the
        policy's own parameters (``capabilities.uses_policy_parameters``): it has nothing to do (a wrapper that keeps a
        copy, e.g. Megatron's HF model, refreshes it in :meth:`wake_up`)."""
        ...

    @property
    def pad_token_id(self) -> int:
        """The id that pads prompts (left) and completions (right) in :class:`RolloutOutput`."""
        ...

    @property
    def capabilities(self) -> EngineCapabilities:
        """What the engine is (:class:`EngineCapabilities`: whether it uses the policy's parameters, seeds each
        request, syncs collectively, takes images)."""
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


class ImageRolloutEngine(Protocol):
    """An engine that takes images with its prompts, as its ``capabilities.accepts_images`` declares (the built-in
    engines on a vision-language model, the backends' wrappers of them, a user engine that declares
    ``accepts_images``)."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], num_generations: int, sampling: SamplingConfig,
                 images: Sequence[RowImages] = ()) -> RolloutOutput:
        """As :meth:`RolloutEngine.generate`; ``images[i]``: prompt i's images (its ids hold their expanded
        placeholder runs; ``()``: none). The output's ``images`` are each row's."""
        ...


def check_images_accepted(accepts_images: bool, engine_name: str, images: Sequence[RowImages],
                          num_prompts: int) -> None:
    """Check prompt images (``images``, one entry per prompt) for an engine named ``engine_name`` that takes images
    when ``accepts_images``; prompts without images pass.

    Raises:
        ValueError: images for an engine that does not take them (it would drop them), or not one entry per prompt.
    """
    if not any(images):
        return
    if len(images) != num_prompts:
        raise ValueError(f"{len(images)} image entries for {num_prompts} prompts: one per prompt (() for none)")
    if not accepts_images:
        raise ValueError(f"the rollout engine {engine_name} does not take images (it declares no accepts_images=True), "
                         "but the prompts have images: use engine.name='hf', 'vllm' or 'vllm_server' with a "
                         "vision-language model")


def generate(engine: RolloutEngine, prompt_ids: Sequence[Sequence[int]], num_generations: int,
             sampling: SamplingConfig, images: Sequence[RowImages] = ()) -> RolloutOutput:
    """``engine.generate(prompt_ids, num_generations, sampling)``, or, when a prompt has images, the engine's image
    ``generate`` (:class:`ImageRolloutEngine`, as ``engine.capabilities.accepts_images`` declares): the one path the
    samplers and the wrappers call an engine through.

    Raises:
        ValueError: as :func:`check_images_accepted`.
    """
    if not any(images):
        return engine.generate(prompt_ids, num_generations, sampling)
    check_images_accepted(engine.capabilities.accepts_images, type(engine).__name__, images, len(prompt_ids))
    return cast(ImageRolloutEngine, engine).generate(prompt_ids, num_generations, sampling, images=images)


class EngineWrapper:
    """Base of engines that wrap another engine (FSDP's gathered generation, Megatron's tensor-parallel
    broadcast): forwards each :class:`RolloutEngine` member to ``self.engine`` explicitly; subclasses override
    what they change.

    Args:
        engine: the wrapped engine.
    """

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine

    def generate(self, prompt_ids: Sequence[Sequence[int]], num_generations: int, sampling: SamplingConfig,
                 images: Sequence[RowImages] = ()) -> RolloutOutput:
        """``engine.generate``, with ``images`` when a prompt has some (:func:`generate`)."""
        return generate(self.engine, prompt_ids, num_generations, sampling, images)

    @property
    def pad_token_id(self) -> int:
        """``engine.pad_token_id``."""
        return self.engine.pad_token_id

    @property
    def capabilities(self) -> EngineCapabilities:
        """``engine.capabilities``."""
        return self.engine.capabilities

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
