"""The rollout server: vLLM's engine in a process of its own, answering the trainer over HTTP (FastAPI on uvicorn).

    lightning-grpo serve --model PATH --port 8000 [--host 127.0.0.1] [--secret-file FILE] [--max-model-len N]
                         [--kv-cache-space-gib 2] [--seed 0] [--dtype float32] [--gpu-memory-utilization 0.9]
                         [--tensor-parallel-size 1] [--max-request-tokens N] [--max-queued-requests 64]
                         [--max-body-mib 64] [--record-routing]

The engine is vLLM's ``AsyncLLM`` (:class:`~lightning_grpo.rollout.server.async_engine.AsyncVLLMEngine`): continuous
batching, so concurrent requests join the running batch, sampled as the colocated engine samples
(:class:`~lightning_grpo.rollout.engines.vllm.colocated.VLLMRolloutEngine`: the same sampling parameters, processed
sampler logprobs and per-request seeds, so the same completions), with the worker extension
:class:`~lightning_grpo.rollout.server.vllm_extension.WeightSyncWorkerExtension`, through which the trainer streams its
weights over a ``torch.distributed`` group (:mod:`lightning_grpo.rollout.server.weight_sync`), between requests or,
in the ``"interrupt"`` mode, while sequences are in flight. The trainer's side is
:class:`~lightning_grpo.rollout.server.remote.VLLMServerEngine` (``engine.name="vllm_server"``, a fixed schedule) or
:class:`~lightning_grpo.rollout.server.server_pool.ServerPool` (streaming groups over several servers).

Security: it listens on 127.0.0.1 unless ``--host`` says otherwise, and another address needs a shared secret
(``$LIGHTNING_GRPO_SERVER_SECRET`` or ``--secret-file``), which every request must then carry
(:mod:`lightning_grpo.rollout.server.security`); the HTTP layer's limits and status codes are in
:mod:`lightning_grpo.rollout.server.asgi`.

Endpoints (JSON bodies and answers; errors are ``{"error": message}``: 400 bad input naming the field, 401 no or a
wrong secret, 404/405, 408/413 body too slow/large, 503 queue full, 500 otherwise):

* ``GET /health``: ``instance_id`` (new at every start: the trainer notices a restart), ``version`` (of the
  weights: 0 = the checkpoint, then what the trainer's last ``/update_weights`` set), ``eos_token_ids``,
  ``pad_token_id``, ``max_model_len``, ``vocab_size``, ``tie_word_embeddings``, ``world_size`` (the engine's
  workers), ``device``, ``model``, ``max_request_tokens``, ``image_token_id``, ``stats`` (the engine's batching
  counters: :class:`~lightning_grpo.rollout.server.async_engine.EngineStats`), ``records_routing`` (started with
  ``--record-routing``), ``dtype`` (what the engine computes in, ``--dtype``).
* ``POST /generate``: ``prompts`` (token-id lists), ``num_generations``, ``sampling`` (the fields of
  :class:`~lightning_grpo.protocols.sampling.SamplingConfig` but ``seed``), ``seeds`` (one per prompt, or null) ->
  ``token_ids``, ``logprobs`` and ``versions`` (one list per completion, prompt-major, unpadded, aligned token by
  token), ``extra`` (other per-token fields by name), ``version`` (the oldest token's), ``instance_id``
  (:mod:`lightning_grpo.rollout.server.wire`); with ``return_routed_experts`` (a server started with
  ``--record-routing``: a mixture of experts under routing replay "R3"), ``extra`` holds ``prompt_routed_experts``
  and ``completion_routed_experts``, one nested list ``(length, moe_layers, top_k)`` per completion aligned with its
  prompt's ids and with its own (a completion cut by an in-flight update: each token's experts from the segment that
  first fed it, :mod:`lightning_grpo.rollout.server.routed_segments`). Its work, ``sum over prompts of
  num_generations * (prompt tokens + max_new_tokens)``, may be at most ``--max-request-tokens`` (the trainer splits
  its calls to fit).
* ``POST /probe_logprobs``: ``sequences`` -> ``logprobs`` (teacher-forced, temperature 1, ``L - 1`` per
  sequence), ``version``, ``instance_id``.
* ``POST /init_weight_sync``: ``host``, ``port``, ``prefix``, ``world_size``, ``backend``, ``timeout_s``: the
  workers join the trainer's group (the trainer joins at the same time).
* ``POST /update_weights``: ``version``, ``mode`` (``"wait"``, the default: the sequences in flight finish first;
  ``"interrupt"``: they are cut at the next step and continue under the new weights, their prefix recomputed): the
  workers receive the streamed weights and load them; the prefix cache is dropped; answers ``num_tensors``,
  ``paused_s`` (seconds generation was held) and the new ``version``.
* ``POST /close_weight_sync``: the workers leave the group.
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
import uuid
from typing import Any, Optional, Sequence

from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.rollout.engines.multimodal import decode_picture
from lightning_grpo.rollout.engines.rows import check_prompts
from lightning_grpo.rollout.server.async_engine import AsyncVLLMEngine
from lightning_grpo.rollout.server.schema import GenerateRequest, InitWeightSyncRequest, ProbeRequest, UpdateMode
from lightning_grpo.rollout.server.security import check_bind, read_secret
from lightning_grpo.rollout.server.wire import completion_answer

WORKER_EXTENSION = "lightning_grpo.rollout.server.vllm_extension.WeightSyncWorkerExtension"
#: Default ``--max-request-tokens``: 2**22 (e.g. 512 prompts x 16 completions x 512 tokens).
MAX_REQUEST_TOKENS = 2**22


def request_work(prompt_lengths: Sequence[int], num_generations: int, max_new_tokens: int) -> int:
    """The work of a generate request in tokens: ``sum_i num_generations * (prompt_lengths[i] + max_new_tokens)``
    (every completion's prompt and generation budget)."""
    return sum(num_generations * (length + max_new_tokens) for length in prompt_lengths)


def check_token_ids(rows: Sequence[Sequence[int]], vocab_size: int, field: str) -> None:
    """Every id in ``[0, vocab_size)``.

    Raises:
        ValueError: naming the first id out of range (``prompts[1][3]=99999``) and the vocabulary size.
    """
    for i, row in enumerate(rows):
        for j, token in enumerate(row):
            if not 0 <= token < vocab_size:
                raise ValueError(f"{field}[{i}][{j}]={token} is not a token id of this model (vocabulary of "
                                 f"{vocab_size})")


class RolloutServer:
    """The engine and the state behind the endpoints (``instance_id``, ``version``), without the HTTP layer
    (:func:`lightning_grpo.rollout.server.asgi.create_app`). ``prepare_*`` check a request without the engine;
    the engine calls are blocking and thread-safe: many run at once, sharing the engine's batch.

    Args:
        model: folder of the HF checkpoint (weights, config, tokenizer) the engine starts from.
        kv_cache_space_gib, max_model_len, seed, dtype, gpu_memory_utilization: as
            :class:`~lightning_grpo.rollout.engines.vllm.colocated.VLLMRolloutEngine`.
        tensor_parallel_size: vLLM workers per instance (GPU); each joins the weight-sync group.
        max_request_tokens: the most work (:func:`request_work`) of one generate or probe request.
        record_routing: record the experts a mixture of experts routes each token to (``--record-routing``:
            :class:`~lightning_grpo.rollout.server.async_engine.AsyncVLLMEngine`'s ``record_routing``), answered to the
            generate requests that ask (``return_routed_experts``).

    Raises:
        ValueError: ``model`` is not a model folder or holds no tokenizer (the folder is named), or an option is
            out of range; ``record_routing`` for a model without mixture-of-experts layers.
    """

    def __init__(self, model: str, *, kv_cache_space_gib: float = 2, max_model_len: Optional[int] = None,
                 seed: int = 0, dtype: Optional[str] = None, gpu_memory_utilization: float = 0.9,
                 tensor_parallel_size: int = 1, max_request_tokens: int = MAX_REQUEST_TOKENS,
                 record_routing: bool = False) -> None:
        if max_request_tokens < 1:
            raise ValueError(f"--max-request-tokens must be >= 1, got {max_request_tokens}")
        self.model = model
        self.max_request_tokens = int(max_request_tokens)
        self.engine = AsyncVLLMEngine(model, kv_cache_space_gib=kv_cache_space_gib, max_model_len=max_model_len,
                                      seed=seed, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                                      tensor_parallel_size=tensor_parallel_size, worker_extension_cls=WORKER_EXTENSION,
                                      record_routing=record_routing)
        self.engine.collective_rpc("stop_with_server", kwargs={"server_pid": os.getpid()})  # no orphaned engine
        self.world_size = self.engine.world_size
        self.vocab_size = self.engine.vocab_size
        self.instance_id = uuid.uuid4().hex
        self.version = 0

    def health(self) -> dict:
        engine = self.engine
        return dict(instance_id=self.instance_id, version=self.version, model=self.model,
                    eos_token_ids=list(engine.eos_token_ids), pad_token_id=engine.pad_token_id,
                    max_model_len=engine.max_model_len, vocab_size=self.vocab_size,
                    tie_word_embeddings=engine.tie_word_embeddings, world_size=self.world_size,
                    device="cpu" if engine.on_cpu else "cuda", max_request_tokens=self.max_request_tokens,
                    image_token_id=None if engine.vision is None else engine.vision.placeholder_id,
                    stats=engine.stats_dict(), records_routing=engine.routing is not None,
                    dtype=str(engine.dtype).removeprefix("torch."))

    # ------------------------------------------------------------------ generation
    def prepare_generate(self, request: GenerateRequest) -> tuple:
        """Checked arguments of :meth:`generate`.

        Raises:
            ValueError: bad sampling settings, prompts (empty, too long, ids outside the vocabulary), seeds of the
                wrong count, or more work than ``max_request_tokens`` (the field and the limit are named); images
                for a model without images, not one entry per prompt, or not images (base64 PNG within the limits).
        """
        fields = request.sampling.model_dump()
        sampling = SamplingConfig(**{**fields, "banned_token_ids": tuple(fields["banned_token_ids"])})
        prompts = check_prompts(request.prompts, request.num_generations, sampling, self.engine.max_model_len)
        check_token_ids(prompts, self.vocab_size, "prompts")
        work = request_work([len(p) for p in prompts], request.num_generations, sampling.max_new_tokens)
        if work > self.max_request_tokens:
            raise ValueError(f"the request's work, num_generations x (prompt tokens + sampling.max_new_tokens) summed "
                             f"over the {len(prompts)} prompts, is {work} tokens, over this server's "
                             f"--max-request-tokens={self.max_request_tokens}: send fewer prompts or completions "
                             "per request")
        seeds = request.seeds
        if seeds is not None and len(seeds) != len(prompts):
            raise ValueError(f"seeds has {len(seeds)} entries for {len(prompts)} prompts")
        if request.return_routed_experts and self.engine.routing is None:
            raise ValueError("return_routed_experts: this server does not record the routing (start it with "
                             "--record-routing, for a mixture-of-experts model)")
        return (prompts, request.num_generations, sampling, seeds, self._pictures(request, len(prompts)),
                request.return_routed_experts)

    def _pictures(self, request: GenerateRequest, num_prompts: int) -> Optional[list[list[Any]]]:
        """The request's pictures per prompt, decoded (None without images)."""
        if not request.images:
            return None
        if self.engine.vision is None:
            raise ValueError("images: this server's model is not a vision-language model")
        if len(request.images) != num_prompts:
            raise ValueError(f"images has {len(request.images)} entries for {num_prompts} prompts")
        return [[decode_picture(text, f"images[{i}][{j}]") for j, text in enumerate(row)]
                for i, row in enumerate(request.images)]

    def generate(self, prompts: list[list[int]], num_generations: int, sampling: SamplingConfig,
                 seeds: Optional[list[int]], pictures: Optional[list[list[Any]]] = None,
                 routed_experts: bool = False) -> dict:
        """The answer of ``/generate`` (:mod:`lightning_grpo.rollout.server.wire`); with pictures, also the
        prompt ids the engine ran (placeholders expanded); with ``routed_experts``, the routing fields among the
        per-token ``extra`` fields."""
        rows_pictures: list[Optional[list[Any]]] = list(pictures) if pictures is not None else [None] * len(prompts)
        requests = [{"prompt_token_ids": p, **({"multi_modal_data": {"image": pics}} if pics else {})}
                    for p, pics in zip(prompts, rows_pictures, strict=True)]
        rows, expanded = self.engine.generate_requests(requests, num_generations, sampling, seeds,
                                                       routed_experts=routed_experts)
        prompt_lengths = [len(ids) for ids in expanded for _ in range(num_generations)]
        answer = dict(completion_answer(rows, self.version, prompt_lengths), instance_id=self.instance_id)
        if pictures is not None:
            answer["prompt_token_ids"] = expanded
        return answer

    def prepare_probe(self, request: ProbeRequest) -> tuple:
        """Checked arguments of :meth:`probe_logprobs`.

        Raises:
            ValueError: no sequence, ids outside the vocabulary, or more than ``max_request_tokens`` tokens in all.
        """
        if not request.sequences:
            raise ValueError("sequences is empty: nothing to score")
        check_token_ids(request.sequences, self.vocab_size, "sequences")
        total = sum(len(s) for s in request.sequences)
        if total > self.max_request_tokens:
            raise ValueError(f"sequences hold {total} tokens, over this server's --max-request-tokens="
                             f"{self.max_request_tokens}")
        return (request.sequences,)

    def probe_logprobs(self, sequences: list[list[int]]) -> dict:
        logprobs = self.engine.teacher_forced_logprobs(sequences)
        return dict(logprobs=logprobs, version=self.version, instance_id=self.instance_id)

    # ------------------------------------------------------------------ weights
    def prepare_init_weight_sync(self, request: InitWeightSyncRequest) -> tuple:
        """Checked arguments of :meth:`init_weight_sync`.

        Raises:
            ValueError: a ``world_size`` other than ``1 +`` this instance's workers.
        """
        if request.world_size != 1 + self.world_size:
            raise ValueError(f"world_size={request.world_size}: this instance has {self.world_size} workers, so its "
                             f"group has {1 + self.world_size} ranks")
        return (request.model_dump(),)

    def init_weight_sync(self, kwargs: dict) -> dict:
        ranks = self.engine.collective_rpc("init_weight_sync", kwargs=kwargs)
        return dict(ranks=ranks, instance_id=self.instance_id)

    def update_weights(self, version: int, mode: UpdateMode = "wait") -> dict:
        """Receive the weights the trainer streams now and serve them as ``version`` (the trainer numbers them;
        only an authenticated trainer reaches this), the sequences in flight waited for (``"wait"``) or continued
        under the new weights (``"interrupt"``: :mod:`lightning_grpo.rollout.server.async_engine`)."""
        loaded = self.engine.update_weights(version, mode)
        self.version = int(version)
        return dict(version=self.version, num_tensors=loaded["num_tensors"], paused_s=loaded["paused_s"],
                    instance_id=self.instance_id)

    def close_weight_sync(self) -> dict:
        self.engine.collective_rpc("close_weight_sync")
        return dict(instance_id=self.instance_id)

    def close(self) -> None:
        self.engine.close()


def listen(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A socket listening on ``host:port`` (bound before the engine loads, so a port in use fails at once).

    Raises:
        ValueError: the port is in use, or ``host`` is not an address of this machine.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(backlog)
    except OSError as err:
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise ValueError(f"--port {port} is in use on {host}: choose a free port") from None
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({err.strerror})") from None
    return sock


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-grpo serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="HF checkpoint folder (the trainer's starting weights)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default 127.0.0.1: this machine only; another address needs a "
                             "shared secret)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    parser.add_argument("--secret-file", default=None,
                        help="file whose first line is the shared secret every request must carry (default: "
                             "$LIGHTNING_GRPO_SERVER_SECRET; none = loopback only)")
    parser.add_argument("--kv-cache-space-gib", type=float, default=2, help="CPU: KV-cache GiB, > 0 (default 2)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="most prompt + completion tokens (default: the model's)")
    parser.add_argument("--seed", type=int, default=0, help="the engine's seed (default 0)")
    parser.add_argument("--dtype", default=None, help="float32 / bfloat16 / auto (default: float32 on CPU); bfloat16 "
                        "for a trainer that computes in bf16 (docs/performance.md, bf16)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, help="GPU: memory fraction")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="GPU: workers per instance")
    parser.add_argument("--max-request-tokens", type=int, default=MAX_REQUEST_TOKENS,
                        help="most work of one request: completions x (prompt + max_new_tokens) tokens, summed "
                             f"(default {MAX_REQUEST_TOKENS})")
    parser.add_argument("--max-queued-requests", type=int, default=64,
                        help="most requests waiting for the engine; more get HTTP 503 (default 64)")
    parser.add_argument("--max-body-mib", type=float, default=64.0, help="largest request body in MiB (default 64)")
    parser.add_argument("--record-routing", action="store_true",
                        help="record the experts a mixture-of-experts model routes each token to, for trainers with "
                             "routing replay R3 (GRPOConfig.routing_replay='R3')")
    return parser


def serve_main(argv: Sequence[str]) -> None:
    """``lightning-grpo serve``: check the options, listen, start the engine, then answer until SIGTERM / SIGINT.
    A bad option (a non-loopback ``--host`` without a secret, a port in use, a folder without a model or a
    tokenizer) exits with status 2 and the reason."""
    parser = _parser()
    args = parser.parse_args(list(argv))
    try:
        secret = read_secret(args.secret_file, "--secret-file")
        check_bind(args.host, secret)
        if args.max_queued_requests < 1 or not args.max_body_mib > 0:
            raise ValueError("--max-queued-requests must be >= 1 and --max-body-mib > 0")
        sock = listen(args.host, args.port)
    except ValueError as err:
        parser.error(str(err))
    try:
        server = RolloutServer(args.model, kv_cache_space_gib=args.kv_cache_space_gib,
                               max_model_len=args.max_model_len, seed=args.seed, dtype=args.dtype,
                               gpu_memory_utilization=args.gpu_memory_utilization,
                               tensor_parallel_size=args.tensor_parallel_size,
                               max_request_tokens=args.max_request_tokens, record_routing=args.record_routing)
    except ValueError as err:
        sock.close()
        parser.error(str(err))
    serve(server, sock, secret=secret, max_body_bytes=int(args.max_body_mib * 2**20),
          max_queued=args.max_queued_requests)


def serve(server: RolloutServer, sock: socket.socket, *, secret: Optional[str], max_body_bytes: int,
          max_queued: int) -> None:
    """Answer on ``sock`` with uvicorn until SIGTERM / SIGINT, then close the engine."""
    import uvicorn
    from vllm.exceptions import VLLMClientError

    from lightning_grpo.rollout.server.asgi import create_app

    app = create_app(server, secret=secret, max_body_bytes=max_body_bytes, max_queued=max_queued,
                     client_errors=(VLLMClientError,), batching=True)
    host, port = sock.getsockname()[:2]
    if secret is None:
        print("lightning-grpo serve: no shared secret: any process on this machine can call this server and change "
              "its weights (set LIGHTNING_GRPO_SERVER_SECRET or --secret-file to require one)", file=sys.stderr,
              flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_keep_alive=5,
                            limit_concurrency=max_queued + 64, server_header=False)
    print(f"lightning-grpo serve: ready on http://{host}:{port} (instance {server.instance_id})", flush=True)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        app.state.queue.close()
        app.state.control.close()
        server.close()
        sock.close()


if __name__ == "__main__":
    serve_main(sys.argv[1:])
