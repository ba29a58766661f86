"""The rollout server: vLLM's own engine in a process of its own, answering the trainer over HTTP.

    lightning-grpo serve --model PATH --port 8000 [--host 0.0.0.0] [--kv-cache-space-gib 2] [--max-model-len N]
                         [--seed 0] [--dtype float32] [--gpu-memory-utilization 0.9] [--tensor-parallel-size 1]

The engine is the colocated engine's (:class:`~lightning_grpo.rollout.engines.vllm.VLLMRolloutEngine`, same sampling
parameters, same processed sampler logprobs, same per-request seeds) with the worker extension
:class:`~lightning_grpo.rollout.server.vllm_extension.WeightSyncWorkerExtension`, through which the trainer streams its
weights over a ``torch.distributed`` group (:mod:`lightning_grpo.rollout.server.weight_sync`). The trainer's side is
:class:`~lightning_grpo.rollout.engines.remote.VLLMServerEngine` (``engine.name="vllm_server"``).

Endpoints (JSON bodies and answers; an error answers 400 for bad input, 500 otherwise, ``{"error": message}``):

* ``GET /health``: ``instance_id`` (new at every start: the trainer notices a restart), ``version`` (of the
  weights: 0 = the checkpoint, then what the last ``/update_weights`` set), ``eos_token_ids``, ``pad_token_id``,
  ``max_model_len``, ``tie_word_embeddings``, ``world_size`` (the engine's workers), ``device``, ``model``.
* ``POST /generate``: ``prompts`` (token-id lists), ``num_generations``, ``sampling`` (the fields of
  :class:`~lightning_grpo.rollout.base.SamplingConfig` but ``seed``), ``seeds`` (one per prompt, or null) ->
  ``token_ids`` and ``logprobs`` (one list per completion, prompt-major, unpadded), ``version``, ``instance_id``.
* ``POST /probe_logprobs``: ``sequences`` -> ``logprobs`` (teacher-forced, temperature 1, ``L - 1`` per
  sequence), ``version``, ``instance_id``.
* ``POST /init_weight_sync``: ``host``, ``port``, ``prefix``, ``world_size``, ``backend``, ``timeout_s``: the
  workers join the trainer's group (the trainer joins at the same time).
* ``POST /update_weights``: ``version``: the workers receive the streamed weights and load them; the prefix
  cache is dropped; answers ``num_tensors`` and the new ``version``.
* ``POST /close_weight_sync``: the workers leave the group.

Requests are served one at a time on the engine (a lock); ``/health`` never waits for it.
"""

from __future__ import annotations

import argparse
import json
import signal
import threading
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional, Sequence

from lightning_grpo.rollout.base import SamplingConfig
from lightning_grpo.rollout.engines.rows import check_prompts
from lightning_grpo.rollout.engines.vllm import VLLMRolloutEngine

WORKER_EXTENSION = "lightning_grpo.rollout.server.vllm_extension.WeightSyncWorkerExtension"


