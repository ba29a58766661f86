"""The isolation mechanisms a sandboxed run can use, as command lines, and which of them work on this machine.

* ``bwrap`` (bubblewrap, Debian package ``bubblewrap``): new user, PID, network, IPC, UTS and cgroup namespaces; a
  filesystem of its own whose root and ``/dev`` are read-only and which holds only ``/usr`` (read-only), the library
  symlinks, a fresh ``/proc``, the device nodes of ``/dev``, and three tmpfs of ``file_bytes`` each (the working
  directory, ``/tmp`` and ``/dev/shm``: the only writable places); no capabilities; no nested user namespaces; a new
  session (no terminal injection); killed with its parent (``--die-with-parent``).
* ``unshare`` (util-linux): new user, PID, network, mount, IPC and UTS namespaces, but the host's filesystem: files
  readable by the sandbox's user id are readable (as root the run's user is ``nobody``). ``unshare`` is started by
  the launcher in its ``guard`` role, so it, and with it the whole PID namespace, dies with its parent.
* ``rlimits``: resource limits, a new session and, as root, the ``nobody`` user only; the launcher stays as the
  run's ``supervise`` process, a child subreaper that kills every descendant of the run when its parent dies.

Every mechanism starts the code through :data:`LAUNCHER`, which sets the resource limits
(:meth:`lightning_grpo.sandbox.limits.SandboxLimits.rlimits`) and then ``exec``s the command, so the limits hold from
the first instruction of the code on.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Literal, Sequence

Mechanism = Literal["bwrap", "unshare", "rlimits"]
#: The mechanisms, strongest first.
MECHANISMS: tuple[Mechanism, ...] = ("bwrap", "unshare", "rlimits")

#: The working directory inside a bubblewrap sandbox.
BWRAP_WORKDIR = "/sandbox"

#: Run by the sandbox's Python with ``-I -S -c``: ``argv[1]`` is the JSON of ``{"RLIMIT_...": [soft, hard]}``,
#: ``argv[2]`` the role, ``argv[3]`` the process id of the trainer that started it, ``argv[4:]`` the command. It sets
#: the limits, then by role:
#:
#: * ``exec``: replaces itself with the command (bubblewrap, whose ``--die-with-parent`` ends the run with its parent);
#: * ``guard``: asks the kernel for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``; it survives the ``exec``),
#:   exits at once when the parent is already gone, then replaces itself with the command (``unshare``, whose
#:   ``--kill-child`` then kills the PID namespace);
#: * ``init``: the PID 1 of a PID namespace without an init of its own (the namespace's PID 1 ignores the signals of
#:   the CPU limit): forks the command, reaps every process of the namespace, and exits with the command's status
#:   (128 + N for a signal N, as bubblewrap's init does);
#: * ``supervise`` (the ``rlimits`` mechanism): becomes a child subreaper (``PR_SET_CHILD_SUBREAPER``: orphans of the
#:   run become its children, even those that started a session of their own) and undumpable (``PR_SET_DUMPABLE``
#:   0: the run's code, the same user, cannot ptrace it or open its ``/proc`` files), forks the command, and when the
#:   command ends, or its parent dies (SIGTERM through ``PR_SET_PDEATHSIG``), kills every descendant (SIGKILL) and
#:   reaps them; it ends as the command did (the same exit status, or killed by the same signal).
LAUNCHER = r'''
import json, os, resource, signal, sys, time
limits, role, parent, command = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4:]


def prctl(option, value):
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(%d)" % option)


def descendants():
    found, stack = [], [os.getpid()]
    while stack:
        pid = stack.pop()
        try:
            tasks = os.listdir("/proc/%d/task" % pid)
        except OSError:
            continue
        for task in tasks:
            try:
                with open("/proc/%d/task/%s/children" % (pid, task)) as f:
                    children = [int(c) for c in f.read().split()]
            except OSError:
                continue
            found += children
            stack += children
    return found


def kill_all():
    while True:
        for pid in descendants():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            return
        time.sleep(0.002)


def parent_died(signum, frame):
    kill_all()
    os._exit(128 + signal.SIGKILL)


for name, (soft, hard) in limits.items():
    resource.setrlimit(getattr(resource, name), (soft, hard))
os.umask(0o022)
if role == "exec":
    os.execv(command[0], command)
if role == "guard":
    prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(128 + signal.SIGKILL)
    os.execv(command[0], command)
if role == "supervise":
    signal.signal(signal.SIGTERM, parent_died)
    prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    prctl(4, 0)  # PR_SET_DUMPABLE: the run's code (same user) cannot ptrace it or open its /proc files
    prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        parent_died(0, None)
child = os.fork()
if child == 0:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.execv(command[0], command)
while True:
    pid, status = os.wait()
    if pid == child:
        break
if role == "supervise":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    kill_all()
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.kill(os.getpid(), os.WTERMSIG(status))
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status))
os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
'''

Role = Literal["exec", "guard", "init", "supervise"]


def launcher_argv(python: str, rlimits: dict[str, tuple[int, int]], command: Sequence[str], role: Role = "exec",
                  parent: int = 0) -> list[str]:
    """``python -I -S -c LAUNCHER <limits> <role> <parent pid> <command...>`` (see :data:`LAUNCHER`)."""
    return [python, "-I", "-S", "-c", LAUNCHER, json.dumps(rlimits), role, str(parent), *command]


def _root_links() -> list[str]:
    """The ``/bin``, ``/lib``, ... entries of the host as bubblewrap arguments: symlinks (merged /usr) re-created,
    real folders bound read-only."""
    args: list[str] = []
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = f"/{name}"
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def bwrap_argv(bwrap: str, python: str, uid: int, gid: int, tmpfs_bytes: int, files: dict[str, int],
               env: dict[str, str], launcher: list[str], disable_userns: bool = True) -> list[str]:
    """The bubblewrap command line.

    Args:
        bwrap: the ``bwrap`` executable.
        python: the interpreter; its installation prefix is bound read-only when it is not under ``/usr``.
        uid, gid: the user and group inside the sandbox.
        tmpfs_bytes: the size of each writable tmpfs: the working directory, ``/tmp`` and ``/dev/shm``.
        files: ``name -> file descriptor`` of the files copied into the working directory (``--file``).
        env: the whole environment of the run.
        launcher: :func:`launcher_argv`.
        disable_userns: forbid user namespaces inside the sandbox (bubblewrap >= 0.8).
    """
    argv = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
            "--uid", str(uid), "--gid", str(gid), "--hostname", "sandbox", "--clearenv"]
    if disable_userns:
        argv.append("--disable-userns")
    argv += ["--ro-bind", "/usr", "/usr", *_root_links()]
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(python)))
    if not (prefix + "/").startswith("/usr/"):
        argv += ["--ro-bind", prefix, prefix]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    for folder in ("/dev/shm", "/tmp", BWRAP_WORKDIR):
        argv += ["--size", str(tmpfs_bytes), "--tmpfs", folder]
    for name, fd in files.items():
        argv += ["--file", str(fd), f"{BWRAP_WORKDIR}/{name}"]
    # bubblewrap's root and /dev are tmpfs of half the machine's memory: read-only, so only the three above are
    # writable (the device nodes, e.g. /dev/null, stay usable)
    argv += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", BWRAP_WORKDIR]
    for key, value in env.items():
        argv += ["--setenv", key, value]
    return [*argv, "--", *launcher]


def unshare_argv(unshare: str, uid: int, launcher: list[str]) -> list[str]:
    """The util-linux ``unshare`` command line: new user (the caller mapped to ``uid``), PID (with its own
    ``/proc``), network, mount, IPC and UTS namespaces; the child is killed when ``unshare`` dies."""
    return [unshare, "--user", f"--map-user={uid}", "--net", "--pid", "--mount", "--ipc", "--uts", "--fork",
            "--kill-child", "--mount-proc", "--", *launcher]


def find_executable(name: str) -> str | None:
    """``name`` on the ``PATH`` or in ``/usr/bin``, ``/bin``."""
    return shutil.which(name) or shutil.which(name, path="/usr/bin:/bin")
