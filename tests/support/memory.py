"""Giving a test process's freed memory back to the system between test files."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc


def release_freed_memory() -> bool:
    """``gc.collect()``, then glibc's ``malloc_trim(0)``: the heap pages freed by the models, engines and tensors of
    the file that ended go back to the system instead of staying resident in the worker (glibc keeps freed pages of
    its arenas for reuse; a worker that ran an engine file held gigabytes of them). Returns whether memory was trimmed
    (False where the C library has no ``malloc_trim``, e.g. musl or macOS)."""
    gc.collect()
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    try:
        trim = ctypes.CDLL(libc_name).malloc_trim
    except AttributeError:
        return False
    return bool(trim(0))
