"""A user id of its own for each concurrent ``rlimits`` run of a root trainer.

Under the ``rlimits`` fallback the kernel counts ``RLIMIT_NPROC`` per user id, and a process may signal or trace
the processes of its own user. Were every run ``nobody``, a fork bomb in one run would leave the runs scored at the
same time unable to fork (scored "error"), and one run's code could kill another run's checker: a completion would
change how another is scored. So each run of a root trainer under ``rlimits`` takes a user id (and the group of the
same number) that no other run holds while it runs: ids ``RUN_UID_BASE`` to ``RUN_UID_BASE + RUN_UIDS - 1``, no
account of the system. A run holds its id by an exclusive ``flock`` on a file of a folder only root may open (in
the system's temporary folder), so the trainer's threads, its other processes (data-parallel ranks, reward workers)
and other trainers on the machine never share one; the lock goes with the run (or with a killed trainer).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import tempfile
import time
from typing import Iterator

#: The first user id of the runs' range: far above the ids of accounts (Debian's dynamic ids end at 59,999; systemd's
#: dynamic users at 65,519; container id maps commonly start at 100,000 or 165,536).
RUN_UID_BASE = 2_000_000_000
#: How many ids the range holds: concurrent runs on the machine beyond this wait for a free one.
RUN_UIDS = 256
#: The folder (in the system's temporary folder) of the ids' lock files.
LOCK_FOLDER = "lightning_grpo_sandbox_uids"
#: Seconds between two scans for a free id when all are held.
_POLL_S = 0.05


def _lock_folder() -> str:
    folder = os.path.join(tempfile.gettempdir(), LOCK_FOLDER)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    info = os.lstat(folder)
    if info.st_uid != os.geteuid() or info.st_mode & 0o077 or not stat.S_ISDIR(info.st_mode):  # lstat: no link
        raise PermissionError(f"{folder}: must be a folder of user {os.geteuid()} that no one else may open "
                              f"(owner {info.st_uid}, mode {oct(info.st_mode & 0o777)})")
    return folder


@contextlib.contextmanager
def run_user(base: int = RUN_UID_BASE, count: int = RUN_UIDS) -> Iterator[int]:
    """Hold a user id of ``base`` .. ``base + count - 1`` that no other run holds, for the ``with`` body; yields it.
    Waits while every id is held.

    Raises:
        PermissionError: the lock folder exists but is not this user's alone (another user could hold ids).
        ValueError: ``count`` < 1 or ``base`` < 1.
    """
    if count < 1 or base < 1:
        raise ValueError(f"run_user(base={base}, count={count}): both must be >= 1")
    folder = _lock_folder()
    start = (os.getpid() * 31) % count  # processes start their scans at different ids
    while True:
        for k in range(count):
            uid = base + (start + k) % count
            fd = os.open(os.path.join(folder, str(uid)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                yield uid
            finally:
                os.close(fd)  # releases the lock
            return
        time.sleep(_POLL_S)
