"""The sandbox: each run a fresh process tree, isolated (bubblewrap where present), limited, killed on timeout."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Literal, Optional

from lightning_grpo.sandbox.isolation import (
    BWRAP_WORKDIR,
    MECHANISMS,
    Mechanism,
    bwrap_argv,
    find_executable,
    launcher_argv,
    unshare_argv,
)
from lightning_grpo.sandbox.limits import SandboxLimits, SandboxResult, Status

log = logging.getLogger(__name__)

Isolation = Literal["auto", "bwrap", "unshare", "rlimits"]

#: ``nobody``: the user a root trainer's sandboxed code runs as.
NOBODY = 65534
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_READ_CHUNK = 1 << 16
_REAP_WAIT_S = 2.0  # for the leader to reap its killed namespace
#: How long the probe run of a mechanism may take (the first run of a process pays it once per mechanism); generous,
#: so that a loaded machine never falls back to a weaker mechanism for want of time.
_PROBE_WALL_S = 120.0
_probe_lock = threading.Lock()
_probed: dict[tuple, Optional[str]] = {}  # (mechanism, python, uid, gid) -> None if it works, else why not


def default_python() -> str:
    """The interpreter sandboxed Python code runs with: the system's ``/usr/bin/python3`` when present (a
    bubblewrap sandbox holds ``/usr`` only), else this process's base interpreter (not its virtual environment)."""
    if os.access("/usr/bin/python3", os.X_OK):
        return "/usr/bin/python3"
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


class Sandbox:
    """Runs commands, one fresh process tree each, under an isolation mechanism and :class:`SandboxLimits`.

    What a run gets (docs/rewards.md, "The sandbox", says what each mechanism guarantees): its own working
    directory holding the ``files`` it was given (a tmpfs of ``file_bytes`` under bubblewrap, else a temporary
    folder), a cleared environment (``PATH``, ``HOME``, ``LANG``, ``PYTHONHASHSEED=0``), the resource limits (set
    before the code starts), standard input, and nothing else: as root it runs as ``nobody`` (``uid``). Its whole
    process tree is killed (SIGKILL) at the wall-clock limit or when it prints more than ``output_bytes``; the
    caller's process is never touched.

    Args:
        limits: the resource limits.
        isolation: ``"bwrap"``, ``"unshare"`` or ``"rlimits"`` (docs/rewards.md); ``"auto"``: the strongest that
            works here, checked once per process with a probe run, logged, and reported in each
            :class:`SandboxResult` (``isolation``).
        python: the interpreter of :meth:`run_python` (default :func:`default_python`).
        uid, gid: the user and group the code runs as (inside the sandbox's user namespace; as root also outside).

    Raises:
        ValueError: an unknown ``isolation``.
    """

    def __init__(self, limits: SandboxLimits = SandboxLimits(), isolation: Isolation = "auto",  # noqa: B008
                 python: Optional[str] = None, uid: int = NOBODY, gid: int = NOBODY) -> None:
        if isolation not in ("auto", *MECHANISMS):
            raise ValueError(f"Sandbox isolation={isolation!r} is unknown; choose from {('auto', *MECHANISMS)}")
        self.limits = limits
        self.isolation = isolation
        self.python = python or default_python()
        self.uid, self.gid = uid, gid
        self._mechanism: Optional[Mechanism] = None

    @property
    def mechanism(self) -> Mechanism:
        """The mechanism the runs use (``isolation``, or with "auto" the strongest that works here).

        Raises:
            RuntimeError: the requested mechanism (or, with "auto", none) works on this machine; the message has
                each probe's error.
        """
        if self._mechanism is None:
            candidates: tuple[Mechanism, ...] = MECHANISMS if self.isolation == "auto" else (self.isolation,)
            errors = {}
            for mechanism in candidates:
                error = self._probe(mechanism)
                if error is None:
                    self._mechanism = mechanism
                    break
                errors[mechanism] = error
            else:
                raise RuntimeError(f"Sandbox(isolation={self.isolation!r}): no isolation mechanism works here: "
                                   f"{errors}")
            assert self._mechanism is not None
            if errors:
                log.warning("sandbox: using %r (%s unavailable: %s); see docs/rewards.md for what it guarantees",
                            self._mechanism, ", ".join(errors), errors)
        return self._mechanism  # type: ignore[return-value]  # set above

    def _probe(self, mechanism: Mechanism) -> Optional[str]:
        key = (mechanism, self.python, self.uid, self.gid)
        with _probe_lock:
            if key not in _probed:
                try:
                    result = self._run(mechanism, [self.python, "-I", "-S", "-c", "print('ok')"], {}, b"",
                                       SandboxLimits(wall_s=_PROBE_WALL_S))
                    fine = result.status == "ok" and result.stdout.strip() == "ok"
                    _probed[key] = None if fine else f"probe run {result.status}: {result.stderr.strip()[-300:]!r}"
                except OSError as err:
                    _probed[key] = f"{type(err).__name__}: {err}"
            return _probed[key]

    def run(self, argv: Sequence[str], files: Mapping[str, str | bytes] = {},  # noqa: B006 - read only
            stdin: bytes = b"") -> SandboxResult:
        """Run ``argv`` (an absolute executable path first) in a fresh sandbox.

        Args:
            argv: the command.
            files: ``name -> content`` put in the working directory first (plain names: letters, digits, ``_``,
                ``.``, ``-``; text is written as UTF-8).
            stdin: its standard input.

        Raises:
            ValueError: a file name that is not plain, or an ``argv`` whose first entry is not an absolute path.
            RuntimeError: no isolation mechanism works (see :attr:`mechanism`).
        """
        if not argv or not os.path.isabs(argv[0]):
            raise ValueError(f"sandbox argv must start with an absolute executable path, got {list(argv)[:1]}")
        for name in files:
            if not _FILE_NAME.fullmatch(name):
                raise ValueError(f"sandbox file name {name!r} must be a plain name (letters, digits, _ . -)")
        return self._run(self.mechanism, list(argv), files, stdin, self.limits)

    def run_python(self, source: str, stdin: bytes = b"", files: Mapping[str, str | bytes] = {}  # noqa: B006
                   ) -> SandboxResult:
        """Run Python ``source`` as ``main.py`` in the working directory (``python -s main.py``, hash seed 0)."""
        return self.run([self.python, "-s", "main.py"], {**files, "main.py": source}, stdin)

    # ------------------------------------------------------------------ one run
    def _run(self, mechanism: Mechanism, argv: list[str], files: Mapping[str, str | bytes], stdin: bytes,
             limits: SandboxLimits) -> SandboxResult:
        host_dir = tempfile.mkdtemp(prefix="lightning_grpo_sandbox_")
        fds: dict[str, int] = {}
        try:
            for name, content in files.items():
                path = os.path.join(host_dir, name)
                with open(path, "wb") as f:
                    f.write(content.encode() if isinstance(content, str) else content)
                if mechanism == "bwrap":
                    fds[name] = os.open(path, os.O_RDONLY)
            as_root = os.geteuid() == 0
            if as_root and mechanism != "bwrap":  # the code's working directory is the host folder
                for entry in [host_dir, *(os.path.join(host_dir, n) for n in files)]:
                    os.chown(entry, self.uid, self.gid)
            workdir = BWRAP_WORKDIR if mechanism == "bwrap" else host_dir
            env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
                   "PYTHONDONTWRITEBYTECODE": "1", "TMPDIR": "/tmp" if mechanism == "bwrap" else workdir}
            launcher = launcher_argv(self.python, limits.rlimits(), argv, init=mechanism == "unshare")
            if mechanism == "bwrap":
                command = bwrap_argv(_require("bwrap"), self.python, self.uid, self.gid, limits.file_bytes, fds,
                                     env, launcher)
            elif mechanism == "unshare":
                command = unshare_argv(_require("unshare"), self.uid, launcher)
            else:
                command = launcher
            drop = {"user": self.uid, "group": self.gid, "extra_groups": []} if as_root else {}
            return _execute(command, host_dir, env, stdin, limits, mechanism, list(fds.values()), drop)
        finally:
            for fd in fds.values():
                os.close(fd)
            shutil.rmtree(host_dir, ignore_errors=True)


