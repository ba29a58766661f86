"""The limits of one sandboxed run and what became of it."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal

MiB = 1 << 20

#: How a run ended: ``ok`` (exit status 0), ``error`` (another exit status), ``timeout`` (the wall-clock limit: the
#: process tree was killed), ``cpu_limit`` (SIGXCPU: ``RLIMIT_CPU``), ``output_limit`` (more than ``output_bytes``
#: of output: killed), ``signal`` (killed by another signal, e.g. SIGSEGV or the kernel's SIGKILL), ``stopped`` (the
#: caller's ``stop`` request: killed, see :meth:`lightning_grpo.sandbox.Sandbox.run`).
Status = Literal["ok", "error", "timeout", "cpu_limit", "output_limit", "signal", "stopped"]


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandboxed run (every process of it).

    Attributes:
        wall_s: wall-clock seconds before the whole process tree is killed (SIGKILL), > 0.
        cpu_s: CPU seconds per process (``RLIMIT_CPU``; SIGXCPU at the limit, SIGKILL one second later), >= 1.
        memory_bytes: address space per process (``RLIMIT_AS``): an allocation past it fails (Python raises
            ``MemoryError``) instead of taking the memory.
        max_processes: processes and threads (``RLIMIT_NPROC``): with bubblewrap or ``unshare`` they are counted
            in the run's own user namespace (a fork bomb stops at this count); in the ``rlimits`` fallback they are
            counted per user id (shared by the runs of that user, see docs/rewards.md).
        output_bytes: stdout plus stderr read at most; a run that prints more is killed (``output_limit``).
        file_bytes: largest file a process may write (``RLIMIT_FSIZE``); with bubblewrap also the size of the
            writable working directory (a size-limited tmpfs) and of ``/tmp``.
        open_files: open file descriptors per process (``RLIMIT_NOFILE``).

    Raises:
        ValueError: a limit that is not a positive finite number (the field and value are named).
    """

    wall_s: float = 10.0
    cpu_s: int = 5
    memory_bytes: int = 512 * MiB
    max_processes: int = 16
    output_bytes: int = 1 * MiB
    file_bytes: int = 16 * MiB
    open_files: int = 64

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"SandboxLimits.{f.name}={value!r} is invalid: must be a positive finite number")
            if f.name != "wall_s" and not isinstance(value, int):
                raise ValueError(f"SandboxLimits.{f.name}={value!r} is invalid: must be an integer")

    def rlimits(self) -> dict[str, tuple[int, int]]:
        """The ``resource.RLIMIT_*`` names and (soft, hard) values the launcher sets before the code starts."""
        return {
            "RLIMIT_CPU": (self.cpu_s, self.cpu_s + 1),
            "RLIMIT_AS": (self.memory_bytes, self.memory_bytes),
            "RLIMIT_NPROC": (self.max_processes, self.max_processes),
            "RLIMIT_FSIZE": (self.file_bytes, self.file_bytes),
            "RLIMIT_NOFILE": (self.open_files, self.open_files),
            "RLIMIT_CORE": (0, 0),
        }


@dataclass
class SandboxResult:
    """What one sandboxed run did.

    Attributes:
        status: how it ended (:data:`Status`).
        returncode: the exit status (None when it was killed for the wall-clock or output limit); a signal N shows
            as ``-N`` (or ``128 + N`` under bubblewrap, whose init process reports it so).
        stdout: at most ``output_bytes`` of its standard output, decoded as UTF-8 (undecodable bytes replaced).
        stderr: its standard error, likewise (stdout and stderr share the ``output_bytes`` budget).
        wall_s: seconds from the start to the end of the run (or to the kill).
        isolation: the mechanism it ran under: ``"bwrap"``, ``"unshare"`` or ``"rlimits"`` (docs/rewards.md).
    """

    status: Status
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    isolation: str
