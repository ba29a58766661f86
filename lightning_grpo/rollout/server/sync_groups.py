"""The trainer's rank 0 and several rollout servers: one weight-sync group per server instance, formed over the
store rank 0 hosts, and the weights pushed to all of them at once (the fixed schedule's
:class:`~lightning_grpo.rollout.server.remote.VLLMServerEngine` and the streaming
:class:`~lightning_grpo.rollout.server.server_pool.ServerPool` both use it; the groups and the wire format are
:mod:`lightning_grpo.rollout.server.weight_sync`'s).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.distributed as dist

from lightning_grpo.protocols.weights import PolicyWeights
from lightning_grpo.rollout.server.client import RolloutServerError, ServerClient
from lightning_grpo.rollout.server.weight_sync import group_prefix, make_group, send_weights


@dataclass
class Instance:
    """What the trainer knows of one server instance."""

    client: ServerClient
    instance_id: str = ""
    version: int = 0
    group: Any = None
    groups_made: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


def init_group(inst: Instance, index: int, info: dict, store: dist.TCPStore, host: str, port: int, backend: str,
               deadline: float) -> None:
    """Form a new weight-sync group with ``inst`` (rank 0 only): the server's workers join it (``/init_weight_sync``
    with a new random prefix) while this process does; ``info`` is the instance's ``/health`` (its id and version are
    recorded).

    Raises:
        RolloutServerError: the server did not join before ``deadline`` (the store's address is named).
    """
    inst.groups_made += 1
    prefix = group_prefix(index)
    timeout = max(1.0, deadline - time.monotonic())
    world_size = 1 + int(info["world_size"])
    body = dict(host=host, port=port, prefix=prefix, world_size=world_size, backend=backend, timeout_s=timeout)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(inst.client.request, "POST", "/init_weight_sync", body, deadline, idempotent=False)
        try:
            group = make_group(store, prefix, 0, world_size, backend, timeout)
        except Exception as err:
            detail = answer.exception() if answer.done() else "no answer"
            raise RolloutServerError(
                f"rollout server {inst.client.url} did not join the weight-sync group at {host}:{port} within "
                f"{timeout:.0f} s ({err}; server: {detail}); the servers must reach that address "
                "(GRPOConfig.engine.server_group_host / engine.server_group_port)") from err
        answer.result()
    inst.group, inst.instance_id, inst.version = group, info["instance_id"], int(info["version"])


def push(instances: Sequence[Instance], weights: PolicyWeights, version: int, backend: str, deadline: float,
         mode: str = "wait") -> tuple[int, list[dict]]:
    """Stream ``weights`` to ``instances`` as ``version`` (rank 0): each gets ``/update_weights`` (``mode``: "wait"
    for the sequences in flight, or "interrupt" them) while the tensors are broadcast over all their groups at once.
    Returns the number of tensors sent and the instances' answers (``num_tensors``, ``paused_s``, ...).

    Raises:
        RolloutServerError: the broadcast failed, or an instance received another number of tensors (named).
    """
    device = weights.device if backend == "nccl" else torch.device("cpu")
    with concurrent.futures.ThreadPoolExecutor(len(instances)) as pool:
        body: dict[str, Any] = {"version": version}
        if mode != "wait":  # sent only when not the default: servers before it refuse the field
            body["mode"] = mode
        answers = [pool.submit(inst.client.request, "POST", "/update_weights", body, deadline, idempotent=False)
                   for inst in instances]
        try:
            count = send_weights([inst.group for inst in instances], weights.tensors(), device)
        except Exception as err:
            urls = ", ".join(inst.client.url for inst in instances)
            raise RolloutServerError(f"sending weights version {version} to {urls} failed: {err}") from err
        results = []
        for inst, answer in zip(instances, answers, strict=True):
            result = answer.result()
            if result["num_tensors"] != count:
                raise RolloutServerError(f"rollout server {inst.client.url} received {result['num_tensors']} of "
                                         f"{count} weight tensors")
            inst.version = version
            results.append(result)
    return count, results
