"""The agent gateway's HTTP layer: an OpenAI-compatible endpoint per session, for agents that only know
``base_url`` and ``api_key`` (FastAPI on uvicorn, the rollout server's stack:
:mod:`lightning_grpo.rollout.server.asgi`).

    POST /sessions/{session}/v1/chat/completions     the agent's model calls (OpenAI Chat Completions)
    GET  /sessions/{session}/v1/models               the served model's name (what ``client.models.list()`` asks)
    GET  /v1/models                                  the same, with the run's key

What it guarantees, whatever a client sends:

* **Loopback**: it listens on 127.0.0.1 unless told otherwise, and another address is refused without a key.
* **Keys**: every request carries ``Authorization: Bearer <key>`` (what the ``openai`` client sends as ``api_key``),
  checked in constant time before its body is read; a session's key is ``HMAC-SHA256(run key, session)`` (each agent
  gets only its own session's, as AReaL's per-session keys), ``/v1/models`` takes the run's key. Without the right
  key: 401, and nothing changes.
* **Sessions**: an unknown (or finished) session is 404.
* **Limits**: bodies over ``max_body_bytes`` are 413 (before they are read) and bodies that stall 408
  (:class:`~lightning_grpo.rollout.server.asgi.LimitBody`); more than ``max_concurrent`` requests at once get 429
  with ``Retry-After`` (the ``openai`` client retries them).
* **Bad input**: a missing, unknown or mistyped field is 400 naming it (:mod:`lightning_grpo.episodes.agents.
  openai_schema`); a value the session cannot honour (a ``temperature`` other than the trainer's, a conversation
  over the token budget) is 400 with the reason; errors are OpenAI's shape, ``{"error": {"message", "type",
  "param", "code"}}``.
* **Refusals counted**: every answer with an error status (>= 400) to a request to a session's path that carried its
  key is reported to the backend (:meth:`ChatBackend.refused`; the sessions' ``agent/refused_calls``), whatever
  refused it: the schema, the session, the body or concurrency limit; a 401 is not the session's request and is not.
* **Streaming** (``"stream": true``): the answer is generated whole, then sent as server-sent events: one chunk with
  the whole message (content, reasoning, tool calls) and its ``token_ids`` (the first with ``prompt_token_ids``), one
  with the ``finish_reason``, the usage when asked (``stream_options.include_usage``), ``[DONE]``. So the streamed
  ids are the session's ids (the failure vLLM #27482 reports, streamed tool calls losing token ids, cannot happen);
  it is not token by token.

What a session does with a request (tokenization, the engine call, the answer) is the :class:`ChatBackend`'s
(:class:`lightning_grpo.episodes.agents.agent_sampler.AgentSampler`'s sessions).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import secrets
import socket
import threading
import time
from typing import Any, AsyncIterator, Callable, Optional, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from lightning_grpo.episodes.agents.openai_schema import ChatCompletionRequest, GatewayError
from lightning_grpo.rollout.server.asgi import LimitBody
from lightning_grpo.rollout.server.security import is_loopback


class ChatBackend(Protocol):
    """What the gateway calls: the sessions of the rollout in progress."""

    model_name: str

    def has_session(self, session: str) -> bool:
        """Whether ``session`` is open (else 404)."""
        ...

    async def chat(self, session: str, request: ChatCompletionRequest) -> dict[str, Any]:
        """The answer to one chat-completion request of ``session``: an OpenAI ``chat.completion`` object (with
        ``prompt_token_ids`` and ``choices[0].token_ids``). Raises :class:`GatewayError` for what it refuses."""
        ...

    def refused(self, session: str) -> None:
        """A request to ``session``'s path, with its key, was answered with an error status (>= 400: a body the
        schema refuses, what :meth:`chat` refuses, a body over the limit, too many requests at once, a failure);
        called on the gateway's thread once the status is sent. ``session`` may be unknown (a 404)."""
        ...


def session_key(run_key: str, session: str) -> str:
    """The API key of ``session``: ``HMAC-SHA256(run_key, session)`` in hex."""
    return hmac.new(run_key.encode(), session.encode(), hashlib.sha256).hexdigest()


def _error_body(status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                kind: str = "invalid_request_error") -> bytes:
    error = {"message": message, "type": kind, "param": param, "code": code or str(status)}
    return json.dumps({"error": error}).encode()


def _json(content: Any, status: int = 200, headers: Optional[dict[str, str]] = None) -> Response:
    return Response(json.dumps(content).encode(), status_code=status, media_type="application/json", headers=headers)