def _require(name: str) -> str:
    path = find_executable(name)
    if path is None:
        raise FileNotFoundError(f"{name} is not installed")
    return path


def _execute(command: list[str], cwd: str, env: dict[str, str], stdin: bytes, limits: SandboxLimits,
             mechanism: str, pass_fds: list[int], drop: dict) -> SandboxResult:
    """Start ``command`` in a new session, feed ``stdin``, read at most ``output_bytes``, kill the session at the
    wall-clock limit; the process tree is always killed before returning."""
    start = time.monotonic()
    deadline = start + limits.wall_s
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True, pass_fds=pass_fds, **drop)
    try:
        out, err, ended = _communicate(proc, stdin, limits.output_bytes, deadline)
        if ended is None:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                ended = "timeout"
    finally:
        _kill_tree(proc, namespaced=mechanism != "rlimits")
    returncode = None if ended is not None else proc.returncode
    status: Status = ended or _status(returncode, mechanism)
    return SandboxResult(status, returncode, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"),
                         time.monotonic() - start, mechanism)


def _status(returncode: Optional[int], mechanism: str) -> Status:
    if returncode == 0:
        return "ok"
    assert returncode is not None
    namespaced = mechanism in ("bwrap", "unshare")  # their PID namespace's init reports a signal N as 128 + N
    signum = -returncode if returncode < 0 else (returncode - 128 if namespaced and returncode > 128 else 0)
    if signum == signal.SIGXCPU:
        return "cpu_limit"
    return "signal" if signum > 0 else "error"


def _communicate(proc: subprocess.Popen, stdin: bytes, limit: int, deadline: float
                 ) -> tuple[bytes, bytes, Optional[Literal["timeout", "output_limit"]]]:
    """Write ``stdin`` and read stdout and stderr until both close, the deadline passes (``"timeout"``) or more
    than ``limit`` bytes arrive in all (``"output_limit"``; the first ``limit`` are kept)."""
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
    ended: Optional[Literal["timeout", "output_limit"]] = None
    try:
        while selector.get_map() and ended is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                ended = "timeout"
                break
            for key, _ in selector.select(remaining):
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


def _children(pid: int) -> list[int]:
    """The direct children of ``pid`` (``/proc/<pid>/task/*/children``; empty where the kernel lacks it)."""
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return found


def _feed(fd: int, data: bytes, written: int) -> int:
    """Write the next piece of ``data`` to the non-blocking ``fd``; the bytes written so far (all of them once the
    reader has closed its end)."""
    try:
        return written + os.write(fd, data[written:written + _READ_CHUNK])
    except BlockingIOError:
        return written
    except BrokenPipeError:
        return len(data)


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

    With a PID namespace (bubblewrap, ``unshare``) the namespace's init (the leader's child) is killed first, which
    kills every process of the namespace, and the leader reaps it and exits; then the leader's session (process
    group) is killed, which is the whole run in the ``rlimits`` fallback (processes it orphaned are reaped by the
    system's init)."""
    if namespaced and proc.poll() is None:
        for child in _children(proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(child, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=_REAP_WAIT_S)
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
