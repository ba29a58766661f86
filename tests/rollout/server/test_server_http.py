"""The rollout server's HTTP layer and client, without vLLM: the real FastAPI app on uvicorn (in a thread, on
127.0.0.1) over recording endpoints, and the real client.

* the shared secret: every path answers 401 without it (or with a wrong one) and no endpoint runs;
* bad input: malformed ``Content-Length`` (``abc``, ``-1``), a huge one (10^12), a body over the limit, JSON that
  does not parse, unknown and mistyped fields: each a 4xx naming the problem, and the server keeps serving;
* fair queueing: 20 concurrent requests are all answered 200 or refused 503 (none reset), the engine runs them one
  at a time in arrival order, and the client retries a 503 until it is served;
* deadlines: a server that trickles its answer a byte at a time is cut at the client's timeout, whatever
  the kind of answer (a length, chunked, HTTP/1.0, ``Connection: close``);
* URLs and the secret are checked when the client is made; a non-loopback bind without a secret is refused.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import uvicorn

from lightning_grpo.config import EngineConfig
from lightning_grpo.rollout.server.app import listen
from lightning_grpo.rollout.server.asgi import create_app
from lightning_grpo.rollout.server.client import RolloutServerError, ServerClient
from lightning_grpo.rollout.server.security import SECRET_ENV, check_bind, is_loopback, read_secret
from lightning_grpo.rollout.server.weight_sync import host_store
from support.dist import free_port
from support.rollout_server import raw_request

SECRET = "0123456789abcdef0123456789abcdef"
REPO = Path(__file__).resolve().parents[3]
GENERATE = {"prompts": [[1, 2], [3]], "num_generations": 2, "sampling": {"max_new_tokens": 4}}
ENDPOINTS = [("GET", "/health", None), ("POST", "/generate", GENERATE), ("POST", "/probe_logprobs",
             {"sequences": [[1, 2]]}), ("POST", "/init_weight_sync", {"host": "127.0.0.1", "port": 1, "prefix": "p",
             "world_size": 2, "backend": "gloo", "timeout_s": 1.0}), ("POST", "/update_weights", {"version": 7}),
             ("POST", "/close_weight_sync", {}), ("GET", "/nothing", None)]


class Recorder:
    """Endpoints that record every call (the engine's thread sleeps ``delay`` s per generate)."""

    def __init__(self, delay: float = 0.0) -> None:
        self.calls: list[tuple] = []
        self.delay = delay
        self.version = 0
        self.running = 0
        self.most_running = 0

    def health(self):
        self.calls.append(("health",))
        return {"version": self.version}

    def prepare_generate(self, request):
        return (request.prompts, request.num_generations)

    def generate(self, prompts, num_generations):
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        time.sleep(self.delay)
        self.calls.append(("generate", prompts[0][0]))
        self.running -= 1
        return {"token_ids": [p for p in prompts for _ in range(num_generations)]}

    def prepare_probe(self, request):
        return (request.sequences,)

    def probe_logprobs(self, sequences):
        self.calls.append(("probe",))
        return {"logprobs": [[0.0] * (len(s) - 1) for s in sequences]}

    def prepare_init_weight_sync(self, request):
        return (request.model_dump(),)

    def init_weight_sync(self, kwargs):
        self.calls.append(("init", kwargs))
        return {"ranks": [1]}

    def update_weights(self, version, mode):
        self.calls.append(("update", version, mode))
        self.version = version
        return {"version": version}

    def close_weight_sync(self):
        self.calls.append(("close",))
        return {}


@contextmanager
def serving(endpoints, secret=SECRET, max_body_bytes=4096, max_queued=64):
    """The app on uvicorn on a free 127.0.0.1 port, in a thread; yields the base URL."""
    app = create_app(endpoints, secret=secret, max_body_bytes=max_body_bytes, max_queued=max_queued,
                     read_timeout_s=2.0)
    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="error"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        app.state.queue.close()
        sock.close()


def test_every_endpoint_refuses_a_request_without_the_secret_and_runs_nothing():
    recorder = Recorder()
    with serving(recorder) as url:
        for headers in ({}, {"Authorization": "Bearer wrong-secret-of-some-length"}, {"Authorization": SECRET},
                        {"Authorization": f"Basic {SECRET}"}):
            for method, path, body in ENDPOINTS:
                data = b"" if body is None else json.dumps(body).encode()
                status, text = raw_request(url, method, path, data, {**headers, "Content-Length": str(len(data))})
                assert status == 401, (headers, path, status, text)
                assert "shared secret is missing or wrong" in json.loads(text)["error"]
        assert recorder.calls == []  # nothing ran: no weights, no version, no generation
        client = ServerClient(url, 10, SECRET)
        for method, path, body in ENDPOINTS[:-1]:
            client.request(method, path, body)
        assert [c[0] for c in recorder.calls] == ["health", "generate", "probe", "init", "update", "close"]
        assert ("update", 7, "wait") in recorder.calls  # the default mode: the sequences in flight finish first
        assert client.request("GET", "/health") == {"version": 7}  # the version the authenticated call set
        with pytest.raises(RolloutServerError, match="HTTP 401: the shared secret is missing or wrong"):
            ServerClient(url, 10).request("GET", "/health")


@pytest.mark.parametrize("length, status, message", [
    ("abc", 400, "Invalid HTTP request"),
    ("-1", 400, "Invalid HTTP request"),
    (str(10**12), 413, "Content-Length 1000000000000 bytes, over this server's limit of 4096"),
])
def test_a_malformed_or_huge_content_length_is_a_4xx_and_the_server_keeps_serving(length, status, message):
    with serving(Recorder()) as url:
        got, text = raw_request(url, "POST", "/generate", b"", {"Authorization": f"Bearer {SECRET}",
                                                                 "Content-Length": length})
        assert got == status and message in text
        assert ServerClient(url, 10, SECRET).request("GET", "/health") == {"version": 0}


def test_bad_bodies_are_400_naming_the_field_and_the_server_keeps_serving():
    recorder = Recorder()
    auth = {"Authorization": f"Bearer {SECRET}", "Content-Type": "application/json"}
    cases = [
        (b"{not json", 400, "invalid request: body.1: JSON decode error"),
        (json.dumps({**GENERATE, "prompts": [[1, "a"]]}).encode(), 400,
         "body.prompts.0.1: Input should be a valid integer (got 'a')"),
        (json.dumps({**GENERATE, "prompts": [[1, True]]}).encode(), 400,
         "body.prompts.0.1: Input should be a valid integer (got True)"),
        (json.dumps({**GENERATE, "sampling": {"max_new_tokens": 4, "rank": 8}}).encode(), 400,
         "body.sampling.rank: Extra inputs are not permitted (got 8)"),
        (json.dumps({"prompts": [[1]], "sampling": {"max_new_tokens": 4}}).encode(), 400,
         "body.num_generations: Field required"),
        (json.dumps({"version": -1}).encode(), 400, "body.version: Input should be greater than or equal to 0"),
        (json.dumps({"prompts": [[1] * 2000], "num_generations": 1, "sampling": {"max_new_tokens": 1}}).encode(),
         413, "over this server's limit of 4096 bytes"),
    ]
    with serving(recorder) as url:
        for body, status, message in cases:
            path = "/update_weights" if b"version" in body else "/generate"
            chunked = {**auth, "Transfer-Encoding": "chunked"}
            got, text = raw_request(url, "POST", path, b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body), chunked)
            assert got == status and message in json.loads(text)["error"], (body[:60], got, text)
        assert recorder.calls == []
        answer = ServerClient(url, 10, SECRET).request("POST", "/generate", GENERATE)
        assert answer["token_ids"] == [[1, 2], [1, 2], [3], [3]]


