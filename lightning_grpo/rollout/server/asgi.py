"""The rollout server's HTTP layer: a FastAPI app (served by uvicorn, :func:`lightning_grpo.rollout.server.app.serve`)
over the endpoints of a :class:`~lightning_grpo.rollout.server.app.RolloutServer`.

What it guarantees, whatever the client sends:

* **Secret**: with a shared secret, a request without ``Authorization: Bearer <secret>`` gets 401 on every path
  (unknown ones included) before its body is read (:class:`RequireSecret`).
* **Body limits**: a ``Content-Length`` over the limit is 413 before the body is read, and a body that grows past
  it while streaming (chunked) is cut with 413; a body that stalls for ``read_timeout_s`` is 408
  (:class:`LimitBody`). A malformed ``Content-Length`` (``abc``, ``-1``) is refused by uvicorn's HTTP parser with
  400.
* **Bad input**: JSON that does not parse, a missing, unknown or mistyped field, or a value out of range is 400 with
  ``{"error": "<field>: <problem>"}``; vLLM's own request errors (``VLLMClientError``) are 400 too; anything else
  is 500 with the exception's message. Unknown path 404, wrong method 405.
* **Queueing**: at most ``max_queued`` requests wait or run; one more is refused with 503 and ``Retry-After`` (the
  client retries it) rather than held or reset. A synchronous engine (``batching=False``) runs one request at a
  time on one worker thread, in arrival order (FIFO); a batching engine (``batching=True``: the server's
  ``AsyncLLM``) gets up to ``max_queued`` generate and probe requests at once, which join its running batch, while
  the weight-sync calls run one at a time, in arrival order, on a thread of their own (beside the generations, so
  an in-flight update is never queued behind them, and each under its own ``max_queued`` bound). ``/health``
  never waits for the engine.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from typing import Any, Awaitable, Callable, Optional, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from lightning_grpo.rollout.server.schema import (
    Empty,
    GenerateRequest,
    InitWeightSyncRequest,
    ProbeRequest,
    UpdateMode,
    UpdateWeightsRequest,
)
from lightning_grpo.rollout.server.security import authorized

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


class Endpoints(Protocol):
    """What the app calls (:class:`~lightning_grpo.rollout.server.app.RolloutServer`). ``prepare_*`` check a request
    without the engine (cheap, raise ``ValueError`` for bad input) and return the arguments of the engine call that
    follows on the engine's thread."""

    def health(self) -> dict: ...

    def prepare_generate(self, request: GenerateRequest) -> tuple: ...

    def generate(self, *args: Any) -> dict: ...

    def prepare_probe(self, request: ProbeRequest) -> tuple: ...

    def probe_logprobs(self, *args: Any) -> dict: ...

    def prepare_init_weight_sync(self, request: InitWeightSyncRequest) -> tuple: ...

    def init_weight_sync(self, *args: Any) -> dict: ...

    def update_weights(self, version: int, mode: UpdateMode) -> dict: ...

    def close_weight_sync(self) -> dict: ...


class ServerBusy(Exception):
    """The engine's queue is full (answered 503)."""


class EngineQueue:
    """Engine calls on ``workers`` threads (1: one at a time, in arrival order); at most ``max_queued`` calls waiting
    or running. Used from the event loop's thread only (the counter needs no lock)."""

    def __init__(self, max_queued: int, workers: int = 1) -> None:
        if max_queued < 1:
            raise ValueError(f"--max-queued-requests must be >= 1, got {max_queued}")
        self.max_queued = max_queued
        self.pending = 0
        self.executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="rollout-engine")

    async def run(self, fn: Callable[..., dict], *args: Any) -> dict:
        """``fn(*args)`` on the engine's thread, after the calls queued before it.

        Raises:
            ServerBusy: ``max_queued`` calls are already waiting or running.
        """
        if self.pending >= self.max_queued:
            raise ServerBusy(f"the engine's queue is full ({self.max_queued} requests waiting or running; "
                             "--max-queued-requests): retry later")
        self.pending += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        finally:
            self.pending -= 1

    def close(self) -> None:
        self.executor.shutdown(wait=True, cancel_futures=True)


def json_response(content: Any, status: int = 200, headers: Optional[dict[str, str]] = None) -> Response:
    """JSON with the standard library's encoder (FastAPI's ``jsonable_encoder`` walks every element of the token
    lists in Python, slowly)."""
    return Response(json.dumps(content).encode(), status_code=status, media_type="application/json",
                    headers=headers)


async def _send_error(send: Callable[[dict], Awaitable[None]], status: int, message: str,
                      headers: Optional[dict[str, str]] = None) -> None:
    body = json.dumps({"error": message}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
           (b"connection", b"close")]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class RequireSecret:
    """ASGI middleware: 401 for an HTTP request without the shared secret (before its body is read)."""

    def __init__(self, app: ASGIApp, secret: Optional[str]) -> None:
        self.app, self.secret = app, secret

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and self.secret is not None:
            header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
            if not authorized(header, self.secret):
                await _send_error(send, 401, "the shared secret is missing or wrong: send 'Authorization: Bearer "
                                  "<secret>' (LIGHTNING_GRPO_SERVER_SECRET)", {"WWW-Authenticate": "Bearer"})
                return
        await self.app(scope, receive, send)


