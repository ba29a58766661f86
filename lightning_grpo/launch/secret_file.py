"""The launch's shared-secret file: made with mode 600 when missing, refused when others may read it.

The servers and the trainer read the secret from this file (``lightning-grpo serve --secret-file``,
``engine.server_secret_file``; :mod:`lightning_grpo.rollout.server.security`), so it never appears on a command line,
where every user of a machine can read it with ``ps``. It must be on a filesystem every node sees.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

from lightning_grpo.rollout.server.security import read_secret

#: Random bytes of a new secret (written as hex: 64 characters).
SECRET_BYTES = 32


def check_secret_file(path: str) -> None:
    """An existing secret file readable by its owner only, holding a valid secret.

    Raises:
        ValueError: the file's mode lets its group or other users read or write it (the mode is named, with the
            ``chmod 600`` that fixes it), or it holds no valid secret (:func:`~lightning_grpo.rollout.server.security.
            read_secret`'s message).
    """
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        raise ValueError(f"--secret-file={path!r} has mode {mode:03o}: other users may read the secret; "
                         f"run `chmod 600 {path}`")
    read_secret(path, "--secret-file")


def make_secret_file(path: str) -> None:
    """Write a new secret (:data:`SECRET_BYTES` random bytes as hex) to ``path``, created with mode 600 (never
    readable by others, not even for a moment).

    Raises:
        FileExistsError: ``path`` exists (an existing secret is never replaced).
    """
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(secrets.token_hex(SECRET_BYTES) + "\n")
