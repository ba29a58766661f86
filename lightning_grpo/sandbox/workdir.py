"""The host folders that are the working directories of ``unshare`` and ``rlimits`` runs, and the removal of those a
killed trainer left behind.

A folder is named ``lightning_grpo_sandbox_<pid namespace>-<pid>-<start time>_<random>`` after the process that made
it. The trainer deletes it when the run ends; a trainer killed with SIGKILL cannot, so the first run of every later
process removes the folders, in the system's temporary folder, whose maker (same PID namespace) is no longer running.
Bubblewrap runs need no host folder: their files are copied in from anonymous memory files.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import threading
from typing import Optional

PREFIX = "lightning_grpo_sandbox_"
_NAME = re.compile(re.escape(PREFIX) + r"(\d+)-(\d+)-(\d+)_")
_swept = threading.Event()


def _start_time(pid: int) -> Optional[int]:
    """The start time of process ``pid`` (clock ticks after boot), None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _pid_namespace() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def make_host_dir() -> str:
    """A new folder in the system's temporary folder, named after this process (removes stale ones first, once per
    process: :func:`remove_stale_host_dirs`)."""
    if not _swept.is_set():
        _swept.set()
        remove_stale_host_dirs()
    pid = os.getpid()
    return tempfile.mkdtemp(prefix=f"{PREFIX}{_pid_namespace()}-{pid}-{_start_time(pid)}_")


def remove_stale_host_dirs(folder: Optional[str] = None) -> list[str]:
    """Delete the run folders in ``folder`` (default: the system's temporary folder) whose maker, a process of this
    PID namespace, no longer runs (a trainer killed before it could delete them). Returns the deleted paths."""
    folder = folder or tempfile.gettempdir()
    namespace = _pid_namespace()
    removed: list[str] = []
    try:
        entries = os.listdir(folder)
    except OSError:
        return removed
    for entry in entries:
        match = _NAME.match(entry)
        if match is None or int(match[1]) != namespace:
            continue
        pid, started = int(match[2]), int(match[3])
        if _start_time(pid) == started:
            continue  # its maker still runs
        path = os.path.join(folder, entry)
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.exists(path):
            removed.append(path)
    return removed
