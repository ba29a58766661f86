"""JSON over HTTP to one rollout server (:mod:`lightning_grpo.rollout.server.app`), with retries and a deadline.

* **Deadline**: a request gives up at its deadline (``engine.server_timeout`` from its start unless told
  otherwise) whatever the server does: a watchdog shuts the connection's socket at that moment, so a server that
  accepts and never answers, or answers slowly but steadily (a byte at a time), costs the deadline and not more, on
  every kind of answer (a ``Content-Length``, chunked, or read until the server closes: HTTP/1.0 or
  ``Connection: close``).
* **Retries**: a request that could not be delivered (connection refused, no route, the connect timed out) is
  retried with exponential backoff (0.1 s doubling to 2 s) until the deadline, and so is one the server refused
  as busy (HTTP 503: its queue was full; nothing was done). A request that was sent and then lost (reset, no answer)
  is retried only when it is ``idempotent`` (generation, probes, health); weight-sync calls are not, since the
  server may be half way through them.
* **Errors**: any other HTTP error status is the server's own error and is raised at once with its message.
* **Secret**: every request carries the shared secret (:mod:`lightning_grpo.rollout.server.security`).

Standard library only (``http.client``).
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from typing import Any, Optional

from lightning_grpo.config import parse_server_url
from lightning_grpo.rollout.server.security import authorization_header


class RolloutServerError(RuntimeError):
    """A rollout server answered with an error, did not answer in time, or lost its weight-sync group."""


class _NotDelivered(Exception):
    """The request never reached the server (safe to send again)."""


class _Lost(Exception):
    """The request was sent but no whole answer came back."""


class _Expired(Exception):
    """The deadline passed while waiting for the answer."""


class ServerClient:
    """Requests to the server at ``url`` (``http://host:port``).

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

    def request(self, method: str, path: str, body: Optional[dict] = None, deadline: Optional[float] = None,
                idempotent: bool = True) -> dict[str, Any]:
        """Send ``body`` as JSON and return the JSON answer.

        Args:
            method: "GET" or "POST".
            path: the endpoint, e.g. "/generate".
            body: the JSON body (POST).
            deadline: ``time.monotonic()`` value to give up at; default :meth:`deadline`.
            idempotent: whether the request may run twice (retried after a lost answer); False for the weight-sync
                calls, which are retried only when they were not delivered or refused as busy.

        Raises:
            RolloutServerError: the server answered with an error status (its message is included), or gave no
                answer before the deadline (the URL, the endpoint, ``engine.server_timeout`` and the last error
                are named), or a non-idempotent request was lost.
        """
        deadline = self.deadline() if deadline is None else deadline
        data = None if body is None else json.dumps(body).encode()
        delay, last = 0.1, "none"
        while True:
            if deadline - time.monotonic() <= 0:
                raise self._late(method, path, last)
            try:
                status, raw = self._exchange(method, path, data, deadline)
            except _NotDelivered as err:
                last = str(err)
            except _Expired as err:
                raise self._late(method, path, str(err)) from None
            except _Lost as err:
                last = str(err)
                if not idempotent:
                    raise RolloutServerError(f"rollout server {self.url}: {method} {path} failed: {last}; not "
                                             "retried (it may have been half done)") from None
            else:
                if status < 300:
                    return json.loads(raw)
                message = _error_message(raw)
                if status != 503:
                    raise RolloutServerError(
                        f"rollout server {self.url} answered {method} {path} with HTTP {status}: {message}")
                last = f"HTTP 503: {message}"
            time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
            delay = min(2 * delay, 2.0)

    def _late(self, method: str, path: str, last: str) -> RolloutServerError:
        return RolloutServerError(
            f"rollout server {self.url} did not answer {method} {path} within engine.server_timeout="
            f"{self.timeout_s:g} s (last error: {last}); is it running and reachable?")

    def _exchange(self, method: str, path: str, data: Optional[bytes], deadline: float) -> tuple[int, bytes]:
        """One request on a new connection, cut at ``deadline`` by a :class:`_Watchdog`: ``(status, body)``."""
        remaining = deadline - time.monotonic()
        kind = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        # The watchdog cuts at the deadline; the socket's own timeout is a backstop a second later (a loaded machine
        # can wake the watchdog late: a read that times out past the deadline is still the deadline's cut).
        conn = kind(self.host, self.port, timeout=max(remaining, 1e-3) + 1.0)
        watchdog = _Watchdog(conn, remaining)
        try:
            try:
                conn.connect()
                watchdog.hold()
            except (OSError, http.client.HTTPException) as err:
                if watchdog.expired.is_set() or time.monotonic() >= deadline:
                    raise _Expired(f"connect: {_describe(err)}") from None
                raise _NotDelivered(_describe(err)) from None
            try:
                conn.request(method, path, body=data, headers=self._headers)
                response = conn.getresponse()
                body = response.read()
            except (OSError, http.client.HTTPException) as err:
                if watchdog.expired.is_set() or time.monotonic() >= deadline:
                    raise _Expired(f"the answer was cut at the deadline ({_describe(err)})") from None
                raise _Lost(_describe(err)) from None
            if watchdog.expired.is_set():
                raise _Expired(f"the answer was cut at the deadline ({len(body)} bytes of the body read)")
            return response.status, body
        finally:
            watchdog.close()


class _Watchdog:
    """Shuts the socket of ``conn`` down ``seconds`` from now, which wakes a blocked read or write at once.

    It keeps its own reference to the socket (:meth:`hold`, after the connect): ``http.client`` drops the
    connection's as soon as it has read the headers of an answer that ends with the connection (HTTP/1.0,
    ``Connection: close``), whose body is then read until the server closes; a body read to its end after the cut
    is such a body cut short, so the caller checks :attr:`expired` after the read too."""

    def __init__(self, conn: http.client.HTTPConnection, seconds: float) -> None:
        self.conn, self.expired = conn, threading.Event()
        self._sock: Optional[socket.socket] = None
        self._lock = threading.Lock()
        self._timer = threading.Timer(max(seconds, 0.0), self._cut)
        self._timer.daemon = True
        self._timer.start()

    def hold(self) -> None:
        """Keep the connected socket; raises OSError when the deadline passed while connecting."""
        with self._lock:
            self._sock = self.conn.sock
            if self.expired.is_set():
                raise OSError("the deadline passed while connecting")

    def _cut(self) -> None:
        with self._lock:
            self.expired.set()
            for sock in {id(s): s for s in (self._sock, self.conn.sock) if s is not None}.values():
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        """Stop the timer and close the connection and the socket."""
        self._timer.cancel()
        self.conn.close()
        if self._sock is not None:
            self._sock.close()


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"


def _error_message(raw: bytes) -> str:
    """The ``error`` field of a JSON error answer, else the raw text (shortened)."""
    try:
        answer = json.loads(raw)
        return str(answer.get("error", answer)) if isinstance(answer, dict) else str(answer)
    except ValueError:
        return raw.decode(errors="replace")[:500]
