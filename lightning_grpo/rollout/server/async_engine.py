"""The rollout server's engine: vLLM's ``AsyncLLM`` (continuous batching: a request joins the running batch at the
next engine step) on an event loop of its own thread, sampling as the colocated engine does
(:mod:`lightning_grpo.rollout.engines.vllm.colocated`: the same engine arguments, ``SamplingParams``, processed
logprobs and per-request seeds), and taking new weights while sequences are in flight.

Weight updates (:meth:`AsyncVLLMEngine.update_weights`), one mode per call:

* ``"wait"``: ``pause_generation(mode="wait")``: the sequences in flight finish under the old weights, then the
  weights are loaded and the engine resumes (what a fixed schedule needs: a rollout never spans an update);
* ``"interrupt"``: ``pause_generation(mode="abort")`` at the next step boundary, load, resume; every sequence that
  was in flight is **resubmitted** with its partial completion appended to its prompt and the rest of its token
  budget, so its prefix's KV cache is recomputed under the new weights (AReaL's interruptible generation,
  arXiv:2505.24298, section 4.1; ``areal/infra/remote_inf_engine.py``). Both modes clear the prefix cache while
  paused, before the load, so no KV entry computed under old weights is ever reused. The choice is the documented
  one of docs/engines.md ("In-flight weight updates"): the tokens after the update are sampled from the new policy
  exactly (the teacher-forced distribution of the same sequence under the new weights), not from new weights over
  an old-weight prefix (``mode="keep"``, PipelineRL's and TRL's choice), which no single policy defines.

Versions: while paused the engine core is told the new version (``AsyncLLM.update_weight_version``), and vLLM labels
every step's tokens with the version in force (``CompletionOutput.weight_versions``, spans of output positions), so a
completion's per-token versions are the engine's own record, segment by segment, whatever the timing of an update
against a submission. A segment resumed after ``n`` tokens is sampled with the seed
:func:`segment_seed` ``(seed, n)`` (the request's own seed for ``n = 0``), so a resumed segment draws fresh noise and a
completion depends on its seed, the weights and the token positions of the updates only.

Routing replay "R3" (``record_routing``): a request that asks for it gets each completion's routed experts, read
segment by segment and joined by the rule of :mod:`lightning_grpo.rollout.server.routed_segments` (each token keeps
the experts of the segment that first fed it); every update clears the routing records with the prefix cache.

Batching statistics (:class:`EngineStats`, in the server's ``/health``): engine steps, tokens generated, the most
requests running in one step (vLLM's scheduler statistics, through a stat logger), segments interrupted, updates,
the last pause.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Awaitable, Optional, Sequence, TypeVar

from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.protocols.vision import vision_spec
from lightning_grpo.rollout.engines.vllm.colocated import (
    prompt_token_logprobs,
    scoring_sampling_params,
    scoring_token_ids,
    stop_and_pad_ids,
    vllm_engine_arguments,
    vllm_sampling_params,
)
from lightning_grpo.rollout.engines.vllm.runtime import import_vllm, vllm_on_cpu
from lightning_grpo.rollout.server.routed_segments import Segment, ServerRouting
from lightning_grpo.rollout.server.schema import UpdateMode

T = TypeVar("T")
#: A completion row: token ids, the sampler's logprobs, and per-token fields by name ("versions" among them).
Row = tuple[list[int], list[float], dict[str, list[Any]]]


def segment_seed(seed: Optional[int], offset: int) -> Optional[int]:
    """The seed of a completion's segment that starts after ``offset`` generated tokens: ``seed`` itself for the
    first segment (``offset = 0``: the colocated engine's seed), else 56 bits of BLAKE2b of ``"seed:offset"`` (a
    fresh, reproducible noise stream for the resumed segment); None stays None (the engine's generator)."""
    if seed is None or offset == 0:
        return seed
    digest = hashlib.blake2b(f"{int(seed)}:{int(offset)}".encode(), digest_size=7).digest()
    return int.from_bytes(digest, "big")


def versions_from_spans(spans: Optional[Sequence[Any]], num_tokens: int, where: str) -> list[int]:
    """Per-token versions from vLLM's ``WeightVersionSpan`` list (``version`` label, output positions
    ``[start, end)``).

    Raises:
        RuntimeError: the spans do not cover the ``num_tokens`` tokens exactly once, or a label is not an integer
            (the engine's version is set only by this module) - ``where`` names the request.
    """
    versions: list[int] = []
    for span in spans or ():
        if span.start != len(versions) or not span.version.lstrip("-").isdigit():
            raise RuntimeError(f"{where}: vLLM's weight-version spans {spans} do not label its tokens in order")
        versions += [int(span.version)] * (span.end - span.start)
    if len(versions) != num_tokens:
        raise RuntimeError(f"{where}: vLLM labelled {len(versions)} of its {num_tokens} tokens with a weight version "
                           f"(spans {spans})")
    return versions


@dataclass
class EngineStats:
    """Counters since the engine started (read by ``/health``).

    Attributes:
        steps: engine steps that ran at least one request.
        generated_tokens: tokens sampled in those steps.
        max_running: the most requests running in one step (several concurrent requests in one batch: > 1).
        interrupted: completion segments cut by an ``"interrupt"`` update and resubmitted.
        updates: weight updates loaded.
        last_pause_s: seconds the last update held generation (pause to resume).
    """

    steps: int = 0
    generated_tokens: int = 0
    max_running: int = 0
    interrupted: int = 0
    updates: int = 0
    last_pause_s: float = 0.0


def _stat_logger(stats: EngineStats) -> Any:
    """A vLLM per-engine stat logger factory that counts into ``stats`` (called on the engine's loop)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class Counter(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            if iteration_stats is None or scheduler_stats is None or iteration_stats.num_generation_tokens == 0:
                return
            stats.steps += 1
            stats.generated_tokens += iteration_stats.num_generation_tokens
            stats.max_running = max(stats.max_running, scheduler_stats.num_running_reqs)

        def log_engine_initialized(self) -> None:
            pass

    return Counter


class AsyncVLLMEngine:
    """vLLM's ``AsyncLLM`` behind thread-safe, blocking methods (each runs on the engine's event loop; many at once
    share its batch).

    Args:
        model: folder of the HF checkpoint (weights, config, tokenizer).
        kv_cache_space_gib, max_model_len, seed, dtype, gpu_memory_utilization: as
            :class:`~lightning_grpo.rollout.engines.vllm.colocated.VLLMRolloutEngine`.
        tensor_parallel_size: vLLM workers (GPUs) of the engine.
        worker_extension_cls: the workers' extension (the weight-sync methods the server calls; with
            ``record_routing``, the routing capture's too: :mod:`lightning_grpo.rollout.server.vllm_extension`).
        record_routing: record the experts a mixture of experts routes each token to (routing replay "R3"): vLLM's own
            ``enable_return_routed_experts`` where it starts (CUDA, Model Runner V2), else the capture in its worker.

    Attributes:
        routing: the routing record (:class:`~lightning_grpo.rollout.server.routed_segments.ServerRouting`), None
            without ``record_routing``.

    Raises:
        ValueError: ``model`` is not a model folder or holds no tokenizer, or an option is out of range;
            ``record_routing`` for a model without mixture-of-experts layers.
    """

    def __init__(self, model: str, *, kv_cache_space_gib: float = 2, max_model_len: Optional[int] = None,
                 seed: int = 0, dtype: Optional[str] = None, gpu_memory_utilization: float = 0.9,
                 tensor_parallel_size: int = 1, worker_extension_cls: Optional[str] = None,
                 record_routing: bool = False) -> None:
        from transformers import AutoTokenizer

        path = Path(model)
        if not (path / "config.json").is_file():
            raise ValueError(f"model_path={model!r} is not a model folder (no config.json in it)")
        if not kv_cache_space_gib > 0:
            raise ValueError(f"kv_cache_space_gib must be > 0, got {kv_cache_space_gib}")
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as err:
            raise ValueError(f"model_path={model!r} holds no tokenizer that transformers can load: {err}") from err
        self.eos_token_ids, self.pad_token_id = stop_and_pad_ids(path, self.tokenizer)
        import_vllm()
        self.on_cpu = vllm_on_cpu()
        kwargs = vllm_engine_arguments(path, dtype=dtype, seed=seed, max_model_len=max_model_len, enforce_eager=None,
                                       gpu_memory_utilization=gpu_memory_utilization,
                                       kv_cache_space_gib=kv_cache_space_gib, enable_prefix_caching=True)
        kwargs.update(tensor_parallel_size=tensor_parallel_size, worker_extension_cls=worker_extension_cls)
        if self.on_cpu and tensor_parallel_size == 1:
            # one worker inside the engine-core process (vLLM's CPU platform would start a third process for it)
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            kwargs["distributed_executor_backend"] = "uni"
        self.stats = EngineStats()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-async-engine", daemon=True)
        self._thread.start()
        self._updates = 0  # updates started (an abort seen after one started is that update's)
        self.routing: Optional[ServerRouting] = None
        try:
            self.llm, native = self._call(self._start(kwargs, record_routing and not self.on_cpu))
        except BaseException:
            self._stop_loop()
            raise
        if record_routing:
            try:
                self.routing = ServerRouting(lambda method: self.collective_rpc(method), native)
            except BaseException:
                self.close()
                raise
        model_config = self.llm.model_config
        self.dtype = model_config.dtype  # (a torch dtype) what the weights are cast to and computed in
        self.vision = vision_spec(model_config.hf_config)
        self.max_model_len = int(model_config.max_model_len)
        self.vocab_size = int(model_config.get_vocab_size())
        self.tie_word_embeddings = bool(getattr(model_config.hf_text_config, "tie_word_embeddings", False))
        self.world_size = int(self.llm.vllm_config.parallel_config.world_size)

    async def _start(self, kwargs: dict[str, Any], native_routing: bool) -> tuple[Any, bool]:
        """The ``AsyncLLM`` and whether it records the routing itself (``native_routing`` asks for vLLM's own
        ``enable_return_routed_experts``: taken where vLLM accepts it, as the colocated engine does)."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        config = None
        if native_routing:
            try:
                config = AsyncEngineArgs(**kwargs, enable_return_routed_experts=True).create_engine_config()
            except ValueError as err:  # "AuxOutput Connector requires Model Runner V2; ..."
                if "AuxOutput" not in str(err):
                    raise
        native = config is not None
        config = config if config is not None else AsyncEngineArgs(**kwargs).create_engine_config()
        if self.on_cpu:
            # vLLM's CPU platform asks for its engine-core process to be spawned, which imports vLLM and torch again
            # (measured: the server's start 11 s -> 21-26 s on this loaded 2-core machine); this process has run no
            # OpenMP region yet (nothing but the tokenizer and the config is loaded), so a fork is safe and starts
            # the engine core at once, as vLLM does on CUDA.
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
        llm = AsyncLLM.from_vllm_config(config, stat_loggers=[_stat_logger(self.stats)], disable_log_stats=True)
        await llm.update_weight_version("0")
        self._resumed = asyncio.Event()  # set while no update holds generation
        self._resumed.set()
        self._update_lock = asyncio.Lock()
        return llm, native

    def _call(self, coro: Awaitable[T]) -> T:
        """Run ``coro`` on the engine's loop and wait for its result (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()  # type: ignore[arg-type]

    # ------------------------------------------------------------------ generation
    def generate_requests(self, requests: Sequence[dict[str, Any]], num_generations: int, sampling: SamplingConfig,
                          seeds: Optional[Sequence[int]] = None,
                          routed_experts: bool = False) -> tuple[list[Row], list[list[int]]]:
        """The ``B * G`` completions of vLLM ``TokensPrompt`` requests (``prompt_token_ids`` and, for images,
        ``multi_modal_data``), prompt-major: ``(token ids, sampler logprobs, {"versions": per-token versions})``
        rows, and the prompt ids vLLM ran (placeholders expanded). Completion ``j`` of request ``i`` is one engine
        request seeded ``seeds[i] + j`` (vLLM's seeding of ``n = G``: the colocated engine's samples). With
        ``routed_experts`` each row's fields also hold its ``prompt_routed_experts`` (aligned with the prompt ids vLLM
        ran) and ``completion_routed_experts`` (aligned with its ids), nested lists
        (:mod:`lightning_grpo.rollout.server.routed_segments`).

        Raises:
            ValueError: ``seeds`` not one per request; ``routed_experts`` from an engine that does not record them.
        """
        if seeds is not None and len(seeds) != len(requests):
            raise ValueError(f"seeds has {len(seeds)} entries for {len(requests)} prompts")
        if routed_experts and self.routing is None:
            raise ValueError("routed_experts: this engine does not record the routing (record_routing=False)")
        return self._call(self._generate(list(requests), num_generations, sampling, seeds, routed_experts))

    async def _generate(self, requests: list[dict[str, Any]], num_generations: int, sampling: SamplingConfig,
                        seeds: Optional[Sequence[int]], routed_experts: bool) -> tuple[list[Row], list[list[int]]]:
        copies = num_generations if sampling.greedy else 1  # greedy: one request, its completion copied G times
        per_prompt = 1 if sampling.greedy else num_generations
        params = vllm_sampling_params(sampling, 1, self.eos_token_ids, self.tokenizer)
        segments: list[list[Segment]] = [[] for _ in range(len(requests) * per_prompt)]
        tasks = [self._complete(request, params, None if seeds is None or sampling.greedy else int(seeds[i]) + j,
                                segments[i * per_prompt + j] if routed_experts else None)
                 for i, request in enumerate(requests) for j in range(per_prompt)]
        done = await asyncio.gather(*tasks, return_exceptions=True)
        failed = next((d for d in done if isinstance(d, BaseException)), None)
        if failed is not None:
            if routed_experts and self.routing is not None:
                await self.routing.release(self.llm.collective_rpc, segments)
            raise failed
        completed: list[tuple[Row, list[int]]] = done  # type: ignore[assignment]
        if routed_experts and self.routing is not None:
            routing = await self.routing.fields(self.llm.collective_rpc, segments,
                                                [len(expanded) for _, expanded in completed])
            completed = [((ids, lps, {**fields, **routed}), expanded)
                         for ((ids, lps, fields), expanded), routed in zip(completed, routing, strict=True)]
        rows = [row for row, _ in completed for _ in range(copies)]
        expanded = [completed[i * per_prompt][1] for i in range(len(requests))]
        return rows, expanded

    async def _complete(self, request: dict[str, Any], params: Any, seed: Optional[int],
                        segments: Optional[list[Segment]] = None) -> tuple[Row, list[int]]:
        """One completion, segment by segment: a segment an ``"interrupt"`` update aborted is resubmitted with its
        tokens appended to the prompt and the rest of the budget (module docstring); with ``segments`` (routing
        asked for), each segment is tagged for the routing record and listed there."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        prompt = list(request["prompt_token_ids"])
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        expanded: Optional[list[int]] = None
        while True:
            await self._resumed.wait()
            epoch = self._updates
            segment = params.clone()
            segment.n, segment.max_tokens = 1, params.max_tokens - len(ids)
            segment.seed, segment.output_kind = segment_seed(seed, len(ids)), RequestOutputKind.FINAL_ONLY
            tag = None
            if segments is not None and self.routing is not None:
                tag = self.routing.tag(segment)
                segments.append(Segment(tag, 0, 0))  # listed before it runs: released if the call fails
            request_id = uuid.uuid4().hex
            continued: Any = TokensPrompt(**{**request, "prompt_token_ids": prompt + ids})  # type: ignore[typeddict-item]
            final = None
            async for out in self.llm.generate(continued, segment, request_id):
                final = out
            assert final is not None and final.finished
            if segments is not None and self.routing is not None:
                segments[-1] = self.routing.segment(tag, final)
            if expanded is None:
                expanded = [int(t) for t in final.prompt_token_ids]
            completion = final.outputs[0]
            new = [int(t) for t in completion.token_ids]
            ids += new
            logprobs += [float(completion.logprobs[k][t].logprob) for k, t in enumerate(new)]
            versions += versions_from_spans(completion.weight_versions, len(new), f"request {request_id}")
            if completion.finish_reason != "abort":
                return (ids, logprobs, {"versions": versions}), expanded
            if self._updates == epoch:
                raise RuntimeError(f"vLLM aborted request {request_id} with no weight update under way")
            self.stats.interrupted += 1
            if len(ids) >= params.max_tokens:
                return (ids, logprobs, {"versions": versions}), expanded

    def teacher_forced_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """As :meth:`~lightning_grpo.rollout.engines.vllm.colocated.VLLMRolloutEngine.teacher_forced_logprobs`
        (``L - 1`` values per sequence, temperature 1), under the weights in force when each ran.

        Raises:
            ValueError: a sequence shorter than 2 tokens or longer than ``max_model_len - 1``.
        """
        return self._call(self._score(scoring_token_ids(sequences, self.max_model_len)))

    async def _score(self, sequences: list[list[int]]) -> list[list[float]]:
        from vllm.inputs import TokensPrompt

        async def one(sequence: list[int]) -> list[float]:
            while True:  # an "interrupt" update aborts it: scored again under the new weights
                await self._resumed.wait()
                epoch, final = self._updates, None
                request = TokensPrompt(prompt_token_ids=sequence)
                async for out in self.llm.generate(request, scoring_sampling_params(), uuid.uuid4().hex):
                    final = out
                assert final is not None
                if final.outputs[0].finish_reason != "abort":
                    return prompt_token_logprobs(final, sequence)
                if self._updates == epoch:
                    raise RuntimeError("vLLM aborted a probe request with no weight update under way")

        return list(await asyncio.gather(*(one(s) for s in sequences)))

    # ------------------------------------------------------------------ weights
    def collective_rpc(self, method: str, kwargs: Optional[dict[str, Any]] = None) -> list[Any]:
        """``method`` of the worker extension on every worker (their answers, one per worker)."""
        return self._call(self.llm.collective_rpc(method, kwargs=kwargs))

    def update_weights(self, version: int, mode: UpdateMode) -> dict[str, Any]:
        """Pause generation (``mode``: module docstring), receive the streamed weights on every worker
        (``receive_weights``), label what follows ``version``, resume. Returns ``num_tensors`` (per worker: the
        first) and ``paused_s`` (pause to resume). The engine resumes even when the load fails (the error is raised
        and the version is not changed).

        Raises:
            ValueError: an unknown ``mode``.
        """
        if mode not in ("wait", "interrupt"):
            raise ValueError(f"mode={mode!r}: choose 'wait' or 'interrupt'")
        return self._call(self._update(int(version), mode))

    async def _update(self, version: int, mode: UpdateMode) -> dict[str, Any]:
        async with self._update_lock:
            self._updates += 1
            self._resumed.clear()
            try:
                await self.llm.pause_generation(mode="abort" if mode == "interrupt" else "wait", clear_cache=True)
                paused = time.monotonic()
                if self.routing is not None:  # the prefix cache is reset: no later request reuses the records' blocks
                    await self.routing.clear(self.llm.collective_rpc)
                counts = await self.llm.collective_rpc("receive_weights")
                await self.llm.update_weight_version(str(version))
                self.stats.updates += 1
            finally:
                await self.llm.resume_generation()
                self._resumed.set()
            self.stats.last_pause_s = time.monotonic() - paused
            return dict(num_tensors=int(counts[0]), paused_s=self.stats.last_pause_s)

    def stats_dict(self) -> dict[str, Any]:
        """:class:`EngineStats` as a dict."""
        return asdict(self.stats)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Shut the engine (and its engine-core process) down and stop the loop thread."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            self._call(self._shutdown(llm))
        self._stop_loop()

    @staticmethod
    async def _shutdown(llm: Any) -> None:
        llm.shutdown()

    def _stop_loop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)
        if not self._loop.is_running():
            self._loop.close()
