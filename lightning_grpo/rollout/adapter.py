"""A user's engine with only some members of :class:`~lightning_grpo.protocols.engine.RolloutEngine` (at least the
core: :class:`~lightning_grpo.protocols.engine.CoreRolloutEngine`) as a full one: :func:`as_rollout_engine`, which
the rollout worker applies to every engine it is given or makes.

What the engine declares is read once, when it is given, and honoured member by member: its capabilities, as one
:class:`~lightning_grpo.protocols.engine.EngineCapabilities` record (``capabilities``) or one by one
(``uses_policy_parameters = True``, say: those it does not declare take the documented defaults,
:data:`~lightning_grpo.protocols.engine.CAPABILITY_DEFAULTS`, logged once), and its lifecycle methods (one it lacks is
a no-op).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence, cast

from lightning_grpo.protocols.engine import (
    CAPABILITY_DEFAULTS,
    CAPABILITY_NAMES,
    LIFECYCLE_METHODS,
    CoreRolloutEngine,
    EngineCapabilities,
    EngineWrapper,
    ImageRolloutEngine,
    RolloutEngine,
    check_images_accepted,
)
from lightning_grpo.protocols.rollout import RolloutOutput
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.protocols.vision import RowImages

log = logging.getLogger(__name__)

CORE_MEMBERS = ("generate", "sync_weights", "pad_token_id")
#: Every member of :class:`RolloutEngine` beyond the core.
OPTIONAL_MEMBERS = ("capabilities", *LIFECYCLE_METHODS)


def declared_members(engine: Any) -> dict[str, Any]:
    """The members of :class:`RolloutEngine` (and the capabilities declared one by one, ``accepts_images`` among
    them) that ``engine`` has, with their values (read once, where an engine enters: the worker's engine setter, an
    engine a factory made)."""
    members = (*CORE_MEMBERS, *OPTIONAL_MEMBERS, *CAPABILITY_NAMES)
    return {name: getattr(engine, name) for name in members if hasattr(engine, name)}


def as_rollout_engine(engine: Any) -> RolloutEngine:
    """``engine`` as a full :class:`RolloutEngine`: itself when it has every member (its capabilities as one
    ``capabilities`` record), else wrapped in a :class:`CoreEngineAdapter` that keeps each capability and lifecycle
    method it declares and gives the others their defaults (its own weights, no per-request seeds, a per-process sync;
    no-op lifecycle), logged once.

    Raises:
        TypeError: ``engine`` lacks a core member (``generate``, ``sync_weights``, ``pad_token_id``), named; or it
            declares both a ``capabilities`` record and capabilities one by one.
    """
    declared = declared_members(engine)
    missing = [name for name in CORE_MEMBERS if name not in declared]
    if missing:
        raise TypeError(f"{type(engine).__name__} is not a rollout engine: it lacks {', '.join(missing)} (a rollout "
                        "engine implements generate, sync_weights and pad_token_id; see RolloutEngine)")
    if set(declared).issuperset(OPTIONAL_MEMBERS):
        return engine
    return CoreEngineAdapter(engine, declared)


def declared_capabilities(engine_name: str, declared: dict[str, Any]) -> EngineCapabilities:
    """The capabilities of an engine (named ``engine_name``) that declared ``declared`` (:func:`declared_members`):
    its ``capabilities`` record, or those it declares one by one with :data:`~lightning_grpo.protocols.engine.
    CAPABILITY_DEFAULTS` for the others (logged once).

    Raises:
        TypeError: it declares both a ``capabilities`` record and capabilities one by one (named).
    """
    one_by_one = {name: bool(declared[name]) for name in CAPABILITY_NAMES if name in declared}
    if "capabilities" in declared:
        if one_by_one:
            raise TypeError(f"{engine_name} declares capabilities and also {', '.join(one_by_one)}: declare them in "
                            "one place (an EngineCapabilities record, or each capability as its own member)")
        return declared["capabilities"]
    defaults = dataclasses.asdict(CAPABILITY_DEFAULTS)
    defaulted = [name for name in CAPABILITY_NAMES if name not in one_by_one]
    if defaulted:
        log.info("rollout engine %s declares no %s: taking %s (RolloutEngine's defaults)", engine_name,
                 ", ".join(defaulted), ", ".join(f"{n}={defaults[n]}" for n in defaulted))
    return dataclasses.replace(CAPABILITY_DEFAULTS, **one_by_one)


class CoreEngineAdapter(EngineWrapper):
    """A user engine with the core members and any of the others as a full :class:`RolloutEngine` (see
    :func:`as_rollout_engine`).

    Args:
        engine: the user's engine.
        declared: the members it has, with their values (:func:`declared_members`; default: read here).

    Raises:
        TypeError: ``engine`` declares both a ``capabilities`` record and capabilities one by one (named).
    """

    def __init__(self, engine: CoreRolloutEngine, declared: dict[str, Any] | None = None) -> None:
        self.engine = engine  # type: ignore[assignment]
        declared = declared_members(engine) if declared is None else declared
        self._lifecycle = {name for name in LIFECYCLE_METHODS if name in declared}
        self._capabilities = declared_capabilities(type(engine).__name__, declared)

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
    def capabilities(self) -> EngineCapabilities:
        """As declared; each capability not declared takes its default (a user engine is taken to hold its own
        weights, to sample from torch's global generator and to sync on each process)."""
        return self._capabilities

    def generate(self, prompt_ids: Sequence[Sequence[int]], num_generations: int, sampling: SamplingConfig,
                 images: Sequence[RowImages] = ()) -> RolloutOutput:
        """The engine's ``generate``; with ``images`` only when a prompt has some and the engine declares
        ``accepts_images`` (it then takes them as an :class:`~lightning_grpo.protocols.engine.ImageRolloutEngine`).

        Raises:
            ValueError: images for an engine that does not declare ``accepts_images`` (it is named).
        """
        if not any(images):
            return self.engine.generate(prompt_ids, num_generations, sampling)
        check_images_accepted(self._capabilities.accepts_images, type(self.engine).__name__, images, len(prompt_ids))
        return cast(ImageRolloutEngine, self.engine).generate(prompt_ids, num_generations, sampling, images=images)
