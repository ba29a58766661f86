"""Streaming rollouts over several rollout servers: :class:`ServerPool`, the
:class:`~lightning_grpo.protocols.streaming.StreamingEngine` the streaming trainer samples groups from.

* **Sampling** (:meth:`ServerPool.sample_group`, awaited on the producer's event loop, many at once): each group goes
  whole to one server, the live one with the least work in flight, work being ``G * (prompt tokens +
  max_new_tokens)`` summed over its groups in flight (ties: the first listed); completion ``j`` is seeded ``seed +
  j``. The server samples it on its ``AsyncLLM`` beside the others in flight
  (:mod:`lightning_grpo.rollout.server.async_engine`); its answer carries per token the ids, the sampler's logprobs,
  the weight versions and any other field by name (:mod:`lightning_grpo.rollout.server.wire`).
* **Routing replay "R3"** (``record_routing``: a mixture-of-experts policy): every server must have been started with
  ``--record-routing`` (its ``/health`` says so, checked at start); each group asks for the routed experts, which come
  back among each completion's ``extra`` fields (``prompt_routed_experts``, ``completion_routed_experts``), laid out
  like the ids by :func:`~lightning_grpo.rollout.streaming.scored_groups.group_rollout`; a completion cut by an
  in-flight update carries each token's experts from the segment that first fed it
  (:mod:`lightning_grpo.rollout.server.routed_segments`). The pool declares it (``returns_routed_experts``).
* **Weights** (:meth:`ServerPool.update_weights`, on the trainer's thread, by every trainer process): rank 0 streams
  them to every reachable server at once, one weight-sync group per server
  (:mod:`lightning_grpo.rollout.server.sync_groups`), without waiting for the groups in flight (``mode="interrupt"``,
  the default: their sequences continue under the new weights, their later tokens stamped with the new version;
  ``mode="wait"``: each server finishes what it is sampling first). The answer is a
  :class:`~lightning_grpo.protocols.streaming.WeightUpdate` (the longest pause of any server's generation).
* **The post-sync check** (``engine.weight_sync_check``): after each update every server that received it scores the
  fixed probe batch (``/probe_logprobs``) and the policy scores it too
  (:meth:`~lightning_grpo.protocols.weights.PolicyWeights.probe_logprobs`, every trainer process when the weights are
  sharded); a difference over the bound fails the update on every process, naming the server. The groups in flight
  keep sampling meanwhile.
* **Faults**: a server that cannot be reached, or whose answer is lost (it was killed), is marked down and each of
  its groups in flight raises :class:`~lightning_grpo.protocols.streaming.EngineUnavailable`: the producer samples it
  again and the pool sends it to another server (counted: :attr:`ServerPool.groups_resubmitted`; a group is never
  answered twice). A down server's ``/health`` is read again at most once a second while groups are dispatched; when
  it answers with a new ``instance_id`` it restarted (checkpoint weights): it gets a new weight-sync group and the
  current weights at the next :meth:`~ServerPool.update_weights` before it samples again, or at once (the last
  weights read again) when no other server is live and the weights are not sharded. An answer from another instance
  than the one the pool knows (a restart in between) is refused the same way. Every request is bounded by
  ``timeout_s``; with no live server for that long, sampling fails naming the servers.

Multi-GPU weight transfer (NCCL) works as for the fixed schedule's engine; it is tested here on gloo over loopback.
:func:`make_pool` is the factory of ``streaming.enabled`` with ``engine.name="vllm_server"``
(:data:`lightning_grpo.rollout.streaming.streaming_engine.STREAMING_ENGINES`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_grpo.protocols.streaming import EngineUnavailable, GroupRequest, SampledGroup, WeightUpdate
from lightning_grpo.protocols.weights import PolicyWeights, check_tied_engine
from lightning_grpo.rollout.engine_registry import EngineSpec
from lightning_grpo.rollout.engines.probe import probe_sequences
from lightning_grpo.rollout.server.client import AsyncServerClient, RolloutServerError, ServerClient, ServerUnreachable
from lightning_grpo.rollout.server.security import read_secret
from lightning_grpo.rollout.server.sync_groups import Instance, init_group, push
from lightning_grpo.rollout.server.weight_sync import host_store
from lightning_grpo.rollout.server.wire import sampled_completions, sampling_fields

log = logging.getLogger(__name__)

#: Seconds between two ``/health`` reads of a server that is down.
RECHECK_S = 1.0


def group_work(request: GroupRequest) -> int:
    """A group's work in tokens: ``G * (prompt tokens + max_new_tokens)`` (what a server holds for it)."""
    return request.num_generations * (len(request.prompt_ids) + request.sampling.max_new_tokens)


