"""The sandbox: each run a fresh process tree, isolated (bubblewrap where present), limited, killed on timeout."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sys
import threading
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
from lightning_grpo.sandbox.limits import SandboxLimits, SandboxResult
from lightning_grpo.sandbox.process import execute
from lightning_grpo.sandbox.users import run_user
from lightning_grpo.sandbox.workdir import make_host_dir

log = logging.getLogger(__name__)

Isolation = Literal["auto", "bwrap", "unshare", "rlimits"]

#: ``nobody``: the user a root trainer's sandboxed code runs as.
NOBODY = 65534
_FILE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
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
        uid, gid: the user and group the code runs as (inside the sandbox's user namespace; as root also outside);
            default ``nobody``, except under ``rlimits`` as root, where each run takes a user id (and group) that no
            concurrent run holds (:func:`lightning_grpo.sandbox.users.run_user`): runs never share a process budget
            and cannot signal each other.

    Raises:
        ValueError: an unknown ``isolation``; only one of ``uid`` and ``gid``.
    """

    def __init__(self, limits: SandboxLimits = SandboxLimits(), isolation: Isolation = "auto",  # noqa: B008
                 python: Optional[str] = None, uid: Optional[int] = None, gid: Optional[int] = None) -> None:
        if isolation not in ("auto", *MECHANISMS):
            raise ValueError(f"Sandbox isolation={isolation!r} is unknown; choose from {('auto', *MECHANISMS)}")
        self.limits = limits
        self.isolation = isolation
        self.python = python or default_python()
        if (uid is None) != (gid is None):
            raise ValueError(f"Sandbox(uid={uid!r}, gid={gid!r}): give both or neither")
        self.uid: int = NOBODY if uid is None else uid
        self.gid: int = NOBODY if gid is None else gid
        self._own_user = uid is None  # rlimits as root: each run its own user id (lightning_grpo.sandbox.users)
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
            stdin: bytes = b"", pass_fds: Sequence[int] = (), stop: Optional[threading.Event] = None
            ) -> SandboxResult:
        """Run ``argv`` (an absolute executable path first) in a fresh sandbox.

        Args:
            argv: the command.
            files: ``name -> content`` put in the working directory first (plain names: letters, digits, ``_``,
                ``.``, ``-``; text is written as UTF-8).
            stdin: its standard input.
            pass_fds: file descriptors of this process the command inherits under the same numbers (e.g. the ends
                of pipes to another run); they are handed over: closed in this process once the command has
                started (or failed to), also when this raises.
            stop: when set (by another thread), the run is killed unless it ends by itself within half a second
                (status ``"stopped"``).

        Raises:
            ValueError: a file name that is not plain, or an ``argv`` whose first entry is not an absolute path.
            RuntimeError: no isolation mechanism works (see :attr:`mechanism`).
            PermissionError: under ``rlimits`` as root, the folder of the run user ids' locks
                (``<temporary folder>/lightning_grpo_sandbox_uids``, :func:`lightning_grpo.sandbox.users.run_user`)
                exists but is not root's alone (mode 0700): another user made or opened it, and could hold or free
                ids; nothing runs (delete the folder to go on).
        """
        try:
            if not argv or not os.path.isabs(argv[0]):
                raise ValueError(f"sandbox argv must start with an absolute executable path, got {list(argv)[:1]}")
            for name in files:
                if not _FILE_NAME.fullmatch(name):
                    raise ValueError(f"sandbox file name {name!r} must be a plain name (letters, digits, _ . -)")
            mechanism = self.mechanism
        except BaseException:
            for fd in pass_fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            raise
        return self._run(mechanism, list(argv), files, stdin, self.limits, tuple(pass_fds), stop)

    def run_python(self, source: str, stdin: bytes = b"", files: Mapping[str, str | bytes] = {}  # noqa: B006
                   ) -> SandboxResult:
        """Run Python ``source`` as ``main.py`` in the working directory (``python -s main.py``, hash seed 0)."""
        return self.run([self.python, "-s", "main.py"], {**files, "main.py": source}, stdin)

    # ------------------------------------------------------------------ one run
    def _run(self, mechanism: Mechanism, argv: list[str], files: Mapping[str, str | bytes], stdin: bytes,
             limits: SandboxLimits, pass_fds: tuple[int, ...] = (), stop: Optional[threading.Event] = None
             ) -> SandboxResult:
        if mechanism == "rlimits" and self._own_user and os.geteuid() == 0:
            with run_user() as uid:
                return self._run_as(uid, uid, mechanism, argv, files, stdin, limits, pass_fds, stop)
        return self._run_as(self.uid, self.gid, mechanism, argv, files, stdin, limits, pass_fds, stop)

    def _run_as(self, uid: int, gid: int, mechanism: Mechanism, argv: list[str], files: Mapping[str, str | bytes],
                stdin: bytes, limits: SandboxLimits, pass_fds: tuple[int, ...] = (),
                stop: Optional[threading.Event] = None) -> SandboxResult:
        host_dir: Optional[str] = None
        fds: dict[str, int] = {}
        try:
            as_root = os.geteuid() == 0
            if mechanism == "bwrap":  # the files are copied into its tmpfs from anonymous memory: nothing on disk
                for name, content in files.items():
                    fds[name] = os.memfd_create(name)
                    _write_all(fds[name], content.encode() if isinstance(content, str) else content)
                    os.lseek(fds[name], 0, os.SEEK_SET)
            else:  # the code's working directory is a host folder
                host_dir = make_host_dir()
                for name, content in files.items():
                    with open(os.path.join(host_dir, name), "wb") as f:
                        f.write(content.encode() if isinstance(content, str) else content)
                if as_root:
                    for entry in [host_dir, *(os.path.join(host_dir, n) for n in files)]:
                        os.chown(entry, uid, gid)
            workdir = BWRAP_WORKDIR if mechanism == "bwrap" else host_dir
            assert workdir is not None
            env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0",
                   "PYTHONDONTWRITEBYTECODE": "1", "TMPDIR": "/tmp" if mechanism == "bwrap" else workdir}
            rlimits, trainer = limits.rlimits(), os.getpid()
            if mechanism == "bwrap":
                command = bwrap_argv(_require("bwrap"), self.python, uid, gid, limits.file_bytes, fds,
                                     env, launcher_argv(self.python, rlimits, argv))
            elif mechanism == "unshare":  # the guard makes unshare, and with it the namespace, die with this process
                inner = unshare_argv(_require("unshare"), uid, launcher_argv(self.python, rlimits, argv, "init"))
                command = launcher_argv(self.python, {}, inner, "guard", trainer)
            else:
                command = launcher_argv(self.python, rlimits, argv, "supervise", trainer)
            drop = {"user": uid, "group": gid, "extra_groups": []} if as_root else {}
            handed, pass_fds = pass_fds, ()
            return execute(command, host_dir or "/", env, stdin, limits, mechanism, [*fds.values(), *handed], drop,
                           stop, hand_over=handed)
        finally:
            for fd in (*fds.values(), *pass_fds):
                with contextlib.suppress(OSError):
                    os.close(fd)
            if host_dir is not None:
                shutil.rmtree(host_dir, ignore_errors=True)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _require(name: str) -> str:
    path = find_executable(name)
    if path is None:
        raise FileNotFoundError(f"{name} is not installed")
    return path
