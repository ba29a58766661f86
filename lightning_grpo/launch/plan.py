"""The wiring of a multi-node run: which node runs what, on which address and port, with which ranks.

A run is ``nodes`` trainer nodes of ``devices_per_node`` processes each (Lightning's ``--trainer.num_nodes`` and
``--trainer.devices``; torchrun's ``--nnodes`` / ``--nproc-per-node``; SLURM's ``--nodes`` / ``--ntasks-per-node``)
and ``servers`` rollout servers (``lightning-grpo serve``) spread evenly over ``server_nodes`` nodes of their own.
``hosts`` names every node, the trainer nodes first: the address the others reach it at. The trainer's global rank
0 runs on the first trainer node, which is ``MASTER_ADDR`` and also the weight-sync rendezvous
(``engine.server_group_host``): every server's workers connect back to it on ``group_port``, one
``torch.distributed`` group per server of ``1 +`` its workers ranks (rank 0 the trainer's global rank 0;
:mod:`lightning_grpo.rollout.server.weight_sync`).

Addresses: either every host is a loopback address (a rehearsal on one machine: ``127.0.0.1``, or distinct
``127.0.0.x`` per "node", all of which Linux routes to the loopback interface) or none is; servers that listen beyond
the loopback interface need the shared secret, so a plan with non-loopback hosts needs ``secret_file``
(:mod:`lightning_grpo.rollout.server.security`). Several servers on one host get consecutive ports from
``server_port``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, Optional

from lightning_grpo.config import EngineConfig
from lightning_grpo.rollout.server.security import is_loopback

#: torchrun's default rendezvous port (``MASTER_PORT``).
DEFAULT_MASTER_PORT = 29500
#: ``lightning-grpo serve``'s default HTTP port.
DEFAULT_SERVER_PORT = 8000
#: ``engine.server_group_port``'s default (the weight-sync rendezvous on the trainer's rank 0).
DEFAULT_GROUP_PORT = EngineConfig.server_group_port
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.:-]+)$")


@dataclass(frozen=True)
class TrainerNode:
    """One trainer node: its torchrun ``--node-rank`` (SLURM's ``SLURM_NODEID``), its address, and the global ranks
    of its processes (``node_rank * devices_per_node + local_rank``)."""

    node_rank: int
    host: str
    global_ranks: tuple[int, ...]


@dataclass(frozen=True)
class ServerSpec:
    """One rollout server: ``index`` is its place in ``engine.server_urls`` (and of its weight-sync group), ``node``
    the server node it runs on, ``gpus`` the node's CUDA devices it uses (empty on CPU)."""

    index: int
    node: int
    host: str
    port: int
    gpus: tuple[int, ...]

    @property
    def url(self) -> str:
        """``http://host:port`` (an IPv6 address in brackets)."""
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"http://{host}:{self.port}"


@dataclass(frozen=True)
class WeightSyncGroup:
    """The weight-sync group of one server: rendezvous at ``host:port`` (a ``TCPStore`` the trainer's global rank 0
    hosts, one port for every group), ``world_size`` ranks: the trainer's global rank 0 and the server's workers."""

    server_url: str
    host: str
    port: int
    world_size: int


@dataclass(frozen=True)
class LaunchPlan:
    """Trainer nodes, rollout servers, their addresses, ports and ranks (see the module docstring).

    Args:
        nodes: trainer nodes (>= 1).
        devices_per_node: trainer processes per node, one per device (>= 1).
        servers: rollout servers (>= 1), ``servers / server_nodes`` on each server node.
        server_nodes: nodes that run only rollout servers (>= 1; ``servers`` must be a multiple).
        hosts: every node's address, the ``nodes`` trainer nodes first, then the server nodes; one entry = every node
            on that one host.
        accelerator: "gpu" (servers split their node's GPUs) or "cpu".
        server_gpus: GPUs per server (its ``--tensor-parallel-size``); None = the node's ``devices_per_node`` GPUs
            split evenly over its servers. GPU only.
        master_port: ``MASTER_PORT`` of the trainer's processes, on the first trainer node.
        server_port: the first server port on each host.
        group_port: ``engine.server_group_port``, on the first trainer node.
        secret_file: the shared secret's file (absolute path), or None (loopback hosts only).

    Raises:
        ValueError: a count out of range, ``servers`` not a multiple of ``server_nodes``, ``hosts`` of the wrong
            length or a malformed host, loopback and other hosts mixed, more server GPUs than a node has, a port
            out of range or used twice on one host, or non-loopback hosts without ``secret_file`` (the option and
            value are named).
    """

    nodes: int
    devices_per_node: int
    servers: int
    server_nodes: int
    hosts: tuple[str, ...] = ("127.0.0.1",)
    accelerator: Literal["gpu", "cpu"] = "gpu"
    server_gpus: Optional[int] = None
    master_port: int = DEFAULT_MASTER_PORT
    server_port: int = DEFAULT_SERVER_PORT
    group_port: int = DEFAULT_GROUP_PORT
    secret_file: Optional[str] = None
    _servers: tuple[ServerSpec, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name, value in (("nodes", self.nodes), ("devices_per_node", self.devices_per_node),
                            ("servers", self.servers), ("server_nodes", self.server_nodes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')}={value!r}: must be an integer >= 1")
        if self.servers % self.server_nodes:
            raise ValueError(f"--servers={self.servers} over --server-nodes={self.server_nodes}: the servers are "
                             "spread evenly, so --servers must be a multiple of --server-nodes")
        if self.accelerator not in ("gpu", "cpu"):
            raise ValueError(f"--accelerator={self.accelerator!r}: choose 'gpu' or 'cpu'")
        for name, port in (("master_port", self.master_port), ("server_port", self.server_port),
                           ("group_port", self.group_port)):
            if not 1 <= port <= 65535:
                raise ValueError(f"--{name.replace('_', '-')}={port}: a port is in [1, 65535]")
        object.__setattr__(self, "hosts", self._checked_hosts())
        object.__setattr__(self, "_servers", self._place_servers())
        self._check_ports()

    def _checked_hosts(self) -> tuple[str, ...]:
        """``hosts``, one per node, checked (see the class's Raises)."""
        total = self.nodes + self.server_nodes
        hosts = tuple(self.hosts) * total if len(self.hosts) == 1 else tuple(self.hosts)
        if len(hosts) != total:
            raise ValueError(f"--hosts has {len(self.hosts)} entries: give one per node ({self.nodes} trainer nodes, "
                             f"then {self.server_nodes} server nodes = {total}), or one for all")
        for host in hosts:
            if not _HOST.match(host):
                raise ValueError(f"--hosts entry {host!r} is not a host name or address")
        loopback = {is_loopback(h) for h in hosts}
        if len(loopback) > 1:
            raise ValueError(f"--hosts {','.join(hosts)} mixes loopback and other addresses: a node on 127.0.0.x is "
                             "not reachable from another machine; give every node's network address")
        if loopback != {True} and self.secret_file is None:
            raise ValueError(f"--hosts {','.join(hosts)}: the rollout servers listen beyond this machine, where "
                             "anyone who reaches them could replace their weights, so they need the shared secret: "
                             "give --secret-file PATH (created with mode 600 when missing)")
        return hosts

    # ------------------------------------------------------------------ trainer
    @property
    def world_size(self) -> int:
        """The trainer's processes: ``nodes * devices_per_node``."""
        return self.nodes * self.devices_per_node

    @property
    def master_addr(self) -> str:
        """The first trainer node's address: ``MASTER_ADDR``, and the servers' weight-sync rendezvous."""
        return self.hosts[0]

    def trainer_nodes(self) -> list[TrainerNode]:
        """The trainer nodes in node-rank order."""
        g = self.devices_per_node
        return [TrainerNode(r, self.hosts[r], tuple(range(r * g, (r + 1) * g))) for r in range(self.nodes)]

    # ------------------------------------------------------------------ servers
    @property
    def servers_per_node(self) -> int:
        return self.servers // self.server_nodes

    @property
    def server_hosts(self) -> tuple[str, ...]:
        """The server nodes' addresses, in server-node order."""
        return self.hosts[self.nodes:]

    def gpus_per_server(self) -> int:
        """GPUs (tensor-parallel workers) per server; 0 on CPU.

        Raises:
            ValueError: the servers of a node would need more GPUs than ``devices_per_node``, or fewer than one.
        """
        if self.accelerator == "cpu":
            if self.server_gpus is not None:
                raise ValueError(f"--server-gpus={self.server_gpus} with --accelerator cpu: CPU servers have no GPUs")
            return 0
        per = self.server_gpus if self.server_gpus is not None else self.devices_per_node // self.servers_per_node
        if per < 1 or per * self.servers_per_node > self.devices_per_node:
            raise ValueError(f"--server-gpus={per}: {self.servers_per_node} servers per node x {per} GPUs must fit "
                             f"the node's {self.devices_per_node} GPUs (--devices-per-node), at least one each")
        return per

    def servers_list(self) -> list[ServerSpec]:
        """Every server, in ``engine.server_urls`` order (server node by server node)."""
        return list(self._servers)

    def server_urls(self) -> list[str]:
        """``engine.server_urls``: every server's base URL, in order."""
        return [s.url for s in self._servers]

    def _place_servers(self) -> tuple[ServerSpec, ...]:
        per_server = self.gpus_per_server()
        taken: dict[str, int] = {}
        placed: list[ServerSpec] = []
        for node, host in enumerate(self.server_hosts):
            for slot in range(self.servers_per_node):
                offset = taken.get(host, 0)
                taken[host] = offset + 1
                gpus = tuple(range(slot * per_server, (slot + 1) * per_server))
                placed.append(ServerSpec(len(placed), node, host, self.server_port + offset, gpus))
        return tuple(placed)

    def _check_ports(self) -> None:
        endpoints = [("--master-port", self.master_addr, self.master_port),
                     ("--group-port", self.master_addr, self.group_port),
                     *((f"server {s.index} ({s.url})", s.host, s.port) for s in self._servers)]
        used: dict[tuple[str, int], str] = {}
        for what, host, port in endpoints:
            if port > 65535:
                raise ValueError(f"{what}: port {port} is over 65535 (--server-port={self.server_port} plus the "
                                 "servers before it on the same host)")
            if (host, port) in used:
                raise ValueError(f"{what} uses port {port} on {host}, as {used[host, port]} does: choose "
                                 "--master-port, --server-port and --group-port apart")
            used[host, port] = what

    # ------------------------------------------------------------------ weight sync
    def weight_sync_groups(self) -> list[WeightSyncGroup]:
        """Each server's weight-sync group: at ``master_addr:group_port``, the trainer's rank 0 plus the server's
        workers (its GPUs, or one worker on CPU)."""
        return [WeightSyncGroup(s.url, self.master_addr, self.group_port, 1 + max(1, len(s.gpus)))
                for s in self._servers]
