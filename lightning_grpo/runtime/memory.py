"""How much memory the training process may still use, and the peak a piece of work reaches, on CUDA and on CPU.

* CUDA: free device memory (``torch.cuda.mem_get_info``) plus what torch's caching allocator holds unused; the
  peak of ``torch.cuda.max_memory_allocated`` (reset before the work).
* CPU: the smallest of ``MemAvailable`` (``/proc/meminfo``), the cgroup's ``memory.max - memory.current`` (v2, or
  v1's ``memory.limit_in_bytes - memory.usage_in_bytes``) and the address-space limit ``RLIMIT_AS`` minus the
  process's ``VmSize``; the peak resident set ``VmHWM`` (reset through ``/proc/self/clear_refs``, Linux >= 4.0).
  Large tensors are ``mmap``-ed and written when computed, so their address space and resident size grow alike;
  the address space a process reserves without touching (thread arenas) is not seen: the target fraction of
  :mod:`lightning_grpo.training.token_budget` leaves room for it.

Linux only on CPU (``/proc``); elsewhere :func:`available_memory` raises.
"""

from __future__ import annotations

import ctypes
import gc
import resource
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

GIB = 2**30


@dataclass(frozen=True)
class MemoryLimit:
    """Bytes the process may still allocate, and which limit set them (for messages and logs)."""

    bytes: int
    source: str

    def describe(self) -> str:
        return f"{self.bytes / GIB:.2f} GiB ({self.source})"


def _proc_status() -> dict[str, int]:
    """``VmSize``, ``VmPeak``, ``VmRSS``, ``VmHWM`` of this process in bytes."""
    values = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmSize", "VmPeak", "VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) * 1024
    return values


def _read_int(path: str) -> Optional[int]:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _cgroup_left() -> Optional[int]:
    """Bytes left under this process's cgroup memory limit, or None without one."""
    limit, usage = _read_int("/sys/fs/cgroup/memory.max"), _read_int("/sys/fs/cgroup/memory.current")
    if limit is None:  # cgroup v1
        limit, usage = (_read_int("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
                        _read_int("/sys/fs/cgroup/memory/memory.usage_in_bytes"))
        if limit is not None and limit >= 2**60:  # v1 says "no limit" with a huge number
            limit = None
    return None if limit is None or usage is None else max(0, limit - usage)


def address_space_limit() -> Optional[int]:
    """The soft ``RLIMIT_AS`` in bytes, or None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else int(soft)


def available_memory(device: torch.device) -> MemoryLimit:
    """The memory this process can still allocate on ``device`` (see the module docstring).

    Raises:
        RuntimeError: a CPU device on a system without ``/proc/meminfo``.
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return MemoryLimit(int(free + cached), f"free memory of {device}")
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError as error:
        raise RuntimeError("the available CPU memory is read from /proc/meminfo, which this system lacks") from error
    kib = next(int(line.split()[1]) for line in meminfo.splitlines() if line.startswith("MemAvailable:"))
    limits = [MemoryLimit(kib * 1024, "MemAvailable")]
    cgroup = _cgroup_left()
    if cgroup is not None:
        limits.append(MemoryLimit(cgroup, "cgroup memory limit"))
    address_space = address_space_limit()
    if address_space is not None:
        limits.append(MemoryLimit(max(0, address_space - _proc_status()["VmSize"]), "RLIMIT_AS"))
    return min(limits, key=lambda limit: limit.bytes)


def release_freed_memory() -> None:
    """Return freed memory to the system: garbage-collect, empty torch's CUDA cache, glibc's ``malloc_trim``."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class PeakMeter:
    """Peak memory of the work done between :meth:`reset` and :meth:`peak`, above a fixed baseline.

    Args:
        device: where the work allocates.

    The baseline is taken at construction (``VmRSS`` / ``VmSize`` on CPU, allocated bytes on CUDA); measure every
    probe against it, smallest first, so memory an earlier probe freed but the allocator kept is not counted twice.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        release_freed_memory()
        if device.type == "cuda":
            self.base = torch.cuda.memory_allocated(device)
        else:
            self.base = _proc_status()["VmRSS"]

    def reset(self) -> None:
        """Start a measurement."""
        release_freed_memory()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS

    def peak(self) -> int:
        """Bytes above the baseline at the peak since :meth:`reset`."""
        if self.device.type == "cuda":
            return max(0, torch.cuda.max_memory_allocated(self.device) - self.base)
        return max(0, _proc_status()["VmHWM"] - self.base)
