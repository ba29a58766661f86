"""Giving a test process's freed memory back to the system between test files."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os

#: Resident memory (bytes) above which a file's end also runs a full garbage collection (~0.3-1 s in a worker that
#: imported torch, transformers and Lightning: too slow for every file, worth it after the heavy ones).
COLLECT_ABOVE_BYTES = 3 << 30


def resident_bytes() -> int:
    """This process's resident set size (``/proc/self/statm``), 0 where there is no ``/proc``."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def release_freed_memory(collect_above_bytes: int = COLLECT_ABOVE_BYTES) -> bool:
    """``gc.collect()`` when the process holds more than ``collect_above_bytes``, then glibc's ``malloc_trim(0)``
    (a fraction of a millisecond): heap pages freed by the tensors and models of the file that ended go back to the
    system instead of staying resident. Returns whether memory was trimmed (False where the C library has no
    ``malloc_trim``, e.g. musl or macOS)."""
    if resident_bytes() > collect_above_bytes:
        gc.collect()
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    try:
        trim = ctypes.CDLL(libc_name).malloc_trim
    except AttributeError:
        return False
    return bool(trim(0))
