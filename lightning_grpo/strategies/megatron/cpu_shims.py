"""A narrow compatibility shim that lets megatron-core run on CPU (gloo), so CI proves the Megatron path for real.

megatron-core assumes CUDA in three places that a CPU run reaches:

1. ``torch.cuda.current_device()`` is used as the *device* of new tensors: rotary-embedding frequencies
   (``RotaryEmbedding.get_emb``), the output buffers of the tensor-parallel all-gathers
   (``tensor_parallel.mappings``) and a few initialisation buffers. On a CPU-only torch it raises
   ``AssertionError: Torch not compiled with CUDA enabled``; on a GPU machine with a CPU run it would put
   those tensors on the GPU. The shim makes it return ``torch.device("cpu")``.
2. ``CudaRNGStatesTracker.fork()`` swaps the CUDA generator state around embedding/attention dropout and
   tensor-parallel weight initialisation. The shim makes it a no-op context (the CPU generator is used
   as is). GRPO trains with dropout 0 and the weights come from a Hugging Face checkpoint, so no random
   number is drawn inside it; with dropout > 0 on CPU the tensor-parallel ranks would draw from their
   own CPU generators instead of the tracked model-parallel stream.
3. Activation recompute (``recompute_granularity``, :func:`lightning_grpo.strategies.megatron.model.recompute_settings`)
   saves and restores every generator's state around each checkpointed block (``tensor_parallel.random.
   _get_all_rng_states`` / ``_set_all_rng_states``), the CUDA one included. The shim saves and restores the CPU
   generator's only.

:class:`MegatronStrategy <lightning_grpo.strategies.megatron.strategy.MegatronStrategy>` applies the shim only when
its accelerator is CPU, and removes it at teardown. Nothing else is patched.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, Optional

import torch

_lock = threading.Lock()
_depth = 0
_saved: dict[str, Any] = {}


def _cpu_current_device() -> torch.device:
    """Stand-in for ``torch.cuda.current_device`` on CPU runs: the device new megatron-core buffers go to."""
    return torch.device("cpu")


@contextlib.contextmanager
def _no_fork(self: Any, name: Optional[str] = None) -> Iterator[None]:
    """Stand-in for ``CudaRNGStatesTracker.fork`` on CPU runs: no CUDA generator to swap."""
    yield


def _cpu_rng_states() -> tuple:
    """Stand-in for megatron-core's ``_get_all_rng_states`` on CPU runs: the CPU generator's state only."""
    return torch.get_rng_state(), None, None


def _set_cpu_rng_states(cpu_rng_state: torch.Tensor, cuda_rng_state: Any, tracker_states: Any) -> None:
    """Stand-in for megatron-core's ``_set_all_rng_states`` on CPU runs."""
    torch.set_rng_state(cpu_rng_state)


def is_applied() -> bool:
    """Whether the shim is currently in effect."""
    return _depth > 0


def apply() -> None:
    """Install the shim (reference-counted: each :func:`apply` needs one :func:`remove`)."""
    global _depth
    from megatron.core.tensor_parallel import random as mcore_random

    with _lock:
        if _depth == 0:
            _saved["current_device"] = torch.cuda.current_device
            _saved["fork"] = mcore_random.CudaRNGStatesTracker.fork
            torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
            mcore_random.CudaRNGStatesTracker.fork = _no_fork  # type: ignore[method-assign]
            _saved["get_states"] = mcore_random._get_all_rng_states
            _saved["set_states"] = mcore_random._set_all_rng_states
            mcore_random._get_all_rng_states = _cpu_rng_states
            mcore_random._set_all_rng_states = _set_cpu_rng_states
        _depth += 1


def remove() -> None:
    """Undo one :func:`apply`; the originals are restored when the last one is undone. A no-op if not applied."""
    global _depth
    from megatron.core.tensor_parallel import random as mcore_random

    with _lock:
        if _depth == 0:
            return
        _depth -= 1
        if _depth == 0:
            current_device: Callable[[], int] = _saved.pop("current_device")
            torch.cuda.current_device = current_device  # type: ignore[assignment]
            mcore_random.CudaRNGStatesTracker.fork = _saved.pop("fork")  # type: ignore[method-assign]
            mcore_random._get_all_rng_states = _saved.pop("get_states")
            mcore_random._set_all_rng_states = _saved.pop("set_states")


@contextlib.contextmanager
def cpu_shims() -> Iterator[None]:
    """Context manager form: ``with cpu_shims(): ...`` runs megatron-core on CPU, then restores torch."""
    apply()
    try:
        yield
    finally:
        remove()