@dataclass
class PoolServer:
    """One server of the pool: its instance (weight-sync group, blocking client), its async client, its state and
    the work it has in flight."""

    inst: Instance
    aio: AsyncServerClient
    index: int
    state: Literal["live", "down", "restarted"] = "live"
    work: int = 0
    in_flight: int = 0
    sampled: int = 0
    checked_at: float = 0.0
    info: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.inst.client.url


class ServerPool:
    """A :class:`~lightning_grpo.protocols.streaming.StreamingEngine` over rollout servers (module docstring).

    Args:
        urls: the servers' base URLs (``http://host:port``).
        timeout_s: ``engine.server_timeout``: most seconds any request or weight transfer may take.
        group_host, group_port: where the trainer's rank 0 hosts the weight-sync store (as
            :class:`~lightning_grpo.rollout.server.remote.VLLMServerEngine`).
        secret: the servers' shared secret (None: servers without one, on the loopback interface).
        mode: how :meth:`update_weights` treats the sequences in flight: "interrupt" (continue under the new
            weights) or "wait" (finish first).
        weight_sync_check: ``engine.weight_sync_check``: bound on the largest absolute difference between a server's
            probe logprobs and the policy's after each update; None: not checked.
        record_routing: every completion carries the routed experts (routing replay "R3"; servers started with
            ``--record-routing``).

    Attributes:
        groups_resubmitted: groups that raised :class:`EngineUnavailable` (their server was lost) and were to be
            sampled again.
        returns_routed_experts: ``record_routing`` (a capability the streaming engine declares:
            :class:`~lightning_grpo.rollout.streaming.streaming_engine.StreamingRolloutEngine` reads it).

    Raises:
        ValueError: no URL, a URL given twice or malformed, servers that serve different models, a group port in use,
            an unknown ``mode``, a ``weight_sync_check`` that is not > 0, or, with ``record_routing``, a server that
            does not record the routing (named).
        RolloutServerError: a server does not answer within ``timeout_s``.
    """

    def __init__(self, urls: Sequence[str], *, timeout_s: float = 600.0, group_host: Optional[str] = None,
                 group_port: int = 51216, secret: Optional[str] = None,
                 mode: Literal["interrupt", "wait"] = "interrupt",
                 weight_sync_check: Optional[float] = None, record_routing: bool = False) -> None:
        if not urls:
            raise ValueError("urls is empty: give the rollout servers' URLs (GRPOConfig.engine.server_urls)")
        if len({u.rstrip("/") for u in urls}) != len(urls):
            raise ValueError(f"urls {list(urls)} name a server twice: each server holds one weight-sync group")
        if mode not in ("interrupt", "wait"):
            raise ValueError(f"mode={mode!r}: choose 'interrupt' or 'wait'")
        if weight_sync_check is not None and not weight_sync_check > 0:
            raise ValueError(f"weight_sync_check={weight_sync_check!r}: must be > 0 or None (off)")
        self.timeout_s, self.mode, self.weight_sync_check = float(timeout_s), mode, weight_sync_check
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.servers = [PoolServer(Instance(ServerClient(url, timeout_s, secret)), AsyncServerClient(url, timeout_s,
                                                                                                     secret), i)
                        for i, url in enumerate(urls)]
        self.groups_resubmitted = 0
        self._version = -1
        self._weights: Optional[PolicyWeights] = None
        self._closed = False
        self._sync_lock = threading.Lock()  # one push at a time (the trainer's update, a restarted server's re-sync)
        self._tasks: dict[asyncio.Task, asyncio.AbstractEventLoop] = {}  # requests in flight (close cancels them)
        self._tasks_lock = threading.Lock()
        self._attempts: dict[int, int] = {}
        self.group_host = group_host or os.environ.get("MASTER_ADDR", "127.0.0.1")
        self.group_port = int(group_port)
        self._store = host_store(self.group_host, self.group_port, self.timeout_s) if self.rank == 0 else None
        deadline = time.monotonic() + self.timeout_s
        infos = [s.inst.client.request("GET", "/health", deadline=deadline) for s in self.servers]
        for key in ("eos_token_ids", "pad_token_id", "max_model_len", "tie_word_embeddings", "device", "vocab_size"):
            values = {s.url: info[key] for s, info in zip(self.servers, infos, strict=True)}
            if len({repr(v) for v in values.values()}) > 1:
                raise ValueError(f"the rollout servers disagree on {key}: {values}; serve one model everywhere")
        self.eos_token_ids = [int(i) for i in infos[0]["eos_token_ids"]]
        self.max_model_len = int(infos[0]["max_model_len"])
        self.vocab_size = int(infos[0]["vocab_size"])
        self.tie_word_embeddings = bool(infos[0]["tie_word_embeddings"])
        self.max_request_tokens = min(int(i["max_request_tokens"]) for i in infos)
        self.backend = "nccl" if infos[0]["device"] == "cuda" and torch.cuda.is_available() else "gloo"
        not_recording = [s.url for s, info in zip(self.servers, infos, strict=True) if not info.get("records_routing")]
        if record_routing and not_recording:
            raise ValueError(f"routing replay 'R3' needs the routed experts, but the rollout servers {not_recording} "
                             "do not record them: start them with lightning-grpo serve --record-routing")
        self.returns_routed_experts = bool(record_routing)
        for server, info in zip(self.servers, infos, strict=True):
            server.info = info
            server.inst.instance_id, server.inst.version = info["instance_id"], int(info["version"])
            if self.rank == 0:
                self._init_group(server, info, deadline)

    @property
    def version(self) -> int:
        """The weight version given to the servers by the last :meth:`update_weights` (-1 before the first)."""
        return self._version

    # ------------------------------------------------------------------ sampling
    async def sample_group(self, request: GroupRequest) -> SampledGroup:
        """Sample one group on the live server with the least work in flight (module docstring).

        Raises:
            EngineUnavailable: the server was lost, or restarted, while it had the group (sample it again), or the
                pool was closed.
            ValueError: the group's work is over the servers' ``max_request_tokens``, or its prompt and budget over
                ``max_model_len``.
            RolloutServerError: a server refused the request (its message), or no server was live for ``timeout_s``.
        """
        if self._closed:
            raise EngineUnavailable("the server pool is closed")
        work = group_work(request)
        if work > self.max_request_tokens:
            raise ValueError(f"group {request.key}: {work} tokens of work (G x (prompt + max_new_tokens)), over the "
                             f"rollout servers' max_request_tokens={self.max_request_tokens}")
        if len(request.prompt_ids) + request.sampling.max_new_tokens > self.max_model_len:
            raise ValueError(f"group {request.key}: {len(request.prompt_ids)} prompt tokens + max_new_tokens="
                             f"{request.sampling.max_new_tokens} exceed the servers' max_model_len="
                             f"{self.max_model_len}")
        deadline = time.monotonic() + self.timeout_s
        server = await self._choose(deadline)
        server.work, server.in_flight = server.work + work, server.in_flight + 1
        attempts = self._attempts[request.key] = self._attempts.get(request.key, 0) + 1
        body = dict(prompts=[list(request.prompt_ids)], num_generations=request.num_generations,
                    sampling=sampling_fields(request.sampling),
                    seeds=None if request.seed is None else [int(request.seed)])
        if self.returns_routed_experts:  # sent only when asked: servers before it refuse the field
            body["return_routed_experts"] = True
        try:
            answer = await self._generate(server, body, deadline)
        except ServerUnreachable as err:
            if server.state == "live":
                server.state, server.checked_at = "down", time.monotonic()
                log.warning("rollout server %s is unreachable (%s): its groups are sampled again elsewhere",
                            server.url, err)
            self.groups_resubmitted += 1
            raise EngineUnavailable(f"group {request.key}: rollout server {server.url} was lost: {err}") from err
        finally:
            server.work, server.in_flight = server.work - work, server.in_flight - 1
        if answer["instance_id"] != server.inst.instance_id:
            server.state, server.info = "restarted", {"instance_id": answer["instance_id"]}
            self.groups_resubmitted += 1
            raise EngineUnavailable(f"group {request.key}: rollout server {server.url} restarted (instance "
                                    f"{answer['instance_id']}) before it got the current weights")
        self._attempts.pop(request.key, None)
        server.sampled += 1
        return SampledGroup(request=request, completions=sampled_completions(answer, self.eos_token_ids),
                            engine=server.url, attempts=attempts)

    async def _generate(self, server: PoolServer, body: dict, deadline: float) -> dict:
        """``/generate`` on ``server`` as a task :meth:`close` can cancel (then :class:`EngineUnavailable`)."""
        loop = asyncio.get_running_loop()
        task = loop.create_task(server.aio.request("POST", "/generate", body, deadline, retry=False))
        with self._tasks_lock:
            self._tasks[task] = loop
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self._closed and current is not None and not current.cancelling():
                raise EngineUnavailable("the server pool was closed while sampling") from None
            raise
        finally:
            with self._tasks_lock:
                self._tasks.pop(task, None)

    async def _choose(self, deadline: float) -> PoolServer:
        """The live server with the least work in flight; down servers are read again (at most every
        :data:`RECHECK_S`), a restarted one re-synced when it is the only way on (module docstring)."""
        while True:
            if any(self._due(s, time.monotonic()) for s in self.servers):
                await self._recheck()
            live = [s for s in self.servers if s.state == "live"]
            if live:
                return min(live, key=lambda s: (s.work, s.index))
            restarted = [s for s in self.servers if s.state == "restarted"]
            weights = self._weights  # None before the first update: the checkpoint's weights are the current ones
            if restarted and self.rank == 0 and (weights is None or not weights.collective):
                await asyncio.to_thread(self._resync, restarted, weights)
                continue
            if time.monotonic() >= deadline:
                states = ", ".join(f"{s.url}: {s.state}" for s in self.servers)
                raise RolloutServerError(f"no rollout server could sample for {self.timeout_s:g} s ({states}); "
                                         "restarted servers get the current weights at the next weight update")
            await asyncio.sleep(min(RECHECK_S, max(0.0, deadline - time.monotonic())))

    def _due(self, server: PoolServer, now: float) -> bool:
        """Whether ``server``'s ``/health`` is to be read again: it is down (or, off rank 0, restarted: rank 0
        re-syncs it) and was last read :data:`RECHECK_S` ago or more."""
        waiting = server.state == "down" or (server.state == "restarted" and self.rank != 0)
        return waiting and now - server.checked_at >= RECHECK_S

    async def _recheck(self) -> None:
        """Read the ``/health`` of the servers that are due (:meth:`_due`). On rank 0 the same instance is live again
        and a new one ``"restarted"``; elsewhere a server is live once it holds the current version (rank 0
        re-synced it)."""
        now = time.monotonic()
        due = [s for s in self.servers if self._due(s, now)]
        for s in due:
            s.checked_at = now
        infos = await asyncio.gather(*(s.aio.request("GET", "/health", deadline=now + 2.0, retry=False) for s in due),
                                     return_exceptions=True)
        for s, info in zip(due, infos, strict=True):
            if isinstance(info, BaseException) or not self._due(s, now + RECHECK_S):
                continue
            s.info = info
            if self.rank != 0:
                current = int(info["version"]) == max(self._version, 0)
                s.state = "live" if current else "restarted"
                s.inst.instance_id = info["instance_id"] if current else s.inst.instance_id
            else:
                s.state = "live" if info["instance_id"] == s.inst.instance_id else "restarted"
            log.warning("rollout server %s answers again (%s)", s.url, s.state)

    def _resync(self, servers: Sequence[PoolServer], weights: Optional[PolicyWeights]) -> None:
        """Rank 0, on a worker thread: a new weight-sync group with each restarted server and, when ``weights``,
        those weights as the current version; then they are live."""
        with self._sync_lock:
            deadline = time.monotonic() + self.timeout_s
            todo = [s for s in servers if s.state == "restarted"]
            for s in todo:
                info = s.inst.client.request("GET", "/health", deadline=deadline)
                self._init_group(s, info, deadline)
            if weights is not None and todo:
                push([s.inst for s in todo], weights, self._version, self.backend, deadline, "wait")
            for s in todo:
                s.state = "live"
                log.warning("rollout server %s re-synced (weights version %d)", s.url, max(self._version, 0))

    def _init_group(self, server: PoolServer, info: dict, deadline: float) -> None:
        assert self._store is not None
        init_group(server.inst, server.index, info, self._store, self.group_host, self.group_port, self.backend,
                   deadline)

    # ------------------------------------------------------------------ weights
    def update_weights(self, weights: PolicyWeights, version: int) -> WeightUpdate:
        """Give every reachable server ``weights`` as ``version`` without waiting for the groups in flight (rank 0
        streams; every trainer process calls this when ``weights.collective``, the others reading the sharded weights
        along). A server that restarted gets a new weight-sync group first; an unreachable one is left out (it gets
        the weights when it is back).

        Raises:
            RolloutServerError: the transfer failed (the servers are named).
            ValueError: a separately trained head for servers with tied embeddings.
        """
        start = time.monotonic()
        self._weights = weights
        paused, engines = 0.0, 0
        if self.rank == 0:
            check_tied_engine(weights, self.tie_word_embeddings)
            with self._sync_lock:
                targets = self._reachable(time.monotonic() + self.timeout_s)
                if targets:
                    _, answers = push([s.inst for s in targets], weights, version, self.backend,
                                      time.monotonic() + self.timeout_s, self.mode)
                    paused, engines = max(float(a["paused_s"]) for a in answers), len(targets)
                    for s in targets:
                        s.state = "live"
        elif weights.collective:
            for _ in weights.tensors():  # the gathers are collectives
                pass
        self._version = int(version)
        if self.weight_sync_check is not None:
            self._check(weights, [s for s in self.servers if s.state == "live"] if self.rank == 0 else [])
        return WeightUpdate(version=int(version), seconds=time.monotonic() - start, paused_s=paused, engines=engines)

    def _check(self, weights: PolicyWeights, servers: Sequence[PoolServer]) -> None:
        """The post-sync check (module docstring) against ``servers`` (rank 0; none elsewhere): the policy's probe
        logprobs (a collective when ``weights.collective``), each server's, and the processes' agreement on the
        largest difference.

        Raises:
            RolloutServerError: a difference over ``weight_sync_check`` (the server, the difference, the bound and the
                version named), or the check failed on another process.
        """
        assert self.weight_sync_check is not None
        sequences = probe_sequences(min(self.vocab_size, weights.vocab_size or self.vocab_size))
        ours = weights.probe_logprobs(sequences)
        worst, where, failure = 0.0, "", 0.0
        error: Optional[BaseException] = None
        try:
            deadline = time.monotonic() + self.timeout_s
            for s in servers:
                answer = s.inst.client.request("POST", "/probe_logprobs", {"sequences": sequences}, deadline)
                diff = float((torch.tensor(answer["logprobs"], dtype=torch.float32) - ours.float().cpu()).abs().max())
                if diff > worst or not where:
                    worst, where = diff, s.url
        except Exception as err:  # noqa: BLE001 - raised below, after the other processes learn of it
            failure, error = 1.0, err
        failure, worst = _agree(failure, worst)
        if error is not None:
            raise error
        if failure:
            raise RolloutServerError(f"the post-sync check of weights version {self._version} failed on another "
                                     "trainer process")
        if worst > self.weight_sync_check:
            raise RolloutServerError(
                f"post-sync check failed for weights version {self._version}: the rollout server's logprobs of the "
                f"probe batch differ from the policy's by up to {worst:.3g} > engine.weight_sync_check="
                f"{self.weight_sync_check:g} (at {where}): the server is not sampling with the trained weights")

    def _reachable(self, deadline: float) -> list[PoolServer]:
        """The servers that answer ``/health`` now, each restarted one with a new weight-sync group."""
        targets = []
        for s in self.servers:
            try:
                info = s.inst.client.request("GET", "/health", deadline=min(deadline, time.monotonic() + 5.0),
                                             retry=False)
            except RolloutServerError as err:
                s.state, s.checked_at = "down", time.monotonic()
                log.warning("rollout server %s left out of weight update (%s)", s.url, err)
                continue
            if info["instance_id"] != s.inst.instance_id:
                log.warning("rollout server %s restarted (instance %s -> %s): new weight-sync group", s.url,
                            s.inst.instance_id, info["instance_id"])
                s.state = "restarted"
                self._init_group(s, info, deadline)
            targets.append(s)
        return targets

    # ------------------------------------------------------------------ lifecycle
    def stats(self) -> dict[str, float]:
        """The pool's counters: ``groups_resubmitted``, ``servers_live``, and per server ``groups_sampled/<i>`` (the
        server's index in ``urls``)."""
        out = {"groups_resubmitted": float(self.groups_resubmitted),
               "servers_live": float(sum(s.state == "live" for s in self.servers))}
        out.update({f"groups_sampled/{s.index}": float(s.sampled) for s in self.servers})
        return out

    def close(self) -> None:
        """Stop sampling (the groups in flight raise :class:`EngineUnavailable`), leave the weight-sync groups (the
        servers keep running) and stop listening on the group port."""
        self._closed = True
        with self._tasks_lock:
            tasks = list(self._tasks.items())
        for task, loop in tasks:
            loop.call_soon_threadsafe(task.cancel)
        if self.rank == 0:
            for s in self.servers:
                if s.state == "down":
                    continue
                try:
                    s.inst.client.request("POST", "/close_weight_sync", {}, time.monotonic() + min(5.0, self.timeout_s),
                                          retry=False)
                except RolloutServerError as err:
                    log.warning("closing the weight-sync group of %s: %s", s.url, err)
                s.inst.group = None
        self._store = None