def test_twenty_concurrent_requests_are_served_in_order_or_refused_with_503():
    """20 clients at once, the engine taking 0.1 s per request, 8 allowed in the queue: every request gets an
    answer (200 or 503 with Retry-After), none is reset; the engine never runs two at once."""
    recorder = Recorder(delay=0.1)
    results: list = [None] * 20
    with serving(recorder, max_queued=8) as url:
        def one(i: int) -> None:
            body = json.dumps({**GENERATE, "prompts": [[i]]}).encode()
            try:
                results[i] = raw_request(url, "POST", "/generate", body, {"Authorization": f"Bearer {SECRET}",
                                                                          "Content-Type": "application/json",
                                                                          "Content-Length": str(len(body))})[0]
            except OSError as err:  # a reset or a refused connection
                results[i] = repr(err)

        threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert all(r in (200, 503) for r in results), results
    assert results.count(200) >= 8 and results.count(200) == len([c for c in recorder.calls if c[0] == "generate"])
    assert recorder.most_running == 1


def test_requests_run_in_arrival_order_and_the_client_retries_a_503():
    recorder = Recorder(delay=0.3)
    with serving(recorder, max_queued=1) as url:
        client = ServerClient(url, 30, SECRET)
        first = threading.Thread(target=client.request, args=("POST", "/generate", {**GENERATE, "prompts": [[1]]}))
        first.start()
        time.sleep(0.1)  # the first holds the one place in the queue: the second is refused 503, and retried
        start = time.monotonic()
        answer = client.request("POST", "/generate", {**GENERATE, "prompts": [[2]]})
        first.join(10)
        assert answer["token_ids"] == [[2], [2]] and time.monotonic() - start >= 0.15
    assert [c for c in recorder.calls if c[0] == "generate"] == [("generate", 1), ("generate", 2)]


#: The headers of the answers a trickling server sends: a known length, chunked, and bodies that end with the
#: connection (HTTP/1.0; HTTP/1.1 with ``Connection: close``), after which ``http.client`` drops its socket.
TRICKLED_HEADERS = {
    "content_length": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n",
    "chunked": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n",
    "http_1_0": b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n",
    "connection_close": b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n",
}