class _Guard:
    """ASGI middleware: the key of the path's session (or the run's) before the body is read, then at most
    ``max_concurrent`` requests at once; every answer with an error status to a session's request that carried its
    key is reported to ``refused`` (:meth:`ChatBackend.refused`)."""

    def __init__(self, app: Callable, run_key: str, max_concurrent: int, refused: Callable[[str], None]) -> None:
        self.app, self.run_key, self.max_concurrent, self.active = app, run_key, max_concurrent, 0
        self.refused = refused

    async def _refuse(self, send: Callable, status: int, message: str, headers: list) -> None:
        body = _error_body(status, message, kind="authentication_error" if status == 401 else "rate_limit_error")
        raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": body})

    def _reporting(self, send: Callable, session: str) -> Callable:
        """``send``, reporting an error status of ``session``'s request to :attr:`refused`."""

        async def report(message: dict) -> None:
            if message["type"] == "http.response.start" and int(message["status"]) >= 400:
                self.refused(session)
            await send(message)

        return report

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        parts = scope["path"].split("/")
        session = parts[2] if len(parts) > 2 and parts[1] == "sessions" else None
        expected = self.run_key if session is None else session_key(self.run_key, session)
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), "")
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), expected.encode()):
            await self._refuse(send, 401, "the API key is missing or is not this session's: use the api_key the "
                               "trainer gave the agent", [(b"www-authenticate", b"Bearer")])
            return  # not the session's request: its record is unchanged
        if session is not None:
            send = self._reporting(send, session)
        if self.active >= self.max_concurrent:
            await self._refuse(send, 429, f"too many concurrent requests (the gateway's limit is "
                               f"{self.max_concurrent}): retry later", [(b"retry-after", b"1")])
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1


def _field_errors(err: RequestValidationError) -> tuple[str, Optional[str]]:
    parts, first = [], None
    for e in err.errors()[:10]:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        where = ".".join(loc) or "body"
        first = first or where
        got = f" (got {e['input']!r})" if "input" in e and e.get("type") != "missing" else ""
        parts.append(f"{where}: {e.get('msg', 'invalid')}{got}"[:300])
    return "; ".join(parts), first


def create_gateway_app(backend: ChatBackend, *, run_key: str, max_body_bytes: int, max_concurrent: int,
                       read_timeout_s: float = 60.0) -> Any:
    """The ASGI app of the gateway over ``backend`` (see the module docstring)."""
    app = FastAPI(title="lightning-grpo agent gateway", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> Response:
        message, param = _field_errors(err)
        return Response(_error_body(400, f"invalid request: {message}", param), 400, media_type="application/json")

    @app.exception_handler(GatewayError)
    async def _refused(request: Request, err: GatewayError) -> Response:
        return Response(_error_body(err.status, err.message, err.param, err.code, err.kind), err.status,
                        media_type="application/json")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, err: StarletteHTTPException) -> Response:
        message = f"no endpoint {request.method} {request.url.path}" if err.status_code in (404, 405) else err.detail
        return Response(_error_body(err.status_code, str(message)), err.status_code, media_type="application/json")

    @app.exception_handler(Exception)
    async def _failed(request: Request, err: Exception) -> Response:
        return Response(_error_body(500, f"{type(err).__name__}: {err}", kind="server_error"), 500,
                        media_type="application/json")

    def models() -> Response:
        return _json({"object": "list", "data": [{"id": backend.model_name, "object": "model", "created": 0,
                                                  "owned_by": "lightning-grpo"}]})

    @app.get("/v1/models")
    async def run_models() -> Response:
        return models()

    @app.get("/sessions/{session}/v1/models")
    async def session_models(session: str) -> Response:
        _require(backend, session)
        return models()

    @app.post("/sessions/{session}/v1/chat/completions")
    async def chat(session: str, request: ChatCompletionRequest) -> Response:
        _require(backend, session)
        answer = await backend.chat(session, request)
        if not request.stream:
            return _json(answer)
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        return StreamingResponse(_sse(answer, include_usage), media_type="text/event-stream")

    app.add_middleware(LimitBody, max_bytes=max_body_bytes, read_timeout_s=read_timeout_s)
    return _Guard(app, run_key, max_concurrent, backend.refused)


def _require(backend: ChatBackend, session: str) -> None:
    if not backend.has_session(session):
        raise GatewayError(404, f"no open session {session!r}: it never existed or its episode is over",
                           code="session_not_found", kind="not_found_error")


