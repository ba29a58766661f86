"""The shell scripts of a launch, written from a :class:`~lightning_grpo.launch.plan.LaunchPlan`.

* ``server_node<i>.sh``, one per server node: its rollout servers (``lightning-grpo serve --host <node> --port ...
  --secret-file ...``; on GPUs each with its slice of the node's devices in ``CUDA_VISIBLE_DEVICES`` and
  ``--tensor-parallel-size``).
* The trainer, after ``lightning-grpo health --wait`` has seen every server answer:

  - torchrun (``launcher="torchrun"``): ``trainer_node<r>.sh``, one per trainer node, ``torchrun --nnodes N
    --node-rank r --nproc-per-node G --master-addr <node 0> --master-port P -m lightning_grpo.cli fit ...``
    (Lightning's ``TorchElasticEnvironment`` reads the ranks torchrun sets);
  - srun (``launcher="srun"``): ``trainer.sh``, which every task of ``srun --nodes N --ntasks-per-node G`` runs:
    ``MASTER_ADDR`` / ``MASTER_PORT`` exported, then ``lightning-grpo fit ...`` (Lightning's ``SLURMEnvironment``
    reads ``SLURM_NTASKS``, ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NODEID``).

  Either way ``fit`` gets ``--trainer.num_nodes N --trainer.devices G --trainer.accelerator ...`` and the servers'
  wiring: ``--model.config.engine.name vllm_server``, ``engine.server_urls``, ``engine.server_group_host`` (node 0),
  ``engine.server_group_port`` and ``engine.server_secret_file`` (a path: the secret is never on a command line).
* ``job.sbatch`` (SLURM): allocates ``nodes + server_nodes`` nodes, names them with ``scontrol show hostnames``
  (trainer nodes first), runs the launcher again with those names and ``--launcher srun`` into a folder of the job,
  then one ``srun`` step per server node in the background and the trainer's ``srun`` step.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from typing import Literal, Optional, Sequence

from lightning_grpo.launch.plan import LaunchPlan, ServerSpec

#: The ``fit`` options the launcher sets itself (a fit argument naming one is refused: give the launcher option).
WIRED_OPTIONS = {
    "--trainer.num_nodes": "--nodes", "--trainer.devices": "--devices-per-node",
    "--trainer.accelerator": "--accelerator", "--model.model": "--model", "--config": "--config",
    "--model.config.engine.name": "(always vllm_server)", "--model.config.engine.server_urls": "--servers / --hosts",
    "--model.config.engine.server_group_host": "--hosts (the first trainer node)",
    "--model.config.engine.server_group_port": "--group-port",
    "--model.config.engine.server_secret_file": "--secret-file",
}
#: ``model.model``'s name of the embedded model (``lightning_grpo.models.embedded.EMBEDDED``).
EMBEDDED = "embedded"
#: The longest line of a written command before it continues on the next.
WIDTH = 110


def words(*literals: str) -> list[str]:
    """Shell words for ``literals``, each quoted as the shell needs (``shlex.quote``). The commands below are lists
    of such words; a variable or command substitution is written as is beside them."""
    return [shlex.quote(text) for text in literals]


@dataclass(frozen=True)
class RunSettings:
    """What a launch passes through to the commands.

    Args:
        configs: ``fit --config`` files, in order (relative to ``workdir`` or absolute).
        model: the policy every server loads and the trainer starts from: a folder, an HF id or "embedded"
            (``lightning-grpo-model``'s folder, found on each node).
        pass_model: whether ``fit`` gets ``--model.model`` (the model came from the launch's ``--model``, not from
            a config).
        fit_args: more ``fit`` arguments, after the launcher's.
        serve_args: more ``lightning-grpo serve`` arguments (``--kv-cache-space-gib 4``, ...).
        python: an interpreter to run everything with (``PY -m lightning_grpo.cli``, ``PY -m
            torch.distributed.run``); None = ``lightning-grpo`` and ``torchrun`` from the ``PATH``.
        workdir: the folder every script starts in (absolute; on a filesystem every node sees).
        health_timeout: seconds the trainer waits for every server's ``/health``.

    Raises:
        ValueError: a fit argument the launcher sets itself (the launcher option to use instead is named).
    """

    configs: tuple[str, ...]
    model: str
    pass_model: bool
    fit_args: tuple[str, ...]
    serve_args: tuple[str, ...]
    python: Optional[str]
    workdir: str
    health_timeout: float = 1800.0

    def __post_init__(self) -> None:
        for arg in self.fit_args:
            option = arg.split("=", 1)[0]
            if option in WIRED_OPTIONS:
                raise ValueError(f"fit argument {arg!r}: the launcher sets {option} itself; use "
                                 f"{WIRED_OPTIONS[option]}")

    def cli(self) -> list[str]:
        """``lightning-grpo``, or ``PY -m lightning_grpo.cli`` (shell words)."""
        return words("lightning-grpo") if self.python is None else words(self.python, "-m", "lightning_grpo.cli")

    def torchrun(self) -> list[str]:
        """``torchrun``, or ``PY -m torch.distributed.run`` (shell words)."""
        return words("torchrun") if self.python is None else words(self.python, "-m", "torch.distributed.run")

    def server_model(self) -> str:
        """The model's folder as ``lightning-grpo serve --model`` takes it, a shell word (the embedded model's
        folder is asked for on the node)."""
        if self.model != EMBEDDED:
            return shlex.quote(self.model)
        finder = "lightning-grpo-model" if self.python is None else \
            f"{shlex.quote(self.python)} -m lightning_grpo.models.embedded"
        return f'"$({finder})"'


def join(command: Sequence[str], indent: str = "") -> str:
    """A command line of shell words, continued over lines of at most :data:`WIDTH` characters before an option."""
    groups: list[str] = []
    for word in command:
        if groups and not word.startswith("-"):
            groups[-1] += " " + word
        else:
            groups.append(word)
    lines = [indent + groups[0]]
    for group in groups[1:]:
        if len(lines[-1]) + 1 + len(group) > WIDTH:
            lines[-1] += " \\"
            lines.append(indent + "    " + group)
        else:
            lines[-1] += " " + group
    return "\n".join(lines)


def serve_argv(plan: LaunchPlan, settings: RunSettings, server: ServerSpec) -> list[str]:
    """``lightning-grpo serve`` for ``server`` (shell words): on its node's address (never beyond it) and port,
    with the secret file and, on GPUs, its tensor-parallel size."""
    argv = [*settings.cli(), "serve", "--model", settings.server_model(),
            *words("--host", server.host, "--port", str(server.port))]
    if plan.secret_file is not None:
        argv += words("--secret-file", plan.secret_file)
    if server.gpus:
        argv += words("--tensor-parallel-size", str(len(server.gpus)))
    return argv + words(*settings.serve_args)


def fit_args(plan: LaunchPlan, settings: RunSettings) -> list[str]:
    """``fit`` and its arguments (without the program): the configs, the trainer's layout, the servers' wiring,
    then ``settings.fit_args``."""
    args = ["fit"]
    for config in settings.configs:
        args += ["--config", config]
    args += ["--trainer.accelerator", plan.accelerator, "--trainer.num_nodes", str(plan.nodes),
             "--trainer.devices", str(plan.devices_per_node)]
    if settings.pass_model:
        args += ["--model.model", settings.model]
    args += ["--model.config.engine.name", "vllm_server",
             "--model.config.engine.server_urls", "[" + ", ".join(plan.server_urls()) + "]",
             "--model.config.engine.server_group_host", plan.master_addr,
             "--model.config.engine.server_group_port", str(plan.group_port)]
    if plan.secret_file is not None:
        args += ["--model.config.engine.server_secret_file", plan.secret_file]
    return args + list(settings.fit_args)


def health_argv(plan: LaunchPlan, settings: RunSettings) -> list[str]:
    """``lightning-grpo health --wait T [--secret-file F] URL ...`` (shell words): every server answers before the
    trainer starts."""
    argv = [*settings.cli(), *words("health", "--wait", f"{settings.health_timeout:g}")]
    if plan.secret_file is not None:
        argv += words("--secret-file", plan.secret_file)
    return argv + words(*plan.server_urls())


def _header(title: str, settings: RunSettings) -> list[str]:
    return ["#!/bin/bash", f"# {title}", "# Written by `lightning-grpo launch` (docs/multinode.md).",
            "set -euo pipefail", f"cd {shlex.quote(settings.workdir)}"]


def server_node_script(plan: LaunchPlan, settings: RunSettings, node: int) -> str:
    """The script of server node ``node``: its servers in the foreground (one: ``exec``; several: in the
    background, the first to stop stopping the others)."""
    servers = [s for s in plan.servers_list() if s.node == node]
    urls = ", ".join(s.url for s in servers)
    lines = _header(f"Rollout servers on server node {node} ({plan.server_hosts[node]}): {urls}", settings)
    commands = []
    for server in servers:
        env = words("env", "CUDA_VISIBLE_DEVICES=" + ",".join(map(str, server.gpus))) if server.gpus else []
        commands.append([*env, *serve_argv(plan, settings, server)])
    if len(commands) == 1:
        lines.append(join(["exec", *commands[0]]))
    else:
        lines.append("trap 'kill $(jobs -p) 2>/dev/null' EXIT")
        lines += [join(command) + " &" for command in commands]
        lines.append("wait -n  # the first server to stop stops the others (the trap)")
    return "\n".join(lines) + "\n"


def torchrun_node_script(plan: LaunchPlan, settings: RunSettings, node_rank: int) -> str:
    """The script of trainer node ``node_rank`` under torchrun: wait for the servers, then ``torchrun``."""
    node = plan.trainer_nodes()[node_rank]
    ranks = f"{node.global_ranks[0]}-{node.global_ranks[-1]}"
    lines = _header(f"Trainer node {node_rank} of {plan.nodes} ({node.host}), torchrun: global ranks {ranks} of "
                    f"{plan.world_size}", settings)
    lines.append(join(health_argv(plan, settings)))
    lines.append(join(["exec", *settings.torchrun(),
                       *words("--nnodes", str(plan.nodes), "--node-rank", str(node_rank), "--nproc-per-node",
                              str(plan.devices_per_node), "--master-addr", plan.master_addr, "--master-port",
                              str(plan.master_port), "-m", "lightning_grpo.cli", *fit_args(plan, settings))]))
    return "\n".join(lines) + "\n"


def srun_trainer_script(plan: LaunchPlan, settings: RunSettings) -> str:
    """The script every trainer task of ``srun --nodes N --ntasks-per-node G`` runs: Lightning's
    ``SLURMEnvironment`` reads the task's ranks from SLURM's variables, ``MASTER_ADDR`` / ``MASTER_PORT`` from here."""
    lines = _header(f"Trainer task under srun ({plan.nodes} nodes x {plan.devices_per_node} tasks; Lightning's "
                    "SLURMEnvironment reads SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURM_NTASKS)", settings)
    lines.append(f"export MASTER_ADDR={shlex.quote(plan.master_addr)} MASTER_PORT={plan.master_port}")
    lines.append(join(health_argv(plan, settings)))
    lines.append(join(["exec", *settings.cli(), *words(*fit_args(plan, settings))]))
    return "\n".join(lines) + "\n"


def node_scripts(plan: LaunchPlan, settings: RunSettings,
                 launcher: Literal["torchrun", "srun"]) -> dict[str, str]:
    """Every script of the launch by file name: ``server_node<i>.sh``, then ``trainer_node<r>.sh`` (torchrun) or
    ``trainer.sh`` (srun)."""
    scripts = {f"server_node{i}.sh": server_node_script(plan, settings, i) for i in range(plan.server_nodes)}
    if launcher == "torchrun":
        scripts.update({f"trainer_node{r}.sh": torchrun_node_script(plan, settings, r) for r in range(plan.nodes)})
    else:
        scripts["trainer.sh"] = srun_trainer_script(plan, settings)
    return scripts


def sbatch_script(plan: LaunchPlan, settings: RunSettings, launch_options: Sequence[str], out: str,
                  job_name: str = "lightning-grpo", sbatch_args: Sequence[str] = ()) -> str:
    """The SLURM job. ``launch_options`` are the launcher's options of this launch (without ``--hosts``, ``--out``,
    ``--launcher``, ``--slurm``, ``--dry-run`` and the fit arguments), with which the job runs the launcher again,
    adding its node names and ``--launcher srun``, into ``out/job-$SLURM_JOB_ID``; ``sbatch_args`` become
    ``#SBATCH`` lines (``--partition=gpu``, ``--time=04:00:00``, ...)."""
    total = plan.nodes + plan.server_nodes
    lines = ["#!/bin/bash",
             f"# {plan.nodes} trainer nodes x {plan.devices_per_node} tasks, then {plan.server_nodes} rollout-server "
             f"nodes x {plan.servers_per_node} servers.",
             "# Written by `lightning-grpo launch --slurm` (docs/multinode.md); submit it: sbatch job.sbatch",
             f"#SBATCH --job-name={job_name}", f"#SBATCH --nodes={total}",
             f"#SBATCH --ntasks-per-node={plan.devices_per_node}"]
    if plan.accelerator == "gpu":
        lines.append(f"#SBATCH --gpus-per-node={plan.devices_per_node}")
    lines += [f"#SBATCH {arg}" for arg in sbatch_args]
    lines += ["set -euo pipefail", f"cd {shlex.quote(settings.workdir)}",
              'mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
              f'if [ "${{#NODES[@]}}" -ne {total} ]; then',
              f'    echo "this job has ${{#NODES[@]}} nodes; the launch needs {total}" >&2; exit 1', "fi",
              f'OUT={shlex.quote(out)}/job-"$SLURM_JOB_ID"',
              "# the scripts with this job's node names (trainer nodes first, then the server nodes)",
              join([*settings.cli(), *words("launch", *launch_options, "--launcher", "srun"),
                    "--hosts", '"$(IFS=,; echo "${NODES[*]}")"', "--out", '"$OUT"',
                    *(words("--", *settings.fit_args) if settings.fit_args else [])])]
    for i in range(plan.server_nodes):
        lines.append(join(["srun", "--nodes=1", "--ntasks=1", f'--nodelist="${{NODES[{plan.nodes + i}]}}"',
                           "bash", f'"$OUT/server_node{i}.sh"']) + " &")
    trainer_nodes = ",".join(f"${{NODES[{r}]}}" for r in range(plan.nodes))
    lines.append(join(["srun", f"--nodes={plan.nodes}", f"--ntasks-per-node={plan.devices_per_node}",
                       f'--nodelist="{trainer_nodes}"', "bash", '"$OUT/trainer.sh"']))
    lines.append("kill $(jobs -p) 2>/dev/null || true  # the trainer is done: stop the servers")
    return "\n".join(lines) + "\n"


