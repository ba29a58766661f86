"""Weights from the trainer to a rollout server over ``torch.distributed``: the process group and the wire format.

One process group per server instance: the trainer's global rank 0 is its rank 0, the instance's vLLM workers
are ranks ``1 .. W`` (``W`` = the instance's tensor/pipeline-parallel world size). It is built directly on a
``TCPStore`` that the trainer's rank 0 hosts (:func:`host_store`; one port for every instance, each group under
its own key prefix), never through the trainer's default group: gloo on CPU, NCCL on CUDA.

Rendezvous security: the store listens on the one address the trainer chose (``engine.server_group_host``), not on
every interface, and each group's key prefix holds 128 random bits (:func:`group_prefix`) that travel only in the
authenticated ``/init_weight_sync`` request: a process that reaches the store's port but did not get the prefix
from the trainer cannot join a group (the store itself has no password; see docs/engines.md, "Security").

Wire format: the trainer streams ``(name, tensor)`` pairs one at a time (the model is never held in one buffer);
for each, three broadcasts from rank 0: a header (``HEADER_SLOTS`` int64: 1, dtype code, number of dims, name
length in bytes, then up to ``MAX_DIMS`` sizes), the UTF-8 name (uint8), the tensor itself. A header whose first
slot is 0 ends the stream. So the names, dtypes and shapes travel with the tensors, and the sender iterates the
model's weights once (under FSDP each parameter is gathered once).
"""

from __future__ import annotations

import datetime
import errno
import secrets
import socket
from typing import Any, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

#: dtypes a weight may have on the wire, by code (the header's second slot).
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8,
          torch.uint8, torch.bool)
MAX_DIMS = 8
HEADER_SLOTS = 4 + MAX_DIMS


def host_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """The ``TCPStore`` the trainer's rank 0 hosts for every instance's group, listening on ``host:port`` only (a
    socket bound here and handed to the store, which would otherwise listen on every interface).

    Raises:
        ValueError: the port is in use (``engine.server_group_port`` is named) or ``host`` is not an address of this
            machine (``engine.server_group_host``).
    """
    listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
    except OSError as err:
        listener.close()
        if err.errno == errno.EADDRINUSE:
            raise ValueError(f"engine.server_group_port={port} is in use on {host}: another trainer or program "
                             "listens there; choose a free port") from None
        raise ValueError(f"engine.server_group_host={host!r}, engine.server_group_port={port}: cannot listen there "
                         f"({err.strerror}); give an address of this machine that the servers reach") from None
    try:
        store = dist.TCPStore(host, port, None, True, datetime.timedelta(seconds=timeout_s),
                              wait_for_workers=False, master_listen_fd=listener.fileno(), use_libuv=True)
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the socket now and closes it when it is deleted
    return store


def group_prefix(index: int) -> str:
    """A new, unguessable key prefix for the weight-sync group of instance ``index`` (128 random bits)."""
    return f"lightning_grpo/{index}/{secrets.token_hex(16)}"


def join_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A server worker's client of the trainer's store at ``host:port``."""
    return dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout_s))


class WeightSyncTimeout(TimeoutError):
    """A weight-sync group did not form in time: some rank never joined its rendezvous (a server whose workers
    cannot reach ``engine.server_group_host:engine.server_group_port``, or a trainer that went away)."""


def make_group(store: dist.Store, prefix: str, rank: int, world_size: int, backend: str,
               timeout_s: float) -> Any:
    """A process group (``ProcessGroupGloo`` / ``ProcessGroupNCCL``) of ``world_size`` ranks that rendezvous under
    ``prefix`` in ``store``; blocks until every rank has joined, for at most ``timeout_s`` seconds. Its collectives
    time out after ``timeout_s`` as well (a ``torch.distributed`` error), so a peer that stops never hangs the other.
    (NCCL connects at its first collective, so there a missing rank fails that collective, after ``timeout_s``.)

    Raises:
        ValueError: a backend other than "gloo" and "nccl".
        WeightSyncTimeout: gloo: not every rank joined within ``timeout_s`` (the message names this rank, the world
            size and the timeout; never the prefix, which is the group's secret).
    """
    prefixed = dist.PrefixStore(prefix, store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        try:
            return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        except dist.DistStoreError:  # the rendezvous' wait for the other ranks' addresses timed out
            raise WeightSyncTimeout(
                f"the weight-sync group did not form: rank {rank} of {world_size} waited {timeout_s:g} s for the "
                "other ranks to join the rendezvous; each server's workers must reach the trainer's "
                "engine.server_group_host:engine.server_group_port") from None
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    raise ValueError(f"backend={backend!r}: choose 'gloo' (CPU) or 'nccl' (CUDA)")


def encode_header(name: str, tensor: Tensor) -> tuple[Tensor, Tensor]:
    """The header and name tensors (int64 ``(HEADER_SLOTS,)``, uint8 ``(len,)``) announcing ``tensor``.

    Raises:
        ValueError: a dtype not in :data:`DTYPES` or more than :data:`MAX_DIMS` dims.
    """
    if tensor.dtype not in DTYPES:
        raise ValueError(f"weight {name!r} has dtype {tensor.dtype}, which the weight sync does not send")
    if tensor.dim() > MAX_DIMS:
        raise ValueError(f"weight {name!r} has {tensor.dim()} dims; at most {MAX_DIMS} are sent")
    raw = name.encode()
    header = torch.zeros(HEADER_SLOTS, dtype=torch.int64)
    header[:4] = torch.tensor([1, DTYPES.index(tensor.dtype), tensor.dim(), len(raw)])
    header[4:4 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    return header, torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def decode_header(header: Tensor, name: Tensor) -> tuple[str, torch.dtype, tuple[int, ...]]:
    """``(name, dtype, shape)`` from :func:`encode_header`'s tensors."""
    values = header.tolist()
    return bytes(name.tolist()).decode(), DTYPES[values[1]], tuple(values[4:4 + values[2]])


def _broadcast(groups: Sequence[Any], tensor: Tensor) -> None:
    works = [group.broadcast(tensor, 0) for group in groups]
    for work in works:
        work.wait()


def send_weights(groups: Sequence[Any], weights: Iterable[tuple[str, Tensor]],
                 device: torch.device) -> int:
    """Broadcast every ``(name, tensor)`` of ``weights`` from rank 0 of each group (all groups get each tensor
    before the next is read), then the end marker. Tensors are sent from ``device`` (CPU for gloo, the trainer's
    CUDA device for NCCL). Returns the number of tensors sent."""
    count = 0
    for name, tensor in weights:
        header, raw = encode_header(name, tensor)
        _broadcast(groups, header.to(device))
        _broadcast(groups, raw.to(device))
        _broadcast(groups, tensor.detach().to(device).contiguous())
        count += 1
    _broadcast(groups, torch.zeros(HEADER_SLOTS, dtype=torch.int64, device=device))
    return count


def receive_weights(group: Any, device: torch.device) -> Iterator[tuple[str, Tensor]]:
    """Yield the ``(name, tensor)`` pairs rank 0 sends with :func:`send_weights` (tensors on ``device``), one at
    a time, until the end marker."""
    while True:
        header = torch.zeros(HEADER_SLOTS, dtype=torch.int64, device=device)
        _broadcast([group], header)
        if int(header[0]) == 0:
            return
        raw = torch.zeros(int(header[3]), dtype=torch.uint8, device=device)
        _broadcast([group], raw)
        name, dtype, shape = decode_header(header.cpu(), raw.cpu())
        tensor = torch.empty(shape, dtype=dtype, device=device)
        _broadcast([group], tensor)
        yield name, tensor
