"""``torch.distributed`` state and in-process vLLM engines: who made the default group, and what closing an engine
may destroy.

vLLM's in-process worker calls ``torch.distributed.init_process_group`` (world size 1) when no default group exists,
and makes its own groups (its "world" and model-parallel groups, process-global and shared by every engine of the
process). Its ``EngineCore.shutdown`` ends with ``cleanup_dist_env_and_memory``, which destroys all of it, the
default group included, whoever made that group and whichever engines still use it. So, left alone, closing one
engine would destroy a group the caller made (Lightning's DDP/FSDP, megatron-core's) or the groups another live
engine samples with, and an engine left unclosed would leave a default group behind that makes the process's next
``init_process_group`` fail ("trying to initialize the default process group twice").

:class:`GroupLease` keeps the accounting: an engine takes one before it builds ``vllm.LLM`` and lets it
:meth:`~GroupLease.guard` vLLM's shutdown. The last engine to close destroys vLLM's groups, and the default group
only when an engine made it; while other engines live, nothing distributed is destroyed.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from typing import Any, Callable, Iterator

import torch

_LOCK = threading.Lock()
_LIVE = 0  # engines built and not yet closed in this process
_MADE_BY_ENGINE = False  # whether the current default group was made by an engine's worker (not by the caller)


def _initialized() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class GroupLease:
    """One engine's share of the process's distributed state. Make it just before ``vllm.LLM(...)``, call
    :meth:`built` after it returns and run the engine's shutdown inside :meth:`guard` (once)."""

    def __init__(self) -> None:
        self._existed = _initialized()
        self._live = False

    def built(self) -> None:
        """The engine exists: count it, and note whether its worker made the default group."""
        global _LIVE, _MADE_BY_ENGINE
        with _LOCK:
            if not self._existed and _initialized():
                _MADE_BY_ENGINE = True
            elif not _initialized():
                _MADE_BY_ENGINE = False
            _LIVE += 1
            self._live = True

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Around vLLM's ``EngineCore.shutdown``: its distributed cleanup runs as the accounting allows (the module
        docstring). After the first call it leaves vLLM's cleanup as it is."""
        global _LIVE, _MADE_BY_ENGINE
        with _LOCK:
            counted, self._live = self._live, False
            if counted:
                _LIVE -= 1
            last, made = _LIVE == 0, _MADE_BY_ENGINE
            if counted and last and made:
                _MADE_BY_ENGINE = False
        if not counted or (last and made):
            yield  # vLLM's own cleanup: its groups and the default group its worker made
            return
        with _replaced_cleanup(_vllm_groups_only if last else _nothing_distributed):
            yield


def _nothing_distributed(*args: Any, **kwargs: Any) -> None:
    """Other engines still use vLLM's groups and the default group: keep them."""


def _vllm_groups_only(*args: Any, **kwargs: Any) -> None:
    """The last engine on a caller's default group: destroy vLLM's groups, keep the caller's default group."""
    from vllm.distributed import parallel_state

    parallel_state.destroy_model_parallel()
    world = parallel_state._WORLD
    if world is not None:
        world.destroy()
    parallel_state._WORLD = None


@contextlib.contextmanager
def _replaced_cleanup(replacement: Callable[..., None]) -> Iterator[None]:
    """``vllm.v1.engine.core.cleanup_dist_env_and_memory`` (what ``EngineCore.shutdown`` calls) replaced for the
    duration."""
    core = importlib.import_module("vllm.v1.engine.core")
    original = core.cleanup_dist_env_and_memory
    core.cleanup_dist_env_and_memory = replacement
    try:
        yield
    finally:
        core.cleanup_dist_env_and_memory = original


def live_engines() -> int:
    """Engines built and not yet closed in this process."""
    return _LIVE
