"""``engine.name="vllm_server"``: rollouts from one or more rollout servers
(:mod:`lightning_grpo.rollout.server.app`).

* **Generation**: a ``generate`` call's prompts are split into contiguous, near-equal parts, one per server
  instance (each prompt's G completions come from one instance: whole groups), sent in parallel and put back in
  prompt order. Per-request seeds are the colocated engine's (``sampling.seed + i * G`` for the prompt at index
  ``i`` of the whole call), so the completions do not depend on how the prompts were split. The sampler logprobs
  are the server engine's processed logprobs (:mod:`lightning_grpo.rollout.engines.vllm.colocated`). Each rollout
  carries the version of the weights that produced it (``RolloutOutput.weight_version``).
* **Weight sync** (:meth:`VLLMServerEngine.sync_weights`, every ``engine.sync_every`` optimizer steps): the
  trainer's global rank 0 streams the policy's weights as the backend gives them
  (:class:`~lightning_grpo.protocols.weights.PolicyWeights`: FSDP full tensors gathered one at a time, LoRA merged,
  ``lm_head`` included for tied embeddings, as to the colocated engine) to every instance over its own
  ``torch.distributed`` group (:mod:`lightning_grpo.rollout.server.weight_sync`); the version goes up by one per
  sync. The other ranks read sharded weights along (the gathers are collectives) and wait on the trainer's default
  group, so that no rank generates with the old weights. With ``engine.weight_sync_check`` the server's
  teacher-forced logprobs of a fixed probe batch are compared with the policy's own (``PolicyWeights.
  probe_logprobs``) and a difference above the bound is an error on every rank.
* **Restarts and timeouts**: before each request to an instance its ``/health`` is read; a new ``instance_id``
  means the instance restarted (checkpoint weights, version 0): rank 0 forms a new weight-sync group with it
  and re-sends the weights given to the last sync (read again: the policy's current weights, newer than the
  other instances' when ``engine.sync_every > 1``) before using it; other ranks wait until it has the current
  version. Sharded (collective) weights can only be re-sent by a sync, which every rank joins: an instance that
  restarts between syncs is then an error. Unreachable servers are retried with backoff
  (:class:`~lightning_grpo.rollout.server.client.ServerClient`); after ``engine.server_timeout`` seconds the error
  names the URL and the timeout. The process groups have the same timeout: nothing waits forever.
* **Security**: every request carries the servers' shared secret (``$LIGHTNING_GRPO_SERVER_SECRET`` or
  ``engine.server_secret_file``, read here and never logged or stored in the config); the weight-sync store listens
  on ``engine.server_group_host`` only, and each group's key prefix is random and sent only in the authenticated
  ``/init_weight_sync`` (:mod:`lightning_grpo.rollout.server.weight_sync`).
* **Request size**: a server takes at most its ``max_request_tokens`` of work per request (``/health``); an
  instance's part of a call is sent as consecutive requests that each fit (the per-completion seeds are unchanged,
  so the completions are the same).
* **Routing replay "R3"** (``record_routing``: a mixture-of-experts policy): every server must have been started with
  ``--record-routing`` (its ``/health`` says so, checked at start); each request asks for the routed experts, which
  come back among the answer's per-token ``extra`` fields and become the rollout's ``prompt_routed_experts`` /
  ``completion_routed_experts`` (:mod:`lightning_grpo.rollout.engines.routed_rows`).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from lightning_grpo.protocols.engine import EngineCapabilities
from lightning_grpo.protocols.rollout import RolloutOutput, StopFlag
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.protocols.vision import RowImages
from lightning_grpo.protocols.weights import PolicyWeights, check_tied_engine
from lightning_grpo.rollout.engine_registry import EngineSpec
from lightning_grpo.rollout.engines.multimodal import check_expansions, wire_images
from lightning_grpo.rollout.engines.probe import probe_batch
from lightning_grpo.rollout.engines.routed_rows import routing_from_extra
from lightning_grpo.rollout.engines.rows import check_prompts, request_seeds, rollout_from_rows
from lightning_grpo.rollout.server.client import RolloutServerError, ServerClient
from lightning_grpo.rollout.server.security import read_secret
from lightning_grpo.rollout.server.sync_groups import Instance, init_group, push
from lightning_grpo.rollout.server.weight_sync import host_store
from lightning_grpo.rollout.server.wire import sampling_fields

log = logging.getLogger(__name__)


def split_evenly(count: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ``[start, stop)`` ranges covering ``range(count)``, sizes differing by at most one
    (the first ones larger)."""
    base, extra = divmod(count, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return list(zip(bounds[:-1], bounds[1:], strict=True))


class VLLMServerEngine:
    """A :class:`~lightning_grpo.protocols.engine.RolloutEngine` whose rollouts come from rollout servers.

    Args:
        urls: the servers' base URLs (``http://host:port``), one per instance.
        tokenizer: the policy's tokenizer (decodes the completions).
        timeout_s: ``engine.server_timeout``: most seconds any request or weight transfer may take.
        group_host: the address of this trainer's global rank 0 that the servers connect to for the weight-sync
            groups; None = ``$MASTER_ADDR``, else 127.0.0.1.
        group_port: the port rank 0 listens on for them (one for every instance).
        weight_sync_check: bound on the max absolute difference of the probe logprobs after a sync; None = off.
        secret: the servers' shared secret (None: servers without one, on the loopback interface).
        stop: polled while waiting for the servers; once set, ``generate`` raises
            :class:`~lightning_grpo.protocols.rollout.RolloutInterrupted` (the servers finish and are ignored).
        record_routing: the rollouts carry the routed experts (routing replay "R3"; servers started with
            ``--record-routing``).

    Raises:
        ValueError: no URL, a malformed URL or one given twice (``engine.server_urls``), a group port in use
            (``engine.server_group_port``), instances that disagree on the tokenizer ids or lengths (named), or,
            with ``record_routing``, an instance that does not record the routing (named).
        RolloutServerError: an instance does not answer within ``timeout_s`` or refuses the secret.
    """

    def __init__(self, urls: Sequence[str], tokenizer: Any, *, timeout_s: float = 600.0,
                 group_host: Optional[str] = None, group_port: int = 51216,
                 weight_sync_check: Optional[float] = None, secret: Optional[str] = None,
                 stop: Optional[StopFlag] = None, record_routing: bool = False) -> None:
        if not urls:
            raise ValueError("urls is empty: give the rollout servers' URLs (GRPOConfig.engine.server_urls)")
        if len({u.rstrip("/") for u in urls}) != len(urls):
            raise ValueError(f"urls {list(urls)} name a server twice: each instance holds one weight-sync group")
        self.tokenizer = tokenizer
        self.timeout_s = float(timeout_s)
        self.weight_sync_check = weight_sync_check
        self.last_sync_check: Optional[float] = None  # the difference the last post-sync check measured
        self.stop = stop if stop is not None else StopFlag()
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.instances = [Instance(ServerClient(url, timeout_s, secret)) for url in urls]
        self.version = 0
        self._weights: Optional[PolicyWeights] = None  # given to the last sync (re-sent to a restarted instance)
        self.group_host = group_host or os.environ.get("MASTER_ADDR", "127.0.0.1")
        self.group_port = int(group_port)
        self._store = host_store(self.group_host, self.group_port, self.timeout_s) if self.rank == 0 else None
        deadline = time.monotonic() + self.timeout_s
        infos = [inst.client.request("GET", "/health", deadline=deadline) for inst in self.instances]
        for key in ("eos_token_ids", "pad_token_id", "max_model_len", "tie_word_embeddings", "device"):
            values = {inst.client.url: info[key] for inst, info in zip(self.instances, infos, strict=True)}
            if len({repr(v) for v in values.values()}) > 1:
                raise ValueError(f"the rollout servers disagree on {key}: {values}; serve one model everywhere")
        info = infos[0]
        self.eos_token_ids = [int(i) for i in info["eos_token_ids"]]
        self.pad_token_id = int(info["pad_token_id"])
        self.max_model_len = int(info["max_model_len"])
        self.tie_word_embeddings = bool(info["tie_word_embeddings"])
        self.max_request_tokens = min(int(i["max_request_tokens"]) for i in infos)
        image_ids = {i.get("image_token_id") for i in infos}  # None: text models (or servers before images)
        self.placeholder_id: Optional[int] = next(iter(image_ids)) if len(image_ids) == 1 else None
        self.backend = "nccl" if info["device"] == "cuda" and torch.cuda.is_available() else "gloo"
        not_recording = [inst.client.url for inst, i in zip(self.instances, infos, strict=True)
                         if not i.get("records_routing")]
        if record_routing and not_recording:
            raise ValueError(f"routing replay 'R3' needs the routed experts, but the rollout servers {not_recording} "
                             "do not record them: start them with lightning-grpo serve --record-routing")
        self.record_routing = record_routing
        #: The servers hold their own copy of the weights and sample every completion with its own seed; every trainer
        #: process calls :meth:`sync_weights` (global rank 0 streams, the others wait); with ``record_routing`` the
        #: rollouts carry the routed experts; they take images when they serve a vision-language model (their /health
        #: names its image token).
        self.capabilities = EngineCapabilities(seeds_per_request=True, sync_is_collective=True,
                                               returns_routed_experts=record_routing,
                                               accepts_images=self.placeholder_id is not None)
        for inst, inst_info in zip(self.instances, infos, strict=True):
            inst.instance_id, inst.version = inst_info["instance_id"], int(inst_info["version"])
            if self.rank == 0:
                self._init_group(inst, inst_info, deadline)

    # ------------------------------------------------------------------ generation
    def set_lockstep(self, enabled: bool) -> None:
        """Nothing to do: the servers' forward passes are their own."""

    def generate(self, prompt_ids: Sequence[Sequence[int]], num_generations: int,
                 sampling: SamplingConfig, images: Sequence[RowImages] = ()) -> RolloutOutput:
        """Sample ``num_generations`` completions per prompt on the servers (see the module docstring). With
        ``images`` (a vision-language model) each prompt goes with its pictures as PNG and its placeholder runs
        collapsed; the servers' expansion must give back ``prompt_ids``.

        Returns:
            As :meth:`lightning_grpo.rollout.engines.vllm.colocated.VLLMRolloutEngine.generate`, with
            ``weight_version`` set.

        Raises:
            ValueError: bad prompts (as the colocated engine); images for servers without images, or an expansion
                of the placeholders other than the prompt's.
            RolloutServerError: an instance failed or did not answer within the timeout.
            RolloutInterrupted: the stop flag was set while waiting.
        """
        prompts = check_prompts(prompt_ids, num_generations, sampling, self.max_model_len)
        seeds = request_seeds(sampling, len(prompts), num_generations)
        wire = wire_images(prompts, images, self.placeholder_id) if any(images) else None
        parts = [(inst, a, b) for inst, (a, b) in zip(self.instances, split_evenly(len(prompts), len(self.instances)),
                                                       strict=True) if b > a]
        pool = concurrent.futures.ThreadPoolExecutor(len(parts), thread_name_prefix="rollout-server")
        try:
            futures = [pool.submit(self._generate_on, inst, prompts[a:b], num_generations, sampling,
                                   None if seeds is None else seeds[a:b], None if wire is None else wire[a:b])
                       for inst, a, b in parts]
            pending = set(futures)
            while pending:
                self.stop.check("the rollout on the rollout servers")
                _, pending = concurrent.futures.wait(pending, timeout=0.1)
            answers = [f.result() for f in futures]
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        rows: list = [row for answer in answers for row in zip(answer["token_ids"], answer["logprobs"], strict=True)]
        if self.record_routing:
            fields = [f for answer in answers for f in routing_from_extra(answer["extra"], len(answer["token_ids"]))]
            rows = [(*row, routed) for row, routed in zip(rows, fields, strict=True)]
        version = min(int(answer["version"]) for answer in answers)
        if wire is not None:
            check_expansions([ids for answer in answers for ids in answer["prompt_token_ids"]], prompts)
        return rollout_from_rows(prompts, rows, num_generations, self.pad_token_id, self.eos_token_ids,
                                 self.tokenizer, weight_version=version, images=images)

    def _generate_on(self, inst: Instance, prompts: list[list[int]], num_generations: int, sampling: SamplingConfig,
                     seeds: Optional[list[int]], wire: Optional[list[tuple[list[int], list[str]]]] = None) -> dict:
        fields = sampling_fields(sampling)
        deadline = inst.client.deadline()
        answers = []
        for a, b in self._request_parts([len(p) for p in prompts], num_generations, sampling.max_new_tokens):
            body = dict(prompts=prompts[a:b], num_generations=num_generations, sampling=fields,
                        seeds=None if seeds is None else seeds[a:b])
            if self.record_routing:  # sent only when asked: servers before it refuse the field
                body["return_routed_experts"] = True
            if wire is not None:
                body.update(prompts=[ids for ids, _ in wire[a:b]], images=[pics for _, pics in wire[a:b]])
            while True:
                self._ensure_current(inst, deadline)
                answer = inst.client.request("POST", "/generate", body, deadline)
                if answer["instance_id"] == inst.instance_id and int(answer["version"]) == self.version:
                    break
                log.warning("rollout server %s changed while generating (instance %s, version %s; expected %s, %s): "
                            "generating again", inst.client.url, answer["instance_id"], answer["version"],
                            inst.instance_id, self.version)
            answers.append(answer)
        extra = {name: [v for answer in answers for v in answer["extra"][name]] for name in answers[0].get("extra", {})}
        return dict(token_ids=[ids for answer in answers for ids in answer["token_ids"]],
                    logprobs=[lp for answer in answers for lp in answer["logprobs"]], version=answers[0]["version"],
                    instance_id=answers[0]["instance_id"], extra=extra,
                    prompt_token_ids=[ids for answer in answers for ids in answer.get("prompt_token_ids", [])])

    def _request_parts(self, lengths: Sequence[int], num_generations: int,
                       max_new_tokens: int) -> list[tuple[int, int]]:
        """Consecutive ``[start, stop)`` ranges of the prompts, each as many prompts as fit in the servers'
        ``max_request_tokens`` of work (``num_generations * (prompt + max_new_tokens)`` per prompt).

        Raises:
            ValueError: one prompt alone is over the limit (its index, work and the limit are named).
        """
        parts, start, work = [], 0, 0
        for i, length in enumerate(lengths):
            cost = num_generations * (length + max_new_tokens)
            if cost > self.max_request_tokens:
                raise ValueError(f"prompt_ids[{i}]: {num_generations} completions x ({length} prompt tokens + "
                                 f"max_new_tokens={max_new_tokens}) = {cost} tokens of work, over the rollout "
                                 f"servers' max_request_tokens={self.max_request_tokens} (lightning-grpo serve "
                                 "--max-request-tokens)")
            if work + cost > self.max_request_tokens:
                parts.append((start, i))
                start, work = i, 0
            work += cost
        parts.append((start, len(lengths)))
        return parts

    # ------------------------------------------------------------------ restarts
    def _ensure_current(self, inst: Instance, deadline: float) -> None:
        """Make sure ``inst`` is the instance this trainer synced and holds the current version: repair it on rank
        0 (new group, weights re-sent), wait for that on the other ranks."""
        info = inst.client.request("GET", "/health", deadline=deadline)
        if info["instance_id"] == inst.instance_id and int(info["version"]) == self.version:
            return
        if self.rank != 0:
            self._wait_for_version(inst, deadline)
            return
        with inst.lock:
            info = inst.client.request("GET", "/health", deadline=deadline)
            if info["instance_id"] != inst.instance_id:
                log.warning("rollout server %s restarted (instance %s -> %s): new weight-sync group, weights "
                            "version %d re-sent", inst.client.url, inst.instance_id, info["instance_id"], self.version)
                self._init_group(inst, info, deadline)
            if int(info["version"]) != self.version:
                if self._weights is None:
                    raise RolloutServerError(
                        f"rollout server {inst.client.url} holds weights version {info['version']} but this trainer "
                        f"has synced none yet (version {self.version}): call sync_weights before generating")
                if self._weights.collective:
                    raise RolloutServerError(
                        f"rollout server {inst.client.url} restarted between weight syncs and the policy is sharded "
                        "(FSDP, Megatron): its weights can only be re-sent by a sync, which every rank joins")
                self._push([inst], self._weights, deadline)

    def _wait_for_version(self, inst: Instance, deadline: float) -> None:
        while True:
            info = inst.client.request("GET", "/health", deadline=deadline)
            if int(info["version"]) == self.version:
                inst.instance_id = info["instance_id"]
                return
            if time.monotonic() + 0.2 > deadline:
                raise RolloutServerError(
                    f"rollout server {inst.client.url} holds weights version {info['version']}, not {self.version}, "
                    f"and rank 0 did not re-send them within engine.server_timeout={self.timeout_s:g} s")
            time.sleep(0.2)

    def _init_group(self, inst: Instance, info: dict, deadline: float) -> None:
        """Form a new weight-sync group with ``inst`` (rank 0 only): the server's workers join it while this
        process does."""
        assert self._store is not None
        init_group(inst, self.instances.index(inst), info, self._store, self.group_host, self.group_port,
                   self.backend, deadline)

    # ------------------------------------------------------------------ weights
    def _push(self, instances: Sequence[Instance], weights: PolicyWeights, deadline: float) -> int:
        """Stream ``weights`` to ``instances`` as version ``self.version`` (rank 0)."""
        check_tied_engine(weights, self.tie_word_embeddings)  # before the servers start waiting for a stream
        return push(instances, weights, self.version, self.backend, deadline)[0]

    def sync_weights(self, weights: PolicyWeights) -> None:
        """Send the policy's weights to every instance as the next version (rank 0 sends; every rank calls this, the
        others read sharded weights along and wait), then run the post-sync check when ``engine.weight_sync_check``
        is set.

        Raises:
            RolloutServerError: the transfer failed on some instance, or the check found a logprob difference above
                ``engine.weight_sync_check`` (the instance, the difference and the bound are named); on every rank.
        """
        self.version += 1
        self._weights = weights
        failure, worst, where = 0.0, 0.0, ""
        error: Optional[BaseException] = None
        try:
            if self.rank == 0:
                self._send_to_all(weights)
            elif weights.collective:
                for _ in weights.tensors():  # the gathers are collectives
                    pass
            if self.weight_sync_check is not None:
                worst, where = self._check(weights)
        except Exception as err:  # noqa: BLE001 - raised below, after the other ranks learn of it
            failure, error = 1.0, err
        failure, worst = self._agree(failure, worst)
        self.last_sync_check = worst if self.weight_sync_check is not None else None
        if error is not None:
            raise error
        if failure:
            raise RolloutServerError(f"the weight sync of version {self.version} failed on another rank")
        if self.weight_sync_check is not None and worst > self.weight_sync_check:
            raise RolloutServerError(
                f"post-sync check failed for weights version {self.version}: the rollout server's logprobs of the "
                f"probe batch differ from the policy's by up to {worst:.3g} > engine.weight_sync_check="
                f"{self.weight_sync_check:g}{where}: the server is not generating with the trained weights")

    def _send_to_all(self, weights: PolicyWeights) -> None:
        """Rank 0: a new group with each instance that restarted, then the weights to all of them."""
        deadline = time.monotonic() + self.timeout_s
        for inst in self.instances:
            info = inst.client.request("GET", "/health", deadline=deadline)
            if info["instance_id"] != inst.instance_id:
                log.warning("rollout server %s restarted (instance %s -> %s): new weight-sync group",
                            inst.client.url, inst.instance_id, info["instance_id"])
                self._init_group(inst, info, deadline)
        self._push(self.instances, weights, deadline)

    def _check(self, weights: PolicyWeights) -> tuple[float, str]:
        """The largest |server - policy| probe logprob difference over the instances (rank 0; 0 elsewhere), and
        which instance has it (the policy's probe logprobs are a collective when ``weights.collective``)."""
        sequences = probe_batch(weights, len(self.tokenizer))
        ours = weights.probe_logprobs(sequences)
        worst, where = 0.0, ""
        if self.rank == 0:
            for inst in self.instances:
                answer = inst.client.request("POST", "/probe_logprobs", {"sequences": sequences})
                diff = float((torch.tensor(answer["logprobs"], dtype=torch.float32) - ours).abs().max())
                if diff > worst or not where:
                    worst, where = diff, f" (at {inst.client.url})"
        return worst, where

    def _agree(self, failure: float, worst: float) -> tuple[float, float]:
        """The max of ``failure`` and ``worst`` over the trainer's ranks (also the barrier of the sync)."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return failure, worst
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
        values = torch.tensor([failure, worst], dtype=torch.float64, device=device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        return float(values[0]), float(values[1])

    # ------------------------------------------------------------------ lifecycle
    def wake_up(self) -> None:
        """A no-op: the servers keep their engines."""

    def sleep(self, level: int = 1) -> None:
        """A no-op: the servers keep their engines."""

    def close(self) -> None:
        """Leave the weight-sync groups (the servers keep running) and stop listening on the group port."""
        if self.rank == 0:
            for inst in self.instances:
                try:
                    inst.client.request("POST", "/close_weight_sync", {}, time.monotonic() + min(5.0, self.timeout_s))
                except RolloutServerError as err:
                    log.warning("closing the weight-sync group of %s: %s", inst.client.url, err)
                inst.group = None
        self._store = None


def make(spec: EngineSpec) -> VLLMServerEngine:
    """The "vllm_server" engine of the registry: the rollout servers at ``config.engine.server_urls``, which get the
    weights by :meth:`VLLMServerEngine.sync_weights` (before the first rollout too); with ``spec.routing`` (routing
    replay "R3" on a mixture of experts) the rollouts carry the routed experts."""
    engine = spec.config.engine
    secret = read_secret(engine.server_secret_file, "engine.server_secret_file")
    return VLLMServerEngine(engine.server_urls, spec.tokenizer, timeout_s=engine.server_timeout,
                            group_host=engine.server_group_host, group_port=engine.server_group_port,
                            weight_sync_check=engine.weight_sync_check, secret=secret, stop=spec.stop,
                            record_routing=spec.routing is not None)
