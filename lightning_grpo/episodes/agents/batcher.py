"""Concurrent agent calls collected into batched engine calls.

The gateway's sessions :meth:`CallBatcher.submit` their tokenized calls from the gateway's thread; the rollout's
thread (the one that owns the engine) takes them in batches (:meth:`CallBatcher.collect`): a batch is handed over as
soon as every running agent has a call waiting (nobody else can add one), or ``window_s`` seconds after its first
call arrived, so concurrent agents share each ``engine.generate`` instead of calling the engine one request at a
time. A batch holds its calls in session order, so when every agent sends its next call within the window, the
batches (and the per-request seeds of their rows) do not depend on the threads' timing. An agent that finished
(returned, raised, timed out) no longer counts as running; a call still waiting for it is answered with its error.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass
class PendingCall:
    """One call waiting for the engine: its session (``key``), what to generate (``call``), and the future its answer
    goes to."""

    key: int
    call: Any
    future: Future


class CallBatcher:
    """See the module docstring.

    Args:
        keys: the sessions of the rollout, all running at first.
        window_s: the longest a call waits for others to join its batch.
        poll_s: how often :meth:`collect` wakes to run its ``tick`` (timeouts, the stop flag) while it waits.
    """

    def __init__(self, keys: range, window_s: float, poll_s: float = 0.05) -> None:
        self.window_s, self.poll_s = window_s, poll_s
        self.running = set(keys)
        self.pending: dict[int, PendingCall] = {}
        self._first: Optional[float] = None
        self._cond = threading.Condition()

    def submit(self, key: int, call: Any) -> Future:
        """Queue session ``key``'s call (one at a time per session: the session's lock sees to it); the future gets
        the engine's result, or the exception the session finished with.

        Raises:
            RuntimeError: session ``key`` is not running.
        """
        future: Future = Future()
        with self._cond:
            if key not in self.running:
                raise RuntimeError(f"session {key} is not running")
            self.pending[key] = PendingCall(key, call, future)
            if self._first is None:
                self._first = time.monotonic()
            self._cond.notify_all()
        return future

    def finish(self, key: int, error: Optional[BaseException] = None) -> None:
        """Session ``key``'s agent is done; a call of it still waiting fails with ``error`` (default: a
        RuntimeError)."""
        with self._cond:
            self.running.discard(key)
            waiting = self.pending.pop(key, None)
            if not self.pending:
                self._first = None
            self._cond.notify_all()
        if waiting is not None and not waiting.future.done():
            waiting.future.set_exception(error or RuntimeError(f"session {key} is over"))

    def fail_all(self, error: BaseException) -> None:
        """Every session is done, every waiting call fails with ``error`` (the rollout stops)."""
        for key in list(self.running | set(self.pending)):
            self.finish(key, error)

    def collect(self, tick: Callable[[], None], return_empty: bool = False) -> Optional[list[PendingCall]]:
        """The next batch (see the module docstring); None when no session runs and none waits. ``tick`` is called
        every ``poll_s`` while waiting (it may :meth:`finish` sessions or raise). ``return_empty``: return an empty
        batch after ``window_s`` without calls (processes in lockstep agree at that pace)."""
        started = time.monotonic()
        while True:
            tick()
            with self._cond:
                now = time.monotonic()
                if self.pending and (set(self.pending) >= self.running
                                     or now - (self._first or now) >= self.window_s):
                    batch = [self.pending[k] for k in sorted(self.pending)]  # session order: a seeded batch
                    self.pending.clear()
                    self._first = None
                    return batch
                if not self.pending and not self.running:
                    return None
                if return_empty and not self.pending and now - started >= self.window_s:
                    return []
                wait = self.poll_s if not self.pending else min(self.poll_s, self.window_s - (now - self._first))
                self._cond.wait(max(wait, 0.001))
