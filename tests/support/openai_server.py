"""vLLM's own OpenAI-compatible server (``python -m vllm.entrypoints.openai.api_server``, what ``vllm serve`` runs)
in a subprocess on 127.0.0.1, for the tests of what talks to any OpenAI-compatible server (LLM judges, served
teachers)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import httpx

from support.dist import free_port


@contextlib.contextmanager
def vllm_openai_server(model: str, served_name: str, log: Path, *args: str) -> Iterator[str]:
    """Start the server for ``model`` (named ``served_name``; ``args``: more server options), wait until its
    ``/health`` answers (10 min at most; its log ``log`` in the error if it exits or does not start), yield its
    ``.../v1`` base URL, and stop its process group (SIGTERM, SIGKILL after 60 s)."""
    port = free_port()
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # whole GiB only: the size is the option below
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                                 "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
                                 "--kv-cache-memory-bytes", str(2**28),  # 0.25 GiB on CPU
                                 # no torch.compile tracing (~20 s of a start's ~50 s on one core): the tests' subject
                                 # is the OpenAI API, and the package's own CPU engines run eager too
                                 "--enforce-eager",
                                 *args], stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, f"vLLM's server exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"vLLM's server did not start: {log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(2)
        yield f"{url}/v1"
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
