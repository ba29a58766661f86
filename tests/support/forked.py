"""Training runs in processes of their own, forked from a parent that has already imported torch, Lightning,
transformers and ``lightning_grpo`` (``multiprocessing``'s forkserver with a preload), instead of fresh interpreters
that import them again (seconds each on a 2-core CPU).

The children are ordinary processes: a run that SIGKILLs itself exits with ``-9``, SIGTERM reaches it, and its
output goes to a log file. The forkserver is started once per test process, from a clean interpreter (none of the
test process's state: no vLLM engine, no process group, no patched function), and every child is a fresh fork of
it, so two children never share state either.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import sys
from pathlib import Path
from typing import Any, Optional

#: What the forkserver imports once: the heavy libraries and the workers' own modules (which import the rest).
PRELOAD = ["torch", "lightning", "transformers", "transformers.models.llama.modeling_llama", "peft", "datasets",
           "lightning_grpo", "lightning_grpo.module", "lightning_grpo.data", "lightning_grpo.episodes",
           "support.resume_worker", "support.preemption_worker", "support.streaming_worker"]

_CONTEXT: Optional[Any] = None


def context() -> Any:
    """The forkserver context (made on first use; the server starts with the first child)."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(PRELOAD)
    return _CONTEXT


def _child(target: str, args: tuple, log: str, env: dict[str, str]) -> None:
    """In the child: output to ``log``, ``env`` set, then ``module:function(*args)``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    os.environ.update(env)
    module, function = target.split(":")
    getattr(importlib.import_module(module), function)(*args)
    sys.stdout.flush()
    sys.stderr.flush()


def start(target: str, *args: Any, log: Path, env: Optional[dict[str, str]] = None) -> Any:
    """Start ``module:function(*args)`` in a forked child; its stdout and stderr are appended to ``log``.
    Returns the ``multiprocessing.Process`` (``pid``, ``join``, ``exitcode``: -N for a death by signal N)."""
    process = context().Process(target=_child, args=(target, args, str(log), dict(env or {})), daemon=False)
    process.start()
    return process


def run(target: str, *args: Any, log: Path, timeout: float, env: Optional[dict[str, str]] = None) -> int:
    """:func:`start`, then wait: the child's exit code (0: returned; 1: raised, the traceback in ``log``; -9: killed
    by SIGKILL). A child still running after ``timeout`` seconds is killed and this raises ``TimeoutError``."""
    process = start(target, *args, log=log, env=env)
    process.join(timeout)
    if process.is_alive():
        process.kill()
        process.join()
        raise TimeoutError(f"{target} ran over {timeout} s; its output: {log}")
    return int(process.exitcode)


def tail(log: Path, chars: int = 3000) -> str:
    """The end of a child's log (for assertion messages)."""
    return log.read_text(errors="replace")[-chars:] if log.exists() else "(no output)"