async def _sse(answer: dict[str, Any], include_usage: bool) -> AsyncIterator[bytes]:
    """A whole answer as ``chat.completion.chunk`` server-sent events (see the module docstring)."""
    choice = answer["choices"][0]
    message = choice["message"]
    delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    if message.get("reasoning_content") is not None:
        delta["reasoning_content"] = message["reasoning_content"]
    if message.get("tool_calls"):
        delta["tool_calls"] = [dict(call, index=i) for i, call in enumerate(message["tool_calls"])]
    head = {k: answer[k] for k in ("id", "created", "model")}
    chunks = [
        {**head, "object": "chat.completion.chunk", "prompt_token_ids": answer.get("prompt_token_ids"),
         "choices": [{"index": 0, "delta": delta, "logprobs": choice.get("logprobs"), "finish_reason": None,
                      "token_ids": choice.get("token_ids")}]},
        {**head, "object": "chat.completion.chunk",
         "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"],
                      "token_ids": []}]},
    ]
    if include_usage:
        chunks.append({**head, "object": "chat.completion.chunk", "choices": [], "usage": answer.get("usage")})
    for chunk in chunks:
        yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
    yield b"data: [DONE]\n\n"


class Gateway:
    """The gateway of one rollout, served by uvicorn on a thread of its own (:meth:`start`, :meth:`close`).

    Args:
        backend: the sessions (:class:`ChatBackend`).
        host: where to listen (default 127.0.0.1: this machine only); another address needs ``allow_remote``.
        port: the port (0: any free one; :attr:`port` says which).
        run_key: the run's key (default: 32 random bytes, new per gateway); session keys derive from it.
        max_body_bytes: the largest request body (default 16 MiB).
        max_concurrent: most requests in progress at once (more get 429).
        allow_remote: allow a non-loopback ``host``.

    Raises:
        ValueError: a non-loopback ``host`` without ``allow_remote``, or a limit below 1.
    """

    def __init__(self, backend: ChatBackend, *, host: str = "127.0.0.1", port: int = 0,
                 run_key: Optional[str] = None, max_body_bytes: int = 16 * 2**20, max_concurrent: int = 256,
                 allow_remote: bool = False) -> None:
        if not is_loopback(host) and not allow_remote:
            raise ValueError(f"the agent gateway's host={host!r} listens beyond this machine: agents reach it on "
                             "127.0.0.1; pass allow_remote=True to serve other machines (every request still needs "
                             "its session's key)")
        if max_body_bytes < 1 or max_concurrent < 1:
            raise ValueError(f"max_body_bytes={max_body_bytes} and max_concurrent={max_concurrent} must be >= 1")
        self.backend, self.host = backend, host
        self.run_key = run_key or secrets.token_hex(32)
        self.app = create_gateway_app(backend, run_key=self.run_key, max_body_bytes=max_body_bytes,
                                      max_concurrent=max_concurrent)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host.strip("[]"), port))
        self._sock.listen(2048)
        self.port = int(self._sock.getsockname()[1])
        self._server: Any = None
        self._thread: Optional[threading.Thread] = None
        self.loop: Optional[asyncio.AbstractEventLoop] = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def base_url(self, session: str) -> str:
        """What an agent's OpenAI client takes as ``base_url``: ``http://127.0.0.1:<port>/sessions/<session>/v1``."""
        return f"{self.url}/sessions/{session}/v1"

    def session_key(self, session: str) -> str:
        """What an agent's OpenAI client takes as ``api_key`` (:func:`session_key`)."""
        return session_key(self.run_key, session)

    def start(self, timeout_s: float = 30.0) -> "Gateway":
        """Serve on a daemon thread; returns once it answers.

        Raises:
            RuntimeError: uvicorn did not start within ``timeout_s``.
        """
        import uvicorn

        config = uvicorn.Config(self.app, log_level="warning", access_log=False, timeout_keep_alive=30,
                                server_header=False, lifespan="off")
        self._server = uvicorn.Server(config)

        def run() -> None:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(self._server.serve(sockets=[self._sock]))

        self._thread = threading.Thread(target=run, name="agent-gateway", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the agent gateway did not start")
            time.sleep(0.005)
        return self

    def close(self) -> None:
        """Stop serving (requests in progress are cut) and release the port. Idempotent."""
        if self._server is not None:
            self._server.should_exit = True
            self._server.force_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self._sock.close()

    def __enter__(self) -> "Gateway":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()
