"""The one asyncio event loop a streaming engine is driven from, on a background thread of its own: the producer's
groups and every one-off rollout (validation) run on it, so an engine whose connections belong to the loop that made
them (an HTTP client pool) only ever sees one loop."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any, Coroutine, Optional, TypeVar

T = TypeVar("T")


class EngineLoop:
    """An asyncio event loop running on a daemon thread, started on first use."""

    def __init__(self, name: str = "lightning_grpo_stream") -> None:
        self.name = name
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop (started now if it is not)."""
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                ready = threading.Event()

                def run() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    loop.run_forever()

                self._thread = threading.Thread(target=run, name=self.name, daemon=True)
                self._thread.start()
                ready.wait()
                self._loop = loop
            return self._loop

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> "Future[T]":
        """Run ``coroutine`` on the loop; its result (or error) comes back in the returned future."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def call_soon(self, callback: Any, *args: Any) -> None:
        """Call ``callback(*args)`` on the loop's thread (from any thread); nothing when the loop is not running."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(callback, *args)
            except RuntimeError:  # closed meanwhile
                pass

    def close(self) -> None:
        """Cancel what still runs on it, stop the loop and end its thread (idempotent; a later use starts anew)."""
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None or thread is None:
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_all(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()