class _BodyProblem(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class LimitBody:
    """ASGI middleware: at most ``max_bytes`` of request body (413 beyond), each part of it within
    ``read_timeout_s`` seconds (408 otherwise)."""

    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout_s: float) -> None:
        self.app, self.max_bytes, self.read_timeout_s = app, max_bytes, read_timeout_s

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _send_error(send, 413, f"the request body has Content-Length {int(length)} bytes, over this "
                              f"server's limit of {self.max_bytes} (--max-body-mib)")
            return
        try:
            body = await self._read_body(receive)
        except _BodyProblem as problem:
            await _send_error(send, problem.status, problem.message)
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect

        await self.app(scope, replay, send)

    async def _read_body(self, receive: Callable) -> bytes:
        """The whole body (streamed or not), checked against the limits before the app sees any of it."""
        parts, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout_s)
            except asyncio.TimeoutError:
                raise _BodyProblem(408, f"the request body stalled for {self.read_timeout_s:g} s") from None
            if message["type"] != "http.request":  # the client went away
                raise _BodyProblem(400, "the client disconnected before sending the whole body")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                raise _BodyProblem(413, f"the request body is over this server's limit of {self.max_bytes} bytes "
                                   "(--max-body-mib)")
            parts.append(chunk)
            if not message.get("more_body", False):
                return b"".join(parts)


def _field_errors(err: RequestValidationError) -> str:
    """pydantic's errors as ``body.sampling.top_p: Input should be a valid number (got 'x')``, joined by ``; ``."""
    parts = []
    for e in err.errors()[:10]:
        where = ".".join(str(x) for x in e.get("loc", ())) or "body"
        got = f" (got {e['input']!r})" if "input" in e and e.get("type") != "missing" else ""
        parts.append(f"{where}: {e.get('msg', 'invalid')}{got}"[:300])
    return "; ".join(parts)


def create_app(server: Endpoints, *, secret: Optional[str], max_body_bytes: int, max_queued: int,
               read_timeout_s: float = 60.0, client_errors: tuple[type[BaseException], ...] = (),
               batching: bool = False) -> FastAPI:
    """The FastAPI app of ``server``'s endpoints (see the module docstring for what it guarantees).

    Args:
        server: the endpoints (:class:`~lightning_grpo.rollout.server.app.RolloutServer`).
        secret: the shared secret every request must carry, or None (loopback only: checked by the caller).
        max_body_bytes: largest request body accepted.
        max_queued: most engine requests waiting or running; more get 503.
        read_timeout_s: longest pause while a request body is received.
        client_errors: exception types that mean bad input besides ``ValueError``, ``TypeError`` and ``KeyError``
            (the server passes vLLM's ``VLLMClientError``): answered 400.
        batching: whether ``server``'s engine calls may run at once (they join one batch: the server's engine);
            False: one at a time, in arrival order.
    """
    queue = EngineQueue(max_queued, workers=max_queued if batching else 1)
    control = EngineQueue(max_queued) if batching else queue
    app = FastAPI(title="lightning-grpo rollout server", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.queue = queue
    app.state.control = control
    _add_error_handlers(app, client_errors)
    _add_routes(app, server, queue, control)
    app.add_middleware(LimitBody, max_bytes=max_body_bytes, read_timeout_s=read_timeout_s)
    app.add_middleware(RequireSecret, secret=secret)  # added last: runs first
    return app



def _add_error_handlers(app: FastAPI, client_errors: tuple[type[BaseException], ...]) -> None:
    """Every error as ``{"error": message}``: 400 bad input, 404/405, 503 busy, 500 otherwise."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> Response:
        return json_response({"error": f"invalid request: {_field_errors(err)}"}, 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException) -> Response:
        message = f"no endpoint {request.method} {request.url.path}" if err.status_code in (404, 405) else err.detail
        return json_response({"error": message}, err.status_code, getattr(err, "headers", None))

    @app.exception_handler(ServerBusy)
    async def _busy(request: Request, err: ServerBusy) -> Response:
        return json_response({"error": str(err)}, 503, {"Retry-After": "1"})

    async def _bad_input(request: Request, err: Exception) -> Response:
        return json_response({"error": f"{type(err).__name__}: {err}"}, 400)

    for kind in (ValueError, TypeError, KeyError, *client_errors):
        app.add_exception_handler(kind, _bad_input)

    @app.exception_handler(Exception)
    async def _failed(request: Request, err: Exception) -> Response:
        return json_response({"error": f"{type(err).__name__}: {err}"}, 500)


def _add_routes(app: FastAPI, server: Endpoints, queue: EngineQueue, control: EngineQueue) -> None:
    """The endpoints: ``/health`` on the event loop, the others checked there and run on the engine's queue
    (generation, probes) or the weight-sync calls' (``control``)."""

    @app.get("/health")
    async def health() -> Response:
        return json_response(server.health())

    @app.post("/generate")
    async def generate(request: GenerateRequest) -> Response:
        return json_response(await queue.run(server.generate, *server.prepare_generate(request)))

    @app.post("/probe_logprobs")
    async def probe_logprobs(request: ProbeRequest) -> Response:
        return json_response(await queue.run(server.probe_logprobs, *server.prepare_probe(request)))

    @app.post("/init_weight_sync")
    async def init_weight_sync(request: InitWeightSyncRequest) -> Response:
        return json_response(await control.run(server.init_weight_sync, *server.prepare_init_weight_sync(request)))

    @app.post("/update_weights")
    async def update_weights(request: UpdateWeightsRequest) -> Response:
        return json_response(await control.run(server.update_weights, request.version, request.mode))

    @app.post("/close_weight_sync")
    async def close_weight_sync(request: Optional[Empty] = None) -> Response:
        return json_response(await control.run(server.close_weight_sync))
