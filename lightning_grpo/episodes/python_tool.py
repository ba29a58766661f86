"""The Python tool: the model's code runs in the sandbox of the code rewards (one sandbox for both), never in the
trainer's process.

The tool needs a sandbox object with ``run_python(source) -> result`` where the result has ``status`` ("ok" or how it
failed: "error", "timeout", "cpu_limit", "output_limit", "signal"), ``stdout`` and ``stderr``:
:class:`lightning_grpo.sandbox.Sandbox` (isolation, resource limits, wall-clock kill; docs/rewards.md, "The
sandbox") is one. A program that fails is an error result the model reads (its status and the end of its standard
error), counted in ``tools/error_rate``.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, runtime_checkable

from lightning_grpo.sandbox import Sandbox


@runtime_checkable
class SandboxRun(Protocol):
    """What one sandboxed run reports (:class:`lightning_grpo.sandbox.SandboxResult` has these)."""

    status: str
    stdout: str
    stderr: str


@runtime_checkable
class PythonSandbox(Protocol):
    """Runs Python source in isolation (:class:`lightning_grpo.sandbox.Sandbox` is one)."""

    def run_python(self, source: str) -> SandboxRun:
        """Run ``source`` as a program; its outcome."""
        ...


class PythonToolError(RuntimeError):
    """The model's program did not finish normally (its status and standard error are in the message)."""


def _tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]


def python_tool(sandbox: Optional[PythonSandbox] = None, max_output_chars: int = 2000) -> Callable[[str], str]:
    """The ``python`` tool, running code in ``sandbox``.

    Args:
        sandbox: where the code runs (:class:`PythonSandbox`); None: a :class:`lightning_grpo.sandbox.Sandbox` with
            its default limits (10 s wall clock, 5 CPU s, 512 MiB, 16 processes) and the strongest isolation here.
        max_output_chars: most characters of output the model reads (the end is kept), >= 1.

    Raises:
        TypeError: ``sandbox`` has no ``run_python``.
        ValueError: ``max_output_chars < 1``.
    """
    if sandbox is None:
        sandbox = Sandbox()
    if not isinstance(sandbox, PythonSandbox):
        raise TypeError(f"python_tool needs a sandbox with run_python(source), got {type(sandbox).__name__}")
    if max_output_chars < 1:
        raise ValueError(f"python_tool max_output_chars={max_output_chars!r} must be >= 1")

    def python(code: str) -> str:
        """Run a Python program in a sandbox and return what it printed.

        Args:
            code: the program; print the values you need.

        Returns:
            Its standard output.
        """
        result = sandbox.run_python(code)
        if result.status != "ok":
            raise PythonToolError(f"the program ended with {result.status}: {_tail(result.stderr, max_output_chars)}")
        return _tail(result.stdout, max_output_chars)

    return python
