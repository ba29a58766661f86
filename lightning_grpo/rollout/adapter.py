"""A user's engine with only some members of :class:`~lightning_grpo.protocols.engine.RolloutEngine` (at least the
core: :class:`~lightning_grpo.protocols.engine.CoreRolloutEngine`) as a full one: :func:`as_rollout_engine`, which
the rollout worker applies to every engine it is given or makes.

What the engine declares is read once, when it is given, and honoured member by member: a capability it declares
(``uses_policy_parameters = True``, say) is its own, one it does not takes the documented default
(:data:`~lightning_grpo.protocols.engine.CAPABILITY_DEFAULTS`, logged once), a lifecycle method it lacks is a no-op.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from lightning_grpo.protocols import multimodal
from lightning_grpo.protocols.engine import (
    CAPABILITY_DEFAULTS,
    LIFECYCLE_METHODS,
    CoreRolloutEngine,
    EngineWrapper,
    RolloutEngine,
)
from lightning_grpo.protocols.images import RowImages
from lightning_grpo.protocols.rollout import RolloutOutput
from lightning_grpo.protocols.sampling import SamplingConfig

log = logging.getLogger(__name__)

CORE_MEMBERS = ("generate", "sync_weights", "pad_token_id")
#: Every member of :class:`RolloutEngine` beyond the core.
OPTIONAL_MEMBERS = (*CAPABILITY_DEFAULTS, *LIFECYCLE_METHODS)
#: The member of an engine that takes images in its prompts
#: (:class:`~lightning_grpo.protocols.multimodal.ImageRolloutEngine`); an engine without it takes none.
IMAGE_MEMBERS = ("accepts_images",)
#: The member of an engine whose rollouts carry the experts a mixture-of-experts policy routed each token to
#: (``prompt_routed_experts``, ``completion_routed_experts``: routing replay); an engine without it returns none.
ROUTING_MEMBERS = ("returns_routed_experts",)


def declared_members(engine: Any) -> dict[str, Any]:
    """The members of :class:`RolloutEngine` (and ``accepts_images``) that ``engine`` has, with their values (read
    once, where an engine enters: the worker's engine setter, an engine a factory made)."""
    members = (*CORE_MEMBERS, *OPTIONAL_MEMBERS, *IMAGE_MEMBERS, *ROUTING_MEMBERS)
    return {name: getattr(engine, name) for name in members if hasattr(engine, name)}


def declares_images(engine: Any) -> bool:
    """Whether ``engine`` takes images with its prompts (it declares ``accepts_images`` true), read once where it
    enters the rollout worker; an engine that does not declare it takes none."""
    return bool(declared_members(engine).get("accepts_images", False))


def declares_routing(engine: Any) -> bool:
    """Whether ``engine``'s rollouts carry the routed experts (it declares ``returns_routed_experts`` true), read once
    where it enters the rollout worker; an engine that does not declare it returns none."""
    return bool(declared_members(engine).get("returns_routed_experts", False))


def as_rollout_engine(engine: Any) -> RolloutEngine:
    """``engine`` as a full :class:`RolloutEngine`: itself when it has every member, else wrapped in a
    :class:`CoreEngineAdapter` that keeps each capability and lifecycle method it declares and gives the others
    their defaults (its own weights, no per-request seeds, a per-process sync; no-op lifecycle), logged once.

    Raises:
        TypeError: ``engine`` lacks a core member (``generate``, ``sync_weights``, ``pad_token_id``), named.
    """
    declared = declared_members(engine)
    missing = [name for name in CORE_MEMBERS if name not in declared]
    if missing:
        raise TypeError(f"{type(engine).__name__} is not a rollout engine: it lacks {', '.join(missing)} (a rollout "
                        "engine implements generate, sync_weights and pad_token_id; see RolloutEngine)")
    if set(declared).issuperset(OPTIONAL_MEMBERS):
        return engine
    return CoreEngineAdapter(engine, declared)


class CoreEngineAdapter(EngineWrapper):
    """A user engine with the core members and any of the others as a full :class:`RolloutEngine` (see
    :func:`as_rollout_engine`).

    Args:
        engine: the user's engine.
        declared: the members it has, with their values (:func:`declared_members`; default: read here).

    Attributes:
        capabilities: ``uses_policy_parameters``, ``seeds_per_request`` and ``sync_is_collective`` as the engine
            declares them or, for those it does not, :data:`~lightning_grpo.protocols.engine.CAPABILITY_DEFAULTS`.
    """

    def __init__(self, engine: CoreRolloutEngine, declared: dict[str, Any] | None = None) -> None:
        self.engine = engine  # type: ignore[assignment]
        declared = declared_members(engine) if declared is None else declared
        self._lifecycle = {name for name in LIFECYCLE_METHODS if name in declared}
        self.capabilities = {name: bool(declared.get(name, default)) for name, default in CAPABILITY_DEFAULTS.items()}
        self.images = bool(declared.get("accepts_images", False))
        self.routing = bool(declared.get("returns_routed_experts", False))
        defaulted = [name for name in CAPABILITY_DEFAULTS if name not in declared]
        if defaulted:
            log.info("rollout engine %s declares no %s: taking %s (RolloutEngine's defaults)", type(engine).__name__,
                     ", ".join(defaulted), ", ".join(f"{n}={CAPABILITY_DEFAULTS[n]}" for n in defaulted))

    def wake_up(self) -> None:
        """The engine's ``wake_up``, if it has one."""
        if "wake_up" in self._lifecycle:
            self.engine.wake_up()

    def sleep(self, level: int = 1) -> None:
        """The engine's ``sleep``, if it has one."""
        if "sleep" in self._lifecycle:
            self.engine.sleep(level)

    def close(self) -> None:
        """The engine's ``close``, if it has one."""
        if "close" in self._lifecycle:
            self.engine.close()

    def set_lockstep(self, enabled: bool) -> None:
        """The engine's ``set_lockstep``, if it has one."""
        if "set_lockstep" in self._lifecycle:
            self.engine.set_lockstep(enabled)

    @property
    def uses_policy_parameters(self) -> bool:
        """As declared; default False (a user engine is taken to hold its own weights)."""
        return self.capabilities["uses_policy_parameters"]

    @property
    def seeds_per_request(self) -> bool:
        """As declared; default False."""
        return self.capabilities["seeds_per_request"]

    @property
    def sync_is_collective(self) -> bool:
        """As declared; default False (each process syncs its own engine)."""
        return self.capabilities["sync_is_collective"]

    @property
    def accepts_images(self) -> bool:
        """As declared; default False (the engine's ``generate`` then never gets images)."""
        return self.images

    @property
    def returns_routed_experts(self) -> bool:
        """As declared; default False (its rollouts carry no routed experts)."""
        return self.routing

    def generate(self, prompt_ids: Sequence[Sequence[int]], num_generations: int, sampling: SamplingConfig,
                 images: Optional[Sequence[Optional[RowImages]]] = None) -> RolloutOutput:
        """The engine's ``generate``; with images only when it declares ``accepts_images``
        (:func:`lightning_grpo.protocols.multimodal.generate`, which raises ValueError otherwise)."""
        return multimodal.generate(self.engine, prompt_ids, num_generations, sampling, images, accepts=self.images)
