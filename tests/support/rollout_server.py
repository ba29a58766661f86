"""A rollout server (``python -m lightning_grpo.cli serve``, real vLLM) in a subprocess, for the tests that need one
(``tests/rollout/server/test_vllm_server.py``, ``tests/strategies/test_megatron_engines.py``)."""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from lightning_grpo.rollout.server.client import RolloutServerError, ServerClient
from lightning_grpo.rollout.server.security import SECRET_ENV
from support.dist import free_port
from support.lanes import require_engine_lane

REPO = Path(__file__).resolve().parents[2]


class Server:
    """``python -m lightning_grpo.cli serve`` on a free port, its output in ``log``."""

    def __init__(self, model: str, log: Path, *options: str) -> None:
        require_engine_lane("starts a rollout server")
        self.model, self.log, self.port, self.options = model, log, free_port(), list(options)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self) -> dict:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        command = [sys.executable, "-m", "lightning_grpo.cli", "serve", "--model", self.model, "--host", "127.0.0.1",
                   "--port", str(self.port), "--kv-cache-space-gib", "0.25", "--max-model-len", "512", *self.options]
        self.proc = subprocess.Popen(command, cwd=str(REPO), env=env, stdout=open(self.log, "a"),
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.log.read_text()[-6000:]}")
            try:
                return self.client(2).request("GET", "/health", idempotent=False)
            except RolloutServerError:
                time.sleep(0.5)
        raise AssertionError(f"the server did not start within 300 s:\n{self.log.read_text()[-6000:]}")

    def client(self, timeout_s: float = 60) -> ServerClient:
        return ServerClient(self.url, timeout_s, os.environ.get(SECRET_ENV))

    def health(self) -> dict:
        return self.client(30).request("GET", "/health")

    def probe(self, sequences) -> torch.Tensor:
        answer = self.client(60).request("POST", "/probe_logprobs", {"sequences": sequences})
        return torch.tensor(answer["logprobs"])

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def thaw(self) -> None:
        """SIGCONT, after a test froze the server (SIGSTOP: ``support.streaming_worker.holds_frozen_group``); a no-op
        on a running or ended server."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.thaw()  # a frozen process would hold SIGTERM until SIGCONT
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()


def raw_request(url: str, method: str, path: str, body: bytes = b"", headers: dict | None = None,
                timeout: float = 10.0) -> tuple[int, str]:
    """One HTTP request to ``url`` (``http://host:port``) with exactly these headers: ``(status, body)``."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    conn.putrequest(method, path, skip_accept_encoding=True)
    for key, value in (headers or {}).items():
        conn.putheader(key, value)
    conn.endheaders()
    if body:
        conn.send(body)
    try:
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()
