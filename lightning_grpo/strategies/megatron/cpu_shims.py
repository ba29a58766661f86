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
7. The all-to-all token dispatcher of a mixture of experts (``MoEAlltoAllTokenDispatcher``) creates a CUDA stream
   in its constructor (the class attribute ``cuda_dtoh_stream``) and, in ``_maybe_dtoh_and_synchronize``, copies the
   all-to-all split sizes to the host on that stream and synchronises with an event. The shim sets the class
   attribute to a placeholder (no stream is made) and replaces the method with one that converts the split sizes to
   numpy arrays at the same point, as the CUDA path's copies do (``torch.distributed.all_to_all_single`` takes them
   as lists of ints), without streams or events.
8. The same dispatcher with expert tensor parallelism (ETP > 1) all-gathers its tokens over the expert-TP ranks with
   uneven sizes (``tensor_parallel.mappings._gather_along_first_dim`` with ``output_split_sizes``: a
   ``torch.distributed.all_gather`` of tensors of different lengths) and reduce-scatters them back
   (``_reduce_scatter_along_first_dim`` with ``input_split_sizes``: ``torch.distributed.reduce_scatter``); gloo has
   neither (its all-gather takes equal sizes only). With split sizes the shim all-gathers each rank's tensor padded
   to the longest and keeps each one's rows, and reduce-scatters by an all-reduce of the whole tensor of which each
   rank keeps its rows: the same values. Without split sizes megatron-core's own functions run.

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


def _uneven_gather(input_: torch.Tensor, group: Any, output_split_sizes: Any = None,
                   use_global_buffer: bool = False) -> torch.Tensor:
    """Stand-in for megatron-core's ``_gather_along_first_dim`` on CPU runs (item 8)."""
    if output_split_sizes is None or group.size() == 1:
        return _saved["gather"](input_, group, output_split_sizes, use_global_buffer)
    sizes = [int(n) for n in output_split_sizes]
    padded = input_.new_zeros((max(sizes), *input_.shape[1:]))
    padded[: input_.shape[0]] = input_
    parts = [torch.empty_like(padded) for _ in sizes]
    torch.distributed.all_gather(parts, padded, group=group)
    return torch.cat([part[:n] for part, n in zip(parts, sizes, strict=True)])


def _uneven_reduce_scatter(input_: torch.Tensor, group: Any, input_split_sizes: Any = None,
                           use_global_buffer: bool = False) -> torch.Tensor:
    """Stand-in for megatron-core's ``_reduce_scatter_along_first_dim`` on CPU runs (item 8)."""
    if input_split_sizes is None or group.size() == 1:
        return _saved["reduce_scatter"](input_, group, input_split_sizes, use_global_buffer)
    total = input_.contiguous().clone()
    torch.distributed.all_reduce(total, group=group)
    return total.split([int(n) for n in input_split_sizes])[group.rank()].contiguous()


#: Stand-in for the all-to-all dispatcher's device-to-host stream on CPU runs (item 7): never used as a stream.
_NO_STREAM = object()


def _cpu_dtoh(self: Any, point: str, tokens_per_expert: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """Stand-in for ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` on CPU runs (item 7): at the
    dispatcher's host-copy point the split sizes become numpy arrays (the CUDA path's ``maybe_move_tensor_to_cpu(...,
    as_numpy=True)``); nothing is asynchronous, so there is nothing to synchronise."""
    if not self.drop_and_pad and point == self.cuda_dtoh_point:
        for name in ("input_splits", "output_splits", "output_splits_tp"):
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                setattr(self, name, value.numpy())
    return tokens_per_expert
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
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    with _lock:
        if _depth == 0:
            _saved["gather"] = mappings._gather_along_first_dim
            _saved["reduce_scatter"] = mappings._reduce_scatter_along_first_dim
            mappings._gather_along_first_dim = _uneven_gather
            mappings._reduce_scatter_along_first_dim = _uneven_reduce_scatter
            _saved["dtoh_stream"] = MoEAlltoAllTokenDispatcher.cuda_dtoh_stream
            _saved["dtoh"] = MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize
            MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _NO_STREAM
            MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _cpu_dtoh  # type: ignore[method-assign]
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
    from megatron.core.tensor_parallel import mappings
    from megatron.core.tensor_parallel import random as mcore_random
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    with _lock:
        if _depth == 0:
            return
        _depth -= 1
        if _depth == 0:
            mappings._gather_along_first_dim = _saved.pop("gather")
            mappings._reduce_scatter_along_first_dim = _saved.pop("reduce_scatter")
            MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _saved.pop("dtoh_stream")
            MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = _saved.pop("dtoh")  # type: ignore[method-assign]
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