def summary(plan: LaunchPlan) -> str:
    """The wiring in a few lines: ranks per node, ``MASTER_ADDR`` / ``MASTER_PORT``, the servers' URLs, the
    weight-sync groups, the secret file."""
    lines = [f"trainer: {plan.nodes} nodes x {plan.devices_per_node} processes = world size {plan.world_size}, "
             f"MASTER_ADDR={plan.master_addr} MASTER_PORT={plan.master_port}"]
    for node in plan.trainer_nodes():
        lines.append(f"  node {node.node_rank} on {node.host}: global ranks {list(node.global_ranks)}")
    lines.append(f"rollout servers: {plan.servers} on {plan.server_nodes} nodes")
    for server, group in zip(plan.servers_list(), plan.weight_sync_groups(), strict=True):
        gpus = f", GPUs {','.join(map(str, server.gpus))}" if server.gpus else ""
        lines.append(f"  server {server.index}: {server.url} (server node {server.node}{gpus}); weight-sync group at "
                     f"{group.host}:{group.port}, {group.world_size} ranks (trainer rank 0 + "
                     f"{group.world_size - 1} worker{'s' if group.world_size > 2 else ''})")
    lines.append(f"shared secret: {plan.secret_file}" if plan.secret_file else
                 "shared secret: none (every host is a loopback address)")
    return "\n".join(lines) + "\n"
