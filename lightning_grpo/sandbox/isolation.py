"""The isolation mechanisms a sandboxed run can use, as command lines, and which of them work on this machine.

* ``bwrap`` (bubblewrap, Debian package ``bubblewrap``): new user, PID, network, IPC, UTS and cgroup namespaces; a
  filesystem of its own holding only ``/usr`` (read-only), the library symlinks, a fresh ``/proc`` and ``/dev``, and
  two size-limited tmpfs (the working directory and ``/tmp``); no capabilities; no nested user namespaces; a new
  session (no terminal injection); killed with its parent.
* ``unshare`` (util-linux): new user, PID, network, mount, IPC and UTS namespaces, but the host's filesystem: files
  readable by the sandbox's user id are readable (as root the run's user is ``nobody``).
* ``rlimits``: resource limits, a new session and, as root, the ``nobody`` user only.

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
#: ``argv[2]`` is "exec" or "init", ``argv[3:]`` the command. It sets the limits, then "exec" replaces itself with
#: the command; "init" (for a PID namespace without an init of its own: the namespace's PID 1 ignores the signals
#: of the CPU limit) forks the command, reaps every process of the namespace, and exits with the command's status
#: (128 + N for a signal N, as bubblewrap's init does).
LAUNCHER = (
    "import json, os, resource, sys\n"
    "for name, (soft, hard) in json.loads(sys.argv[1]).items():\n"
    "    resource.setrlimit(getattr(resource, name), (soft, hard))\n"
    "os.umask(0o022)\n"
    "if sys.argv[2] == 'exec':\n"
    "    os.execv(sys.argv[3], sys.argv[3:])\n"
    "child = os.fork()\n"
    "if child == 0:\n"
    "    os.execv(sys.argv[3], sys.argv[3:])\n"
    "while True:\n"
    "    pid, status = os.wait()\n"
    "    if pid == child:\n"
    "        os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))\n"
)


def launcher_argv(python: str, rlimits: dict[str, tuple[int, int]], command: Sequence[str],
                  init: bool = False) -> list[str]:
    """``python -I -S -c LAUNCHER <limits> exec|init <command...>``."""
    return [python, "-I", "-S", "-c", LAUNCHER, json.dumps(rlimits), "init" if init else "exec", *command]


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
        tmpfs_bytes: the size of the working directory's and ``/tmp``'s tmpfs.
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
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(tmpfs_bytes), "--tmpfs", "/tmp",
             "--size", str(tmpfs_bytes), "--tmpfs", BWRAP_WORKDIR, "--chdir", BWRAP_WORKDIR]
    for name, fd in files.items():
        argv += ["--file", str(fd), f"{BWRAP_WORKDIR}/{name}"]
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
