"""Checkpoints that survive a kill: atomic writes next to the target, and ``ckpt_path="last"`` that never silently
starts over.

* :class:`AtomicCheckpointIO` writes a checkpoint to a temporary file in the checkpoint's own folder, flushes it
  to disk and renames it onto the target (``os.replace``, atomic on POSIX): a reader sees the old checkpoint or
  the new one, never a partial file. Lightning's default ``TorchCheckpointIO`` holds the whole checkpoint in memory
  and writes it through an fsspec transaction whose temporary file lives in the system temp folder
  (``tempfile.mkstemp()``): a killed save leaves it there, and when the checkpoint folder is on another filesystem
  the final move is a copy that a kill can leave truncated. ``GRPOModule.setup`` installs this IO in place of that
  default (:func:`use_atomic_checkpoint_io`); a CheckpointIO the user chose is kept.
* :class:`GRPOModelCheckpoint` (``lightning_grpo.callbacks``) extends how Lightning resolves
  ``fit(ckpt_path="last")``: Lightning looks only for ``last*.ckpt`` in each ``ModelCheckpoint``'s folder and,
  finding none, warns and trains from scratch, although a kill between the step checkpoint and ``last.ckpt`` (or a
  ``save_last="link"`` link whose target was just replaced) leaves a valid checkpoint there. With the extension,
  incomplete ``last`` files are ignored and, when no complete one exists, the newest complete checkpoint of the
  folder is used (with a warning); when the folder holds checkpoints but none is complete, the run stops with an
  error. A ``ModelCheckpoint`` without ``dirpath`` saves into the logger's version folder
  (``<save_dir>/<name>/version_N/checkpoints``), which is new for every run: there "last" also looks in the other
  versions' ``checkpoints`` folders (the CLI recipe's layout). No checkpoint anywhere still means a first run.
  Importing the package patches nothing: the recipes and docs/resume.md use ``GRPOModelCheckpoint``, and the CLI
  gives its trainer's plain ``ModelCheckpoint``s the same behaviour (:func:`use_last_checkpoint_fallback`).

"Complete" (:func:`is_complete_checkpoint`): a file in ``torch.save``'s zip format whose central directory (written
last) is readable, or a sharded checkpoint folder with Lightning's ``meta.pt`` (written after every shard).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import secrets
import time
import zipfile
from typing import Any, Optional

import torch
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

log = logging.getLogger(__name__)

#: Suffix of the temporary files of :class:`AtomicCheckpointIO` (``.<target name>.<random>.partial``).
PARTIAL_SUFFIX = ".partial"
#: Lightning's metadata file of a sharded (distributed) checkpoint folder, written after the shards.
SHARDED_METADATA = "meta.pt"
#: Partial files last written before this process started belong to killed saves of earlier processes.
_PROCESS_START = time.time()


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose saves are atomic on a local filesystem: ``torch.save`` into a temporary file next
    to the target, ``fsync``, ``os.replace`` onto the target, ``fsync`` of the folder. The temporary files that
    killed saves leave (``.<name>.<random>.partial``, last written before this process started) are removed by the
    next save into the same folder, so they never pile up. Remote paths (``s3://`` ...) use Lightning's own save.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None or not _is_local_file_protocol(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        target = os.path.abspath(os.fspath(path))
        folder = os.path.dirname(target)
        os.makedirs(folder, exist_ok=True)
        remove_partial_files(folder)
        fd, partial = _create_partial(target)
        try:
            with os.fdopen(fd, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(partial)
            raise
        _fsync_folder(folder)


def _create_partial(target: str) -> tuple[int, str]:
    """A new ``.<name>.<random>.partial`` file next to ``target``, with the permissions a plain ``open`` would give
    (``0o666`` minus the umask; ``tempfile.mkstemp`` would make it private)."""
    folder, name = os.path.split(target)
    while True:
        partial = os.path.join(folder, f".{name}.{secrets.token_hex(4)}{PARTIAL_SUFFIX}")
        try:
            return os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), partial
        except FileExistsError:
            continue


def remove_partial_files(folder: str, older_than: Optional[float] = None) -> list[str]:
    """Delete the temporary files of interrupted :class:`AtomicCheckpointIO` saves in ``folder`` last modified before
    ``older_than`` (a ``time.time()``; default: when this process started, so that a save in progress is kept).
    Returns the deleted paths."""
    cutoff = _PROCESS_START if older_than is None else older_than
    removed = []
    for path in glob.glob(os.path.join(glob.escape(folder), f".*{PARTIAL_SUFFIX}")):
        with contextlib.suppress(OSError):
            if os.path.getmtime(path) < cutoff:
                os.remove(path)
                removed.append(path)
    return removed


def _fsync_folder(folder: str) -> None:
    """Persist the rename (the folder entry) as well; not possible on every platform/filesystem."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def use_atomic_checkpoint_io(strategy: Any) -> bool:
    """Give ``strategy`` an :class:`AtomicCheckpointIO` when its checkpoint IO is Lightning's default
    ``TorchCheckpointIO`` (exactly that class); any other IO, e.g. a plugin the user passed, is kept. Returns
    whether it was installed."""
    if type(strategy.checkpoint_io) is not TorchCheckpointIO:
        return False
    strategy.checkpoint_io = AtomicCheckpointIO()
    return True


