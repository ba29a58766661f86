"""JSON over HTTP to one rollout server (:mod:`lightning_grpo.rollout.server.app`), with retries and a deadline.

A request that cannot reach the server (connection refused or reset, no answer) is retried with exponential
backoff (0.1 s doubling to 2 s) until its deadline; every socket wait is bounded by the time left, so a server that
accepts and never answers costs at most the deadline. An answer with an HTTP error status is the server's own
error and is raised at once. Standard library only (``urllib``).
"""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from typing import Any, Optional


class RolloutServerError(RuntimeError):
    """A rollout server answered with an error, did not answer in time, or lost its weight-sync group."""


class ServerClient:
    """Requests to the server at ``url`` (``http://host:port``).

    Args:
        url: the server's base URL.
        timeout_s: the default deadline of a request, in seconds from its start (``engine.server_timeout``).

    Raises:
        ValueError: ``url`` not ``http(s)://...`` or ``timeout_s <= 0``.
    """

    def __init__(self, url: str, timeout_s: float) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"rollout server url {url!r} must start with http:// or https://")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
        self.url = url.rstrip("/")
        self.timeout_s = float(timeout_s)

    def deadline(self) -> float:
        """``time.monotonic()`` value at which a request started now gives up."""
        return time.monotonic() + self.timeout_s

    def request(self, method: str, path: str, body: Optional[dict] = None, deadline: Optional[float] = None,
                retry: bool = True) -> dict[str, Any]:
        """Send ``body`` as JSON and return the JSON answer.

        Args:
            method: "GET" or "POST".
            path: the endpoint, e.g. "/generate".
            body: the JSON body (POST).
            deadline: ``time.monotonic()`` value to give up at; default :meth:`deadline`.
            retry: retry when the server cannot be reached (False for requests that must not run twice).

        Raises:
            RolloutServerError: the server answered with an error status (its message is included), or gave no
                answer before the deadline (the URL, the endpoint, ``engine.server_timeout`` and the last error
                are named).
        """
        deadline = self.deadline() if deadline is None else deadline
        data = None if body is None else json.dumps(body).encode()
        delay, last = 0.1, "none"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RolloutServerError(
                    f"rollout server {self.url} did not answer {method} {path} within engine.server_timeout="
                    f"{self.timeout_s:g} s (last error: {last}); is it running and reachable?")
            request = urllib.request.Request(self.url + path, data=data, method=method,
                                             headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=remaining) as answer:
                    return json.loads(answer.read())
            except urllib.error.HTTPError as err:
                try:
                    message = json.loads(err.read()).get("error", "")
                except (ValueError, OSError):
                    message = str(err)
                raise RolloutServerError(
                    f"rollout server {self.url} answered {method} {path} with HTTP {err.code}: {message}") from err
            except (urllib.error.URLError, http.client.HTTPException, ConnectionError, socket.timeout,
                    TimeoutError, OSError) as err:
                last = f"{type(err).__name__}: {getattr(err, 'reason', err)}"
                if not retry:
                    raise RolloutServerError(f"rollout server {self.url}: {method} {path} failed: {last}") from err
            time.sleep(max(0.0, min(delay, deadline - time.monotonic())))
            delay = min(2 * delay, 2.0)
