"""A narrow compatibility shim that lets megatron-core run on CPU (gloo), so CI proves the Megatron path for real.

megatron-core assumes CUDA in these places that a CPU run reaches:

1. ``torch.cuda.current_device()`` is used as the *device* of new tensors: rotary-embedding frequencies
   (``RotaryEmbedding.get_emb``), the output buffers of the tensor-parallel all-gathers
   (``tensor_parallel.mappings``), the receive buffers of the pipeline stages (``p2p_communication``), the
   distributed data-parallel grad buffers and a few initialisation buffers. On a CPU-only torch it raises
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
4. ``torch.cuda.synchronize()`` after the shape exchange of the pipeline stages (``P2PCommunicator``): a no-op.
5. Literal ``device="cuda"`` factories (``torch.zeros([], device="cuda")`` of the schedules' token count, the
   optimizers' unit scale and grad-norm buffers): in the modules listed in :data:`CUDA_FACTORY_MODULES` the name
   ``torch`` is bound to a proxy of torch whose tensor factories put "cuda" tensors on the CPU; every other
   attribute is torch's own. Code elsewhere is unaffected.
6. The optimizers' constructors check ``param.type() == "torch.cuda.FloatTensor"`` (and the half types) to
   decide between fp32 and mixed-precision parameters: :func:`cuda_type_names` makes the given parameters report
   the CUDA name of their dtype while a megatron-core optimizer is built (an attribute on each parameter,
   removed afterwards).

:class:`MegatronStrategy <lightning_grpo.strategies.megatron.strategy.MegatronStrategy>` applies the shim only when
its accelerator is CPU, and removes it at teardown. Nothing else is patched.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
import types
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

_lock = threading.Lock()
_depth = 0
_saved: dict[str, Any] = {}


def _cpu_current_device() -> torch.device:
    """Stand-in for ``torch.cuda.current_device`` on CPU runs: the device new megatron-core buffers go to."""
    return torch.device("cpu")


def _no_synchronize(device: Any = None) -> None:
    """Stand-in for ``torch.cuda.synchronize`` on CPU runs: nothing runs asynchronously."""


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
#: megatron-core modules whose literal ``device="cuda"`` tensors go to the CPU under the shim (item 5).
CUDA_FACTORY_MODULES = (
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.utils",
)
_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like", "ones_like", "empty_like")


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, int)  # a CUDA ordinal


def _cpu_factory(factory: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(factory)
    def make(*args: Any, **kwargs: Any) -> Any:
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = torch.device("cpu")
        return factory(*args, **kwargs)

    return make


class _CpuTorch(types.ModuleType):
    """``torch`` with its tensor factories putting literal "cuda" tensors on the CPU (item 5)."""

    def __init__(self) -> None:
        super().__init__("torch")
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _cuda_type_name(tensor: torch.Tensor) -> str:
    return tensor.__class__.type(tensor).replace("torch.", "torch.cuda.", 1) if tensor.device.type == "cpu" \
        else tensor.__class__.type(tensor)


@contextlib.contextmanager
def cuda_type_names(tensors: Iterable[torch.Tensor]) -> Iterator[None]:
    """While inside, ``t.type()`` of each of ``tensors`` on the CPU returns the CUDA name of its dtype
    (``"torch.cuda.FloatTensor"``) (item 6). A no-op unless the shim is applied."""
    patched = []
    if is_applied():
        for tensor in tensors:
            tensor.type = functools.partial(_cuda_type_name, tensor)  # type: ignore[method-assign]
            patched.append(tensor)
    try:
        yield
    finally:
        for tensor in patched:
            del tensor.type


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
            _saved["synchronize"] = torch.cuda.synchronize
            _saved["fork"] = mcore_random.CudaRNGStatesTracker.fork
            torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
            torch.cuda.synchronize = _no_synchronize  # type: ignore[assignment]
            mcore_random.CudaRNGStatesTracker.fork = _no_fork  # type: ignore[method-assign]
            _saved["get_states"] = mcore_random._get_all_rng_states
            _saved["set_states"] = mcore_random._set_all_rng_states
            mcore_random._get_all_rng_states = _cpu_rng_states
            mcore_random._set_all_rng_states = _set_cpu_rng_states
            proxy = _CpuTorch()
            for name in CUDA_FACTORY_MODULES:
                module = importlib.import_module(name)
                _saved[f"torch@{name}"] = module.torch
                module.torch = proxy  # type: ignore[attr-defined]
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
            torch.cuda.synchronize = _saved.pop("synchronize")  # type: ignore[assignment]
            mcore_random.CudaRNGStatesTracker.fork = _saved.pop("fork")  # type: ignore[method-assign]
            mcore_random._get_all_rng_states = _saved.pop("get_states")
            mcore_random._set_all_rng_states = _saved.pop("set_states")
            for name in CUDA_FACTORY_MODULES:
                importlib.import_module(name).torch = _saved.pop(f"torch@{name}")  # type: ignore[attr-defined]


@contextlib.contextmanager
def cpu_shims() -> Iterator[None]:
    """Context manager form: ``with cpu_shims(): ...`` runs megatron-core on CPU, then restores torch."""
    apply()
    try:
        yield
    finally:
        remove()
