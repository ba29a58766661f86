"""The vLLM worker extension of the rollout server: joins the trainer's weight-sync group and loads the weights it
streams (:mod:`lightning_grpo.rollout.server.weight_sync`); with ``--record-routing``, records the experts each token
is routed to (:mod:`lightning_grpo.rollout.engines.vllm.routing_capture`, called by name: the server's ``AsyncLLM``
runs its worker in another process, where a function sent by value would need vLLM's insecure serialization).

vLLM mixes :class:`WeightSyncWorkerExtension` into each of its workers (``vllm.LLM(worker_extension_cls=
"lightning_grpo.rollout.server.vllm_extension.WeightSyncWorkerExtension")``) and the server calls its methods on every
worker with ``LLM.collective_rpc`` (the design of TRL's ``trl vllm-serve`` extension, with torch's own process
groups so that it also runs on CPU with gloo). Weights are loaded with the worker's ``reload_weights`` (vLLM's
in-place reload, which redoes the CPU backend's pre-packing of GEMM weights, followed by the experts' packing of a
mixture of experts: :mod:`lightning_grpo.rollout.engines.vllm.moe_reload`), as the colocated engine does.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Callable, Optional

import torch

from lightning_grpo.rollout.engines.vllm import routing_capture
from lightning_grpo.rollout.engines.vllm.moe_reload import reload_policy_weights
from lightning_grpo.rollout.engines.vllm.runtime import quiet_known_reload_warnings
from lightning_grpo.rollout.server.routed_segments import PackedRows, pack_rows
from lightning_grpo.rollout.server.weight_sync import join_store, make_group, receive_weights

quiet_known_reload_warnings()  # in each vLLM worker that loads the streamed weights (vllm_runtime.RotaryReloadFilter)


class WeightSyncWorkerExtension:
    """Methods added to a vLLM worker (``self`` is the worker: ``rank``, ``device``, ``reload_weights``)."""

    weight_group: Optional[Any] = None
    device: torch.device  # the worker's (annotations only: vLLM refuses extension attributes the worker has)
    reload_weights: Callable[..., None]

    def init_weight_sync(self, host: str, port: int, prefix: str, world_size: int, backend: str,
                         timeout_s: float) -> int:
        """Join the group under ``prefix`` in the trainer's store at ``host:port`` as rank ``1 + worker rank``
        (blocks until the trainer joins, at most ``timeout_s``). Returns that rank."""
        self.close_weight_sync()
        rank = 1 + int(getattr(self, "rank", 0))
        store = join_store(host, port, timeout_s)
        self.weight_group = make_group(store, prefix, rank, world_size, backend, timeout_s)
        return rank

    def receive_weights(self) -> int:
        """Load the weights the trainer streams now; returns how many tensors arrived. When loading fails the
        rest of the stream is still received (so the trainer is not left waiting) before the error is raised."""
        group = self.weight_group
        if group is None:
            raise RuntimeError("no weight-sync group: the trainer must call /init_weight_sync first")
        device = self.device if backend_of(group) == "nccl" else torch.device("cpu")
        count = 0

        def counted() -> Any:
            nonlocal count
            for item in receive_weights(group, device):
                count += 1
                yield item

        stream = counted()
        try:
            reload_policy_weights(self, stream)  # the worker's reload, then a mixture of experts' CPU packing
        finally:
            for _ in stream:  # drain what the loader did not take (an error, or names it skipped)
                pass
        return count

    def stop_with_server(self, server_pid: int) -> int:
        """End this worker's process when the server's process ``server_pid`` ends, SIGKILL included (vLLM's engine
        core would otherwise outlive it, holding its memory): a daemon thread checks every 0.5 s; under vLLM's
        multiprocess executor the worker's parent, the engine core, is ended first. Returns this process's id."""

        engine_core = os.getppid()  # the server itself under vLLM's one-process executor

        def watch() -> None:
            while True:
                time.sleep(0.5)
                try:
                    os.kill(server_pid, 0)
                except ProcessLookupError:
                    if engine_core != server_pid and os.getppid() == engine_core:  # still alive: end it too
                        os.kill(engine_core, signal.SIGKILL)
                    os._exit(1)
                except PermissionError:  # the id now belongs to another user's process: the server is gone
                    os._exit(1)

        threading.Thread(target=watch, name="stop-with-server", daemon=True).start()
        return os.getpid()

    def install_routing_capture(self) -> tuple[int, int]:
        """Record this worker's routing (:func:`~lightning_grpo.rollout.engines.vllm.routing_capture.
        install_routing_capture`): ``(moe_layers, top_k)``."""
        return routing_capture.install_routing_capture(self)

    def take_routing(self, tags: list[str], release: list[str]) -> list[PackedRows]:
        """The routing of the requests tagged ``tags`` (each read once), after forgetting the tags ``release``
        (:meth:`~lightning_grpo.rollout.engines.vllm.routing_capture.RoutingCapturer.take`), packed for vLLM's RPC
        (:func:`~lightning_grpo.rollout.server.routed_segments.pack_rows`)."""
        routing_capture.release_routing(self, release)
        return [pack_rows(rows) for rows in routing_capture.take_routing(self, tags)]

    def release_routing(self, tags: list[str]) -> None:
        """Forget the tags ``tags`` (a failed request's)."""
        routing_capture.release_routing(self, tags)

    def clear_routing(self) -> None:
        """Forget the records as prefix-cache donors (the prefix cache was reset), keeping those not read yet."""
        routing_capture.clear_routing(self, keep_unread=True)

    def worker_moe_layer_ids(self) -> list[int]:
        """The decoder-layer indices of the model's MoE layers (vLLM's own routing record keeps those columns)."""
        return routing_capture.worker_moe_layer_ids(self)

    def close_weight_sync(self) -> None:
        """Leave the weight-sync group (a no-op without one)."""
        group, self.weight_group = self.weight_group, None
        if group is not None and hasattr(group, "shutdown"):
            group.shutdown()


def backend_of(group: Any) -> str:
    """"nccl" or "gloo": the backend of a group made by :func:`lightning_grpo.rollout.server.weight_sync.make_group`."""
    return "nccl" if type(group).__name__ == "ProcessGroupNCCL" else "gloo"
