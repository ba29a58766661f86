"""One sandboxed process tree from start to reaped end: standard input fed, output read up to its cap, the wall
clock and a caller's stop request enforced, and every process of the run killed before the result is returned."""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import threading
import time
from typing import Literal, Optional

from lightning_grpo.sandbox.limits import SandboxLimits, SandboxResult, Status

_READ_CHUNK = 1 << 16
_REAP_WAIT_S = 2.0  # for the leader to reap its killed namespace
#: How often a run that can be stopped looks at its stop request.
_STOP_POLL_S = 0.02
#: How long a stopped run may take to end by itself (e.g. at the end of its input) before it is killed.
STOP_GRACE_S = 0.5

Ended = Literal["timeout", "output_limit", "stopped"]


def execute(command: list[str], cwd: str, env: dict[str, str], stdin: bytes, limits: SandboxLimits,
            mechanism: str, pass_fds: list[int], drop: dict, stop: Optional[threading.Event] = None,
            hand_over: tuple[int, ...] = ()) -> SandboxResult:
    """Start ``command`` in a new session, feed ``stdin``, read at most ``output_bytes``, kill the run at the
    wall-clock limit or ``STOP_GRACE_S`` after ``stop`` is set; every process of the run is killed before this
    returns. ``hand_over``: file descriptors (among ``pass_fds``) closed in this process once the command started
    (or failed to)."""
    start = time.monotonic()
    cut = _Cut(start + limits.wall_s, stop)
    try:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True, pass_fds=pass_fds, **drop)
    finally:
        for fd in hand_over:
            with contextlib.suppress(OSError):
                os.close(fd)
    try:
        out, err, ended = _communicate(proc, stdin, limits.output_bytes, cut)
        while ended is None:
            at, why = cut.when()
            try:
                proc.wait(timeout=max(min(at - time.monotonic(), cut.poll_s), 0.0))
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() >= at:
                    ended = why
    finally:
        _kill_tree(proc, namespaced=mechanism != "rlimits")
    returncode = None if ended is not None else proc.returncode
    status: Status = ended or _status(returncode, mechanism)
    return SandboxResult(status, returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"),
                         time.monotonic() - start, mechanism)


class _Cut:
    """When a run is cut: at its wall-clock ``deadline`` (``"timeout"``), or ``STOP_GRACE_S`` after ``stop`` was
    first seen set (``"stopped"``), whichever is first."""

    def __init__(self, deadline: float, stop: Optional[threading.Event]) -> None:
        self.deadline, self.stop = deadline, stop
        self.stopped_at: Optional[float] = None
        self.poll_s = _STOP_POLL_S if stop is not None else float("inf")

    def when(self) -> tuple[float, Ended]:
        if self.stop is not None and self.stop.is_set():
            if self.stopped_at is None:
                self.stopped_at = time.monotonic()
            if self.stopped_at + STOP_GRACE_S < self.deadline:
                return self.stopped_at + STOP_GRACE_S, "stopped"
        return self.deadline, "timeout"


def _status(returncode: Optional[int], mechanism: str) -> Status:
    if returncode == 0:
        return "ok"
    assert returncode is not None
    namespaced = mechanism in ("bwrap", "unshare")  # their PID namespace's init reports a signal N as 128 + N
    signum = -returncode if returncode < 0 else (returncode - 128 if namespaced and returncode > 128 else 0)
    if signum == signal.SIGXCPU:
        return "cpu_limit"
    return "signal" if signum > 0 else "error"


def _communicate(proc: subprocess.Popen, stdin: bytes, limit: int, cut: _Cut
                 ) -> tuple[bytes, bytes, Optional[Ended]]:
    """Write ``stdin`` and read stdout and stderr until both close, the run is cut (:class:`_Cut`) or more than
    ``limit`` bytes arrive in all (``"output_limit"``; the first ``limit`` are kept)."""
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    buffers = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    selector = selectors.DefaultSelector()
    for fd in buffers:
        selector.register(fd, selectors.EVENT_READ)
    if stdin:
        os.set_blocking(proc.stdin.fileno(), False)
        selector.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    written, total = 0, 0
    ended: Optional[Ended] = None
    try:
        while selector.get_map() and ended is None:
            at, why = cut.when()
            remaining = at - time.monotonic()
            if remaining <= 0:
                ended = why
                break
            for key, _ in selector.select(min(remaining, cut.poll_s)):
                if key.fd in buffers:
                    total += _read_into(key.fd, buffers[key.fd], limit - total, selector)
                    continue
                written = _feed(key.fd, stdin, written)
                if written >= len(stdin):
                    selector.unregister(key.fd)
                    proc.stdin.close()
            if total > limit:
                ended = "output_limit"
    finally:
        selector.close()
        if not proc.stdin.closed:
            proc.stdin.close()
    return bytes(buffers[proc.stdout.fileno()]), bytes(buffers[proc.stderr.fileno()]), ended


def _read_into(fd: int, buffer: bytearray, room: int, selector: selectors.BaseSelector) -> int:
    """Read what ``fd`` has, keep at most ``room`` bytes of it in ``buffer``; the bytes read (0 at the end of the
    stream, which unregisters ``fd``)."""
    data = os.read(fd, _READ_CHUNK)
    if not data:
        selector.unregister(fd)
    buffer += data[:max(room, 0)]
    return len(data)


def _feed(fd: int, data: bytes, written: int) -> int:
    """Write the next piece of ``data`` to the non-blocking ``fd``; the bytes written so far (all of them once the
    reader has closed its end)."""
    try:
        return written + os.write(fd, data[written:written + _READ_CHUNK])
    except BlockingIOError:
        return written
    except BrokenPipeError:
        return len(data)


def descendants(pid: int) -> list[int]:
    """Every descendant of ``pid`` (``/proc/<pid>/task/*/children``, recursively; empty where the kernel lacks it)."""
    found: list[int] = []
    stack = [pid]
    while stack:
        parent = stack.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{parent}/task/{task}/children") as f:
                    children = [int(x) for x in f.read().split()]
            except OSError:
                continue
            found += children
            stack += children
    return found


def _alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _live_members(pgid: int) -> bool:
    """Some process of the process group ``pgid`` is not yet a zombie (a scan of ``/proc/<pid>/stat``)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def _kill_tree(proc: subprocess.Popen, namespaced: bool) -> None:
    """SIGKILL the run's process tree and reap it.

    While the leader lives, every live descendant of it is killed, again until none is left (with a PID namespace,
    bubblewrap or ``unshare``, these include the namespace's init, whose death kills every process of the namespace;
    in the ``rlimits`` fallback the launcher's supervisor is a child subreaper, so the run's orphans, even those in
    a session of their own, are still its descendants). Then the leader's session (process group) is killed, which
    catches what a killed supervisor orphaned unless it started its own session; processes the kill orphans are
    reaped by the system's init."""
    if proc.poll() is None:
        deadline = time.monotonic() + _REAP_WAIT_S
        while time.monotonic() < deadline:
            found = [pid for pid in descendants(proc.pid) if _alive(pid)]
            if not found:
                break
            for child in found:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(child, signal.SIGKILL)
            if namespaced:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=_REAP_WAIT_S)
                break
            time.sleep(0.01)
    deadline = time.monotonic() + _REAP_WAIT_S
    while True:  # again while live members remain (a fork in flight; SIGKILLed ones that have not exited yet)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if namespaced or not _live_members(proc.pid) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    proc.wait()
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()