def is_complete_checkpoint(path: str) -> bool:
    """Whether ``path`` is a whole checkpoint: a file in ``torch.save``'s zip format whose central directory (the
    end of the file) reads and lists a ``data.pkl``, or a folder holding such a ``meta.pt`` (a sharded checkpoint).
    A dangling link, a truncated file or a folder without ``meta.pt`` is not. Reads only the zip's directory."""
    if os.path.isdir(path):
        return is_complete_checkpoint(os.path.join(path, SHARDED_METADATA))
    if not os.path.isfile(path):
        return False
    try:
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("data.pkl") for name in archive.namelist())
    except (zipfile.BadZipFile, OSError, ValueError):
        return False


def checkpoints_in(folder: str, extension: str = ".ckpt") -> list[str]:
    """The checkpoint entries (files, folders, links; complete or not) directly in ``folder``."""
    if not os.path.isdir(folder):
        return []
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(extension))


def newest_complete_checkpoint(folder: str, extension: str = ".ckpt") -> Optional[str]:
    """The complete checkpoint of ``folder`` written last (modification time), or None."""
    complete = [p for p in checkpoints_in(folder, extension) if is_complete_checkpoint(p)]
    return max(complete, key=os.path.getmtime) if complete else None


def _newest_in(folders: list[str], extension: str) -> Optional[str]:
    """The newest complete checkpoint of ``folders``, preferring ``last*`` ones (Lightning's names)."""
    found = [p for p in (newest_complete_checkpoint(f, extension) for f in folders) if p is not None]
    lasts = [p for f in folders for p in checkpoints_in(f, extension)
             if os.path.basename(p).startswith("last") and is_complete_checkpoint(p)]
    candidates = lasts or found
    return max(candidates, key=os.path.getmtime) if candidates else None


def resolve_last(lasts: set[str], folder: Optional[str], extension: str = ".ckpt",
                 earlier_runs: Optional[list[str]] = None) -> set[str]:
    """The checkpoints ``ckpt_path="last"`` may resume from: the complete ones of ``lasts`` (Lightning's
    ``last*.ckpt`` of one ``ModelCheckpoint``), else the newest complete checkpoint of ``folder``, else (when the
    folder is named after the logger's version, new for every run) the newest complete checkpoint of the
    ``earlier_runs`` folders (the other versions' ``checkpoints``; ``last*`` ones first), else nothing: a first run.

    Raises:
        RuntimeError: the folders hold checkpoints, none of them complete.
    """
    complete = {p for p in lasts if is_complete_checkpoint(p)}
    if complete:
        return complete
    if folder is None:
        return set()
    for folders in ([folder], sorted(earlier_runs or ())):
        newest = _newest_in(folders, extension)
        if newest is not None:
            rank_zero_warn(f'ckpt_path="last": no complete last checkpoint in {folder} ({sorted(lasts) or "none"}): '
                           f"resuming from the newest complete checkpoint, {newest}")
            return {newest}
        entries = [os.path.basename(p) for f in folders for p in checkpoints_in(f, extension)]
        if entries:
            raise RuntimeError(
                f'ckpt_path="last": the checkpoint folders {folders} hold {entries} but none is a complete checkpoint '
                "(interrupted saves?); pass ckpt_path=<a checkpoint>, or move them away to start from scratch"
            )
    return set()


class GRPOModelCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` whose ``fit(ckpt_path="last")`` also resumes when no complete ``last.ckpt``
    exists: from the newest complete checkpoint of its folder, else of the logger's earlier versions
    (:func:`resolve_last`; a preemption that killed the run between the step checkpoint and ``last.ckpt``, or a
    ``save_last="link"`` link whose target is gone). Everything else is ``ModelCheckpoint``'s.

    ``lightning-grpo`` (the CLI) uses it for every ``ModelCheckpoint`` of its trainer
    (:func:`use_last_checkpoint_fallback`); in Python, pass it instead of ``ModelCheckpoint``.

    Raises:
        RuntimeError: (``ckpt_path="last"``) the folders hold checkpoints, none of them complete.
    """

    @override
    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        lasts = super()._find_last_checkpoints(trainer)
        folder = os.fspath(self._ModelCheckpoint__resolve_ckpt_dir(trainer))  # type: ignore[attr-defined]
        if not _is_local_file_protocol(folder):
            return lasts
        earlier = None
        if self.dirpath is None and trainer.loggers:  # <save_dir>/<name>/<version>/checkpoints: other versions
            runs = os.path.dirname(os.path.dirname(folder))
            pattern = os.path.join(glob.escape(runs), "*", os.path.basename(folder))
            earlier = [f for f in glob.glob(pattern) if os.path.abspath(f) != os.path.abspath(folder)]
        return resolve_last(lasts, folder, self.FILE_EXTENSION, earlier)


def use_last_checkpoint_fallback(trainer: Any) -> None:
    """Give every plain ``ModelCheckpoint`` of ``trainer`` the behaviour of :class:`GRPOModelCheckpoint` (it
    subclasses it without state of its own, so the instance only changes class); other trainers and checkpoint
    classes are untouched. Call before ``fit``/``validate``/``test`` (the CLI does)."""
    for callback in trainer.checkpoint_callbacks:
        if type(callback) is ModelCheckpoint:
            callback.__class__ = GRPOModelCheckpoint