def _agree(failure: float, worst: float) -> tuple[float, float]:
    """The max of ``failure`` and ``worst`` over the trainer's processes (each calls it in the same update)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return failure, worst
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    values = torch.tensor([failure, worst], dtype=torch.float64, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return float(values[0]), float(values[1])


def make_pool(spec: EngineSpec) -> ServerPool:
    """``streaming.enabled`` with ``engine.name="vllm_server"``: the pool of the servers at ``engine.server_urls``,
    with the settings the fixed schedule's engine reads (:func:`lightning_grpo.rollout.server.remote.make`):
    ``engine.server_timeout``, ``engine.server_group_host`` and ``engine.server_group_port``, the shared secret
    (``$LIGHTNING_GRPO_SERVER_SECRET`` or ``engine.server_secret_file``) and ``engine.weight_sync_check``; routing
    replay "R3" (``spec.routing``) asks every server for the routed experts. Its
    weights come from the trainer before the first group (as the trainer's optimizer steps: ``update_weights``).

    Raises:
        ValueError, RolloutServerError: as :class:`ServerPool`; an unreadable secret file (named).
    """
    engine = spec.config.engine
    secret = read_secret(engine.server_secret_file, "engine.server_secret_file")
    return ServerPool(engine.server_urls, timeout_s=engine.server_timeout, group_host=engine.server_group_host,
                      group_port=engine.server_group_port, secret=secret, weight_sync_check=engine.weight_sync_check,
                      record_routing=spec.routing is not None)