class RolloutServer:
    """The engine and the state behind the endpoints (``instance_id``, ``version``), without the HTTP layer.

    Args:
        model: folder of the HF checkpoint (weights, config, tokenizer) the engine starts from.
        kv_cache_space_gib, max_model_len, seed, dtype, gpu_memory_utilization: as
            :class:`~lightning_grpo.rollout.engines.vllm.VLLMRolloutEngine`.
        tensor_parallel_size: vLLM workers per instance (GPU); each joins the weight-sync group.
    """

    def __init__(self, model: str, *, kv_cache_space_gib: float = 2, max_model_len: Optional[int] = None,
                 seed: int = 0, dtype: Optional[str] = None, gpu_memory_utilization: float = 0.9,
                 tensor_parallel_size: int = 1) -> None:
        self.model = model
        self.engine = VLLMRolloutEngine(model, kv_cache_space_gib=kv_cache_space_gib, max_model_len=max_model_len,
                                        seed=seed, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                                        worker_extension_cls=WORKER_EXTENSION,
                                        tensor_parallel_size=tensor_parallel_size)
        self.world_size = int(self.engine.llm.llm_engine.vllm_config.parallel_config.world_size)
        self.instance_id = uuid.uuid4().hex
        self.version = 0
        self.lock = threading.Lock()

    def health(self, body: Optional[dict] = None) -> dict:
        engine = self.engine
        return dict(instance_id=self.instance_id, version=self.version, model=self.model,
                    eos_token_ids=list(engine.eos_token_ids), pad_token_id=engine.pad_token_id,
                    max_model_len=engine.max_model_len, tie_word_embeddings=engine.tie_word_embeddings,
                    world_size=self.world_size, device="cpu" if engine.on_cpu else "cuda")

    def generate(self, body: dict) -> dict:
        sampling = SamplingConfig(**{k: v for k, v in body["sampling"].items() if k != "seed"})
        num_generations = int(body["num_generations"])
        prompts = check_prompts(body["prompts"], num_generations, sampling, self.engine.max_model_len)
        seeds = body.get("seeds")
        with self.lock:
            rows = self.engine.generate_rows(prompts, num_generations, sampling, seeds)
            version = self.version
        return dict(token_ids=[ids for ids, _ in rows], logprobs=[lp for _, lp in rows], version=version,
                    instance_id=self.instance_id)

    def probe_logprobs(self, body: dict) -> dict:
        with self.lock:
            logprobs = self.engine.teacher_forced_logprobs(body["sequences"])
            version = self.version
        return dict(logprobs=logprobs, version=version, instance_id=self.instance_id)

    def init_weight_sync(self, body: dict) -> dict:
        if int(body["world_size"]) != 1 + self.world_size:
            raise ValueError(f"world_size={body['world_size']}: this instance has {self.world_size} workers, so "
                             f"its group has {1 + self.world_size} ranks")
        kwargs = {k: body[k] for k in ("host", "port", "prefix", "world_size", "backend", "timeout_s")}
        with self.lock:
            ranks = self.engine.llm.collective_rpc("init_weight_sync", kwargs=kwargs)
        return dict(ranks=ranks, instance_id=self.instance_id)

    def update_weights(self, body: dict) -> dict:
        version = int(body["version"])
        with self.lock:
            counts = self.engine.llm.collective_rpc("receive_weights")
            self.engine.llm.reset_prefix_cache()
            self.version = version
        return dict(version=version, num_tensors=int(counts[0]), instance_id=self.instance_id)

    def close_weight_sync(self, body: Optional[dict] = None) -> dict:
        with self.lock:
            self.engine.llm.collective_rpc("close_weight_sync")
        return dict(instance_id=self.instance_id)

    def routes(self) -> dict[tuple[str, str], Callable[[dict], dict]]:
        return {("GET", "/health"): self.health, ("POST", "/generate"): self.generate,
                ("POST", "/probe_logprobs"): self.probe_logprobs, ("POST", "/init_weight_sync"): self.init_weight_sync,
                ("POST", "/update_weights"): self.update_weights,
                ("POST", "/close_weight_sync"): self.close_weight_sync}

    def close(self) -> None:
        self.engine.close()


def http_server(server: RolloutServer, host: str, port: int) -> ThreadingHTTPServer:
    """A threaded HTTP server (bound, not yet serving) that answers ``server``'s routes with JSON."""
    routes = server.routes()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self, method: str) -> None:
            handler = routes.get((method, self.path))
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            if handler is None:
                code, answer = 404, {"error": f"LookupError: no endpoint {method} {self.path}"}
            else:
                try:
                    code, answer = 200, handler(json.loads(raw or b"{}"))
                except (ValueError, KeyError, TypeError) as err:  # bad input
                    code, answer = 400, {"error": f"{type(err).__name__}: {err}"}
                except Exception as err:  # noqa: BLE001 - every failure goes back to the trainer with its message
                    code, answer = 500, {"error": f"{type(err).__name__}: {err}"}
            data = json.dumps(answer).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._answer("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._answer("POST")

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: the trainer logs
            pass

    httpd = ThreadingHTTPServer((host, port), Handler)
    httpd.daemon_threads = True
    return httpd


def serve_main(argv: Sequence[str]) -> None:
    """``lightning-grpo serve``: start the engine, then answer until SIGTERM / SIGINT."""
    parser = argparse.ArgumentParser(prog="lightning-grpo serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="HF checkpoint folder (the trainer's starting weights)")
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on (default: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    parser.add_argument("--kv-cache-space-gib", type=float, default=2, help="CPU: KV-cache GiB, > 0 (default 2)")
    parser.add_argument("--max-model-len", type=int, default=None, help="most prompt + completion tokens")
    parser.add_argument("--seed", type=int, default=0, help="the engine's seed (default 0)")
    parser.add_argument("--dtype", default=None, help="float32 / bfloat16 / auto (default: float32 on CPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="GPU: memory fraction")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPU: workers per instance")
    args = parser.parse_args(list(argv))
    server = RolloutServer(args.model, kv_cache_space_gib=args.kv_cache_space_gib, max_model_len=args.max_model_len,
                           seed=args.seed, dtype=args.dtype, gpu_memory_utilization=args.gpu_memory_utilization,
                           tensor_parallel_size=args.tensor_parallel_size)
    httpd = http_server(server, args.host, args.port)

    def stop(*_: Any) -> None:
        threading.Thread(target=httpd.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    print(f"lightning-grpo serve: ready on http://{args.host}:{args.port} (instance {server.instance_id})",
          flush=True)
    try:
        httpd.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        httpd.server_close()
        server.close()


if __name__ == "__main__":
    import sys

    serve_main(sys.argv[1:])
