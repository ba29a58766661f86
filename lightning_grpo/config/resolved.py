"""What a run made of the settings that ``GRPOConfig`` leaves to it ("auto"): :class:`ResolvedConfig`.

``GRPOConfig`` is the run's input and is never changed; each "auto" value is resolved once, where what it depends on
is known, into this record, which the components that use it are given and which is logged and stored in the
hyperparameters (``hparams["resolved"]``, beside ``hparams["config"]``):

* ``engine.name="auto"`` -> :attr:`ResolvedConfig.engine_name` when the module is built
  (:func:`lightning_grpo.rollout.engine_registry.resolve_engine_name`);
* ``engine.kv_cache_space_gib="auto"`` -> :attr:`ResolvedConfig.kv_cache_space_gib` when the engine is made (the
  prompts per rollout are known: :mod:`lightning_grpo.rollout.engines.vllm.kv_cache`);
* ``engine.dtype="auto"`` -> :attr:`ResolvedConfig.engine_dtype` when the engine is made (the trainer's precision is
  known: :func:`lightning_grpo.rollout.engine_registry.engine_dtype`);
* ``max_tokens_per_microbatch="auto"`` -> :attr:`ResolvedConfig.max_tokens_per_microbatch` at the start of training
  (from probe steps: :mod:`lightning_grpo.training.token_budget`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class ResolvedConfig:
    """The resolved values of a run (a frozen record: a new one is made as each value is resolved).

    Attributes:
        engine_name: the rollout engine's name, ``engine.name`` with "auto" resolved.
        kv_cache_space_gib: the engine's KV-cache size in GiB, ``engine.kv_cache_space_gib`` with "auto" resolved;
            None until the engine is made and for engines that take no size (all but colocated vLLM).
        engine_dtype: the dtype of an engine with its own copy of the weights (colocated vLLM), ``engine.dtype`` with
            "auto" resolved; None until the engine is made and for engines that take no dtype.
        max_tokens_per_microbatch: the micro-batch token budget, ``max_tokens_per_microbatch`` (an int as given, or
            "auto" once chosen); None: off, or "auto" not yet chosen (micro-batches then count sequences).
    """

    engine_name: str
    kv_cache_space_gib: Optional[float] = None
    engine_dtype: Optional[str] = None
    max_tokens_per_microbatch: Optional[int] = None

    def replace(self, **changes: Any) -> "ResolvedConfig":
        """A copy with ``changes`` (the record is frozen)."""
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        """Plain data (for the hyperparameters and the log)."""
        return dataclasses.asdict(self)
