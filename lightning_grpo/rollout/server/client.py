"""JSON over HTTP to one rollout server (:mod:`lightning_grpo.rollout.server.app`) with httpx, with retries and a
deadline, for many requests in flight.

* :class:`AsyncServerClient`: ``await request(...)`` on the caller's event loop (the streaming pool keeps many
  groups in flight on one loop; each request has a connection of its own);
* :class:`ServerClient`: the same requests, blocking (the fixed schedule's engine, weight syncs, probes): each runs
  on one event loop that a daemon thread of this process keeps for them.

What a request guarantees:

* **Deadline**: a request gives up at its deadline (``engine.server_timeout`` from its start unless told otherwise)
  whatever the server does: the whole exchange (connect, send, the answer) is cancelled then (``asyncio``'s
  timeout), so a server that accepts and never answers, or answers slowly but steadily (a byte at a time), costs the
  deadline and not more; httpx's own timeouts (connect, read, write) are the time left, a backstop.
* **Retries**: a request that could not be delivered (connection refused, no route, the connect timed out) is
  retried with exponential backoff (0.1 s doubling to 2 s) until the deadline, and so is one the server refused
  as busy (HTTP 503: its queue was full; nothing was done). A request that was sent and then lost (reset, no answer)
  is retried only when it is ``idempotent`` (generation, probes, health); weight-sync calls are not, since the
  server may be half way through them. ``retry=False`` (the pool, which moves a lost server's groups elsewhere)
  raises :class:`ServerUnreachable` at the first failure to deliver or to answer (503 is still retried).
* **Errors**: any other HTTP error status is the server's own error and is raised at once with its message.
* **Secret**: every request carries the shared secret (:mod:`lightning_grpo.rollout.server.security`); proxies from
  the environment are not used (``trust_env=False``).
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
import threading
import time
from typing import Any, Awaitable, Optional, TypeVar

import httpx

from lightning_grpo.config import parse_server_url
from lightning_grpo.rollout.server.security import authorization_header

T = TypeVar("T")


class RolloutServerError(RuntimeError):
    """A rollout server answered with an error, did not answer in time, or lost its weight-sync group."""


class ServerUnreachable(RolloutServerError):
    """A request with ``retry=False`` could not be delivered, or its answer was lost (the server is gone)."""


class _NotDelivered(Exception):
    """The request never reached the server (safe to send again)."""


class _Lost(Exception):
    """The request was sent but no whole answer came back."""


_SSL: Optional[ssl.SSLContext] = None


def _ssl_context() -> ssl.SSLContext:
    """One default TLS context for every client of this process (httpx would build one per client)."""
    global _SSL
    if _SSL is None:
        _SSL = ssl.create_default_context()
    return _SSL


class AsyncServerClient:
    """Requests to the server at ``url`` (``http(s)://host:port``), awaited on the caller's event loop.

    Args:
        url: the server's base URL.
        timeout_s: the default deadline of a request, in seconds from its start (``engine.server_timeout``).
        secret: the shared secret sent with every request, or None (a server without one).
        field: the setting that gave ``url``, named in the errors.

    Raises:
        ValueError: a malformed ``url`` (no http(s) scheme, no host, a port that is not a number in [1, 65535]) or
            ``timeout_s <= 0``.
    """

    def __init__(self, url: str, timeout_s: float, secret: Optional[str] = None,
                 field: str = "engine.server_urls") -> None:
        try:
            self.scheme, self.host, self.port = parse_server_url(url)
        except ValueError as err:
            raise ValueError(f"{field}: rollout server url {err}") from None
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
        self.url = url.strip().rstrip("/")
        self.timeout_s = float(timeout_s)
        self._headers = {"Content-Type": "application/json", **authorization_header(secret)}

    def deadline(self) -> float:
        """``time.monotonic()`` value at which a request started now gives up."""
        return time.monotonic() + self.timeout_s

    async def request(self, method: str, path: str, body: Optional[dict] = None, deadline: Optional[float] = None,
                      idempotent: bool = True, retry: bool = True) -> dict[str, Any]:
        """Send ``body`` as JSON and return the JSON answer.

        Args:
            method: "GET" or "POST".
            path: the endpoint, e.g. "/generate".
            body: the JSON body (POST).
            deadline: ``time.monotonic()`` value to give up at; default :meth:`deadline`.
            idempotent: whether the request may run twice (retried after a lost answer); False for the weight-sync
                calls, which are retried only when they were not delivered or refused as busy.
            retry: False: a request not delivered or lost raises :class:`ServerUnreachable` at once.

        Raises:
            RolloutServerError: the server answered with an error status (its message is included), or gave no
                answer before the deadline (the URL, the endpoint, ``engine.server_timeout`` and the last error
                are named), or a non-idempotent request was lost.
            ServerUnreachable: with ``retry=False``, the request was not delivered or its answer was lost.
        """
        deadline = self.deadline() if deadline is None else deadline
        data = None if body is None else json.dumps(body).encode()
        delay, last = 0.1, "none"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._late(method, path, last)
            try:
                status, raw = await self._attempt(method, path, data, remaining, last)
            except _NotDelivered as err:
                last = self._failed(method, path, err, retry, True, "not delivered")
            except _Lost as err:
                last = self._failed(method, path, err, retry, idempotent, "got no answer")
            else:
                if status < 300:
                    return json.loads(raw)
                last = self._refused(method, path, status, raw)
            await asyncio.sleep(max(0.0, min(delay, deadline - time.monotonic())))
            delay = min(2 * delay, 2.0)

    async def _attempt(self, method: str, path: str, data: Optional[bytes], remaining: float,
                       last: str) -> tuple[int, bytes]:
        """One exchange, cut after ``remaining`` seconds (then :meth:`_late` is raised, naming how far it got)."""
        progress: dict[str, Any] = {"connected": False, "body_bytes": 0}
        try:
            return await asyncio.wait_for(self._exchange(method, path, data, remaining, progress), remaining)
        except asyncio.TimeoutError:
            if not progress["connected"]:
                raise self._late(method, path, f"connect: timed out (last error: {last})") from None
            raise self._late(method, path, f"the answer was cut at the deadline ({progress['body_bytes']} bytes of "
                             "the body read)") from None

    def _failed(self, method: str, path: str, err: Exception, retry: bool, idempotent: bool, what: str) -> str:
        """The error of a failed exchange (``what`` happened), to retry after; raised when the request is not
        retried."""
        if not retry:
            raise ServerUnreachable(f"rollout server {self.url}: {method} {path} {what}: {err}") from None
        if not idempotent:
            raise RolloutServerError(f"rollout server {self.url}: {method} {path} failed: {err}; not retried (it may "
                                     "have been half done)") from None
        return str(err)

    def _refused(self, method: str, path: str, status: int, raw: bytes) -> str:
        """An HTTP 503 (busy: retried) as the last error; any other error status raised."""
        message = _error_message(raw)
        if status != 503:
            raise RolloutServerError(f"rollout server {self.url} answered {method} {path} with HTTP {status}: "
                                     f"{message}")
        return f"HTTP 503: {message}"

    def _late(self, method: str, path: str, last: str) -> RolloutServerError:
        return RolloutServerError(
            f"rollout server {self.url} did not answer {method} {path} within engine.server_timeout="
            f"{self.timeout_s:g} s (last error: {last}); is it running and reachable?")

    async def _exchange(self, method: str, path: str, data: Optional[bytes], remaining: float,
                        progress: dict[str, Any]) -> tuple[int, bytes]:
        """One request on a new connection: ``(status, body)``; ``progress`` records whether it connected and how
        much of the body came (for the deadline's message)."""

        async def trace(event: str, info: dict) -> None:
            if event in ("connection.connect_tcp.complete", "connection.start_tls.complete"):
                progress["connected"] = True

        timeout = httpx.Timeout(remaining + 1.0)  # the caller's deadline cuts first; this is a backstop
        async with httpx.AsyncClient(timeout=timeout, verify=_ssl_context(), trust_env=False,
                                     headers=self._headers) as http:
            try:
                request = http.build_request(method, f"{self.url}{path}", content=data, extensions={"trace": trace})
                response = await http.send(request, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as err:
                raise _NotDelivered(_describe(err)) from None
            except httpx.TransportError as err:
                raise _Lost(_describe(err)) from None
            try:
                parts = []
                async for chunk in response.aiter_bytes():
                    parts.append(chunk)
                    progress["body_bytes"] += len(chunk)
            except httpx.TransportError as err:
                raise _Lost(_describe(err)) from None
            finally:
                await response.aclose()
            return response.status_code, b"".join(parts)


class _Loop:
    """The event loop a daemon thread keeps for :class:`ServerClient`'s blocking requests (one per process; made
    again in a forked child)."""

    _lock = threading.Lock()
    _loop: Optional[asyncio.AbstractEventLoop] = None
    _pid = -1

    @classmethod
    def run(cls, coro: Awaitable[T]) -> T:
        with cls._lock:
            if cls._loop is None or cls._pid != os.getpid():
                cls._loop, cls._pid = asyncio.new_event_loop(), os.getpid()
                threading.Thread(target=cls._loop.run_forever, name="rollout-server-client", daemon=True).start()
            loop = cls._loop
        return asyncio.run_coroutine_threadsafe(coro, loop).result()  # type: ignore[arg-type]


class ServerClient:
    """:class:`AsyncServerClient`'s requests, blocking (from any thread but the client loop's; several at once run
    side by side). Same arguments and errors as :class:`AsyncServerClient`, which it holds as :attr:`aio`."""

    def __init__(self, url: str, timeout_s: float, secret: Optional[str] = None,
                 field: str = "engine.server_urls") -> None:
        self.aio = AsyncServerClient(url, timeout_s, secret, field)
        self.url, self.timeout_s = self.aio.url, self.aio.timeout_s

    def deadline(self) -> float:
        """``time.monotonic()`` value at which a request started now gives up."""
        return self.aio.deadline()

    def request(self, method: str, path: str, body: Optional[dict] = None, deadline: Optional[float] = None,
                idempotent: bool = True, retry: bool = True) -> dict[str, Any]:
        """:meth:`AsyncServerClient.request`, waited for.

        Raises:
            RolloutServerError: as :meth:`AsyncServerClient.request`.
        """
        return _Loop.run(self.aio.request(method, path, body, deadline, idempotent, retry))


def _describe(err: BaseException) -> str:
    """``Type: message``, with the innermost operating-system error under it when there is one (httpx's "All
    connection attempts failed" hides "Connection refused")."""
    text, cause, inner = f"{type(err).__name__}: {err}", err.__cause__ or err.__context__, None
    while cause is not None:
        if isinstance(cause, OSError):
            inner = cause
        cause = cause.__cause__ or cause.__context__
    if inner is None:
        return text
    reason = f"[Errno {inner.errno}] {os.strerror(inner.errno)}" if inner.errno else str(inner)
    return f"{text} ({reason})"


def _error_message(raw: bytes) -> str:
    """The ``error`` field of a JSON error answer, else the raw text (shortened)."""
    try:
        answer = json.loads(raw)
        return str(answer.get("error", answer)) if isinstance(answer, dict) else str(answer)
    except ValueError:
        return raw.decode(errors="replace")[:500]
