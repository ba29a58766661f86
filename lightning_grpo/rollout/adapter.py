"""A user's engine with only the core members (:class:`~lightning_grpo.protocols.engine.CoreRolloutEngine`) as a
full :class:`~lightning_grpo.protocols.engine.RolloutEngine`: :func:`as_rollout_engine`, which the rollout worker
applies to every engine it is given."""

from __future__ import annotations

from typing import Any

from lightning_grpo.protocols.engine import CoreRolloutEngine, EngineWrapper, RolloutEngine

CORE_MEMBERS = ("generate", "sync_weights", "pad_token_id")


def as_rollout_engine(engine: Any) -> RolloutEngine:
    """``engine`` as a full :class:`RolloutEngine`: itself when it implements every member, else wrapped in a
    :class:`CoreEngineAdapter` that adds the lifecycle no-ops and the default capabilities (its own weights, no
    per-request seeds, a per-process sync).

    Raises:
        TypeError: ``engine`` lacks a core member (``generate``, ``sync_weights``, ``pad_token_id``), named.
    """
    if isinstance(engine, RolloutEngine):
        return engine
    if not isinstance(engine, CoreRolloutEngine):
        missing = [name for name in CORE_MEMBERS if not hasattr(engine, name)]
        raise TypeError(f"{type(engine).__name__} is not a rollout engine: it lacks {', '.join(missing)} (a rollout "
                        "engine implements generate, sync_weights and pad_token_id; see RolloutEngine)")
    return CoreEngineAdapter(engine)


class CoreEngineAdapter(EngineWrapper):
    """A user engine with only the core members (:class:`CoreRolloutEngine`) as a full :class:`RolloutEngine`:
    ``wake_up``, ``sleep``, ``close`` and ``set_lockstep`` do nothing; it holds its own weights
    (``uses_policy_parameters`` False: ``sync_weights`` is called after every ``engine.sync_every`` optimizer steps)
    and does not seed per request."""

    def __init__(self, engine: CoreRolloutEngine) -> None:
        self.engine = engine  # type: ignore[assignment]

    def wake_up(self) -> None:
        """Nothing to do."""

    def sleep(self, level: int = 1) -> None:
        """Nothing to do."""

    def close(self) -> None:
        """Nothing to do."""

    def set_lockstep(self, enabled: bool) -> None:
        """Nothing to do."""

    @property
    def uses_policy_parameters(self) -> bool:
        """False: a user engine is taken to hold its own weights."""
        return False

    @property
    def seeds_per_request(self) -> bool:
        """False."""
        return False

    @property
    def sync_is_collective(self) -> bool:
        """False: each process syncs its own engine."""
        return False

    @property
    def reads_weight_sources(self) -> bool:
        """False: a user engine is given a transformers module."""
        return False