@pytest.fixture
def trickling_server(request):
    """Answers every request with headers and then one body byte every 0.2 s (a chunk of one byte when chunked),
    for 12 s (slow but steady), then closes."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    stop = threading.Event()
    headers = TRICKLED_HEADERS[request.param]
    byte = b"1\r\n \r\n" if request.param == "chunked" else b" "

    def serve(conn: socket.socket) -> None:
        try:
            conn.recv(65536)
            conn.sendall(headers)
            end = time.monotonic() + 12
            while not stop.is_set() and time.monotonic() < end:
                conn.sendall(byte)
                time.sleep(0.2)
        except OSError:
            pass
        finally:
            conn.close()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join(2)
    listener.close()


@pytest.mark.parametrize("trickling_server, idempotent", [
    ("content_length", True), ("content_length", False), ("chunked", True), ("http_1_0", True),
    ("connection_close", False),
], indirect=["trickling_server"])
def test_a_slowly_trickling_server_is_cut_at_the_timeout(trickling_server, idempotent):
    """Whatever kind of answer trickles (a known length, chunked, or a body read until the server closes), the
    request ends at its 2 s deadline (the answer would take 12 s)."""
    start = time.monotonic()
    with pytest.raises(RolloutServerError, match=rf"{trickling_server} did not answer POST /update_weights within "
                       r"engine.server_timeout=2 s \(last error: the answer was cut at the deadline"):
        ServerClient(trickling_server, 2.0).request("POST", "/update_weights", {"version": 1}, idempotent=idempotent)
    assert 2.0 <= time.monotonic() - start < 3.0


@pytest.mark.parametrize("url, message", [
    ("http://", "'http://' names no host"),
    ("http://:8000", "'http://:8000' names no host"),
    ("http://a:notaport", "'http://a:notaport' has port 'notaport': a port is a number in \\[1, 65535\\]"),
    ("http://a:99999", "'http://a:99999' has port '99999'"),
    ("http://a:0", "'http://a:0' has port 0"),
    ("localhost:8000", "'localhost:8000' must start with http:// or https://"),
    ("http://a:8000/v1", "'http://a:8000/v1' has a path, query or fragment"),
])
def test_malformed_urls_are_errors_naming_the_field(url, message):
    with pytest.raises(ValueError, match=rf"engine.server_urls.*{message}"):
        EngineConfig(name="vllm_server", server_urls=[url])
    start = time.monotonic()
    with pytest.raises(ValueError, match=rf"engine.server_urls: rollout server url {message}"):
        ServerClient(url, 600)
    assert time.monotonic() - start < 1  # not 600 s of retries


def test_a_group_port_in_use_is_an_error_naming_the_field():
    port = free_port()
    store = host_store("127.0.0.1", port, timeout_s=5)
    with pytest.raises(ValueError, match=rf"engine.server_group_port={port} is in use on 127.0.0.1"):
        host_store("127.0.0.1", port, timeout_s=5)
    del store


def test_the_store_listens_on_the_chosen_address_only():
    port = free_port()
    store = host_store("127.0.0.1", port, timeout_s=5)
    listening = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout.split()
    assert f"127.0.0.1:{port}" in listening and f"0.0.0.0:{port}" not in listening and f"*:{port}" not in listening
    del store


def test_the_secret_is_read_from_the_environment_or_a_file(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    assert read_secret(None, "--secret-file") is None
    monkeypatch.setenv(SECRET_ENV, f" {SECRET} \n")
    assert read_secret(None, "--secret-file") == SECRET
    path = tmp_path / "secret"
    path.write_text("file-secret-0123456789\nignored\n")
    assert read_secret(str(path), "--secret-file") == "file-secret-0123456789"
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ValueError, match=rf"the shared secret in \${SECRET_ENV} has 5 characters; use at least 16"):
        read_secret(None, "--secret-file")
    with pytest.raises(ValueError, match="--secret-file='/nonexistent' cannot be read"):
        read_secret("/nonexistent", "--secret-file")


def test_binding_beyond_loopback_needs_a_secret():
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1") and is_loopback("127.0.0.2")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.2") and not is_loopback("node1")
    check_bind("127.0.0.1", None)
    check_bind("0.0.0.0", SECRET)
    with pytest.raises(ValueError, match=f"--host 0.0.0.0 listens beyond this machine.*{SECRET_ENV}"):
        check_bind("0.0.0.0", None)


@pytest.mark.distributed  # a subprocess
def test_serve_refuses_a_public_bind_without_a_secret_before_loading_anything(tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if k != SECRET_ENV}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-m", "lightning_grpo.cli", "serve", "--model", str(tmp_path), "--host",
                           "0.0.0.0", "--port", str(free_port())], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 2
    assert "--host 0.0.0.0 listens beyond this machine" in proc.stderr and SECRET_ENV in proc.stderr
