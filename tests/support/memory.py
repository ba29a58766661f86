"""Giving a test process's freed memory back to the system between test files."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
from typing import Callable, Optional


@functools.cache
def _malloc_trim() -> Optional[Callable[[int], int]]:
    """glibc's ``malloc_trim``, looked up once (``find_library`` runs ``ldconfig``); None where the C library has
    none (musl, macOS)."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return None
    return getattr(ctypes.CDLL(libc_name), "malloc_trim", None)


def release_freed_memory() -> bool:
    """``gc.collect()``, then glibc's ``malloc_trim(0)``: the heap pages freed by the models, engines and tensors of
    the file that ended go back to the system instead of staying resident in the worker (glibc keeps freed pages of
    its arenas for reuse; a worker that ran an engine file held gigabytes of them). Returns whether memory was trimmed
    (False where the C library has no ``malloc_trim``, e.g. musl or macOS)."""
    gc.collect()
    trim = _malloc_trim()
    return trim is not None and bool(trim(0))
