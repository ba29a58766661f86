"""``lightning-grpo launch``: the commands of a multi-node run (trainer nodes plus rollout servers), written from
its settings.

    lightning-grpo launch --nodes 2 --devices-per-node 8 --servers 2 --hosts n0,n1,n2,n3 --secret-file secret \\
        --config recipes/gsm8k_grpo.yaml --out launch [--dry-run] [-- more fit arguments]
    lightning-grpo launch --nodes 2 --devices-per-node 8 --servers 2 --secret-file secret --slurm \\
        --config recipes/gsm8k_grpo.yaml --out launch [--dry-run]      # launch/job.sbatch

It prints the wiring (ranks per node, ``MASTER_ADDR`` / ``MASTER_PORT``, the servers' URLs, the weight-sync groups,
the secret file) and writes the scripts of :mod:`lightning_grpo.launch.scripts` into ``--out`` (``--dry-run``:
prints them and writes nothing, not even the secret). The secret file is made with mode 600 when missing, and
refused when other users may read it; only its path is on any command line.
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path
from typing import Optional, Sequence

import yaml

from lightning_grpo.launch.plan import DEFAULT_GROUP_PORT, DEFAULT_MASTER_PORT, DEFAULT_SERVER_PORT, LaunchPlan
from lightning_grpo.launch.scripts import EMBEDDED, RunSettings, node_scripts, sbatch_script, summary
from lightning_grpo.launch.secret_file import check_secret_file, make_secret_file


def model_from_configs(paths: Sequence[Path]) -> Optional[str]:
    """``model.model`` (or ``model.init_args.model``) of the last of these YAML configs that sets it, else None.

    Raises:
        ValueError: a config that is not a file or not YAML (named).
    """
    found = None
    for path in paths:
        if not path.is_file():
            raise ValueError(f"--config {str(path)!r}: no such file")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ValueError(f"--config {str(path)!r} is not YAML: {err}") from None
        model = data.get("model") if isinstance(data, dict) else None
        if isinstance(model, dict):
            value = model.get("model", (model.get("init_args") or {}).get("model"))
            if value is not None:
                found = str(value)
    return found


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lightning-grpo launch", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    layout = parser.add_argument_group("layout")
    layout.add_argument("--nodes", type=int, required=True, help="trainer nodes")
    layout.add_argument("--devices-per-node", type=int, required=True,
                        help="trainer processes per node, one per device (and the GPUs of every node)")
    layout.add_argument("--servers", type=int, required=True, help="rollout servers")
    layout.add_argument("--server-nodes", type=int, default=None,
                        help="nodes of their own for the servers, which are spread evenly (default: one per server)")
    layout.add_argument("--accelerator", choices=("gpu", "cpu"), default="gpu")
    layout.add_argument("--server-gpus", type=int, default=None,
                        help="GPUs (tensor-parallel size) per server (default: a node's GPUs split over its servers)")
    layout.add_argument("--hosts", default=None,
                        help="comma-separated address of every node, trainer nodes first, then server nodes; one "
                             "address for all (default 127.0.0.1: a rehearsal on this machine); not with --slurm")
    wiring = parser.add_argument_group("wiring")
    wiring.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT, help="the trainer's MASTER_PORT")
    wiring.add_argument("--server-port", type=int, default=DEFAULT_SERVER_PORT,
                        help="the first server port of each host")
    wiring.add_argument("--group-port", type=int, default=DEFAULT_GROUP_PORT,
                        help="engine.server_group_port: the weight-sync rendezvous on the first trainer node")
    wiring.add_argument("--secret-file", default=None,
                        help="the servers' shared secret (made with mode 600 when missing); required unless every "
                             "host is a loopback address")
    wiring.add_argument("--health-timeout", type=float, default=1800.0,
                        help="seconds the trainer waits for every server's /health")
    run = parser.add_argument_group("what runs")
    run.add_argument("--config", action="append", default=[], help="a fit --config (repeat for several, in order)")
    run.add_argument("--model", default=None,
                     help="the policy the servers load and the trainer starts from (default: the configs' "
                          "model.model, else the embedded model)")
    run.add_argument("--serve-args", default="", help="more `lightning-grpo serve` arguments, as one string")
    run.add_argument("--python", default=None,
                     help="run everything as PYTHON -m ... (default: lightning-grpo and torchrun from the PATH)")
    run.add_argument("--workdir", default=None, help="the folder every script starts in (default: this one)")
    out = parser.add_argument_group("output")
    out.add_argument("--launcher", choices=("torchrun", "srun"), default=None,
                     help="the trainer's launcher: torchrun (trainer_node<r>.sh per node, the default) or srun "
                          "(trainer.sh, for every task of an srun step); --slurm uses srun")
    out.add_argument("--slurm", action="store_true", help="write job.sbatch, which names its nodes when it runs")
    out.add_argument("--job-name", default="lightning-grpo", help="--slurm: the job's name")
    out.add_argument("--sbatch-arg", action="append", default=[],
                     help="--slurm: an #SBATCH line, e.g. --sbatch-arg=--partition=gpu (repeat for several)")
    out.add_argument("--out", default="launch", help="the folder the scripts are written to")
    out.add_argument("--dry-run", action="store_true", help="print the scripts; write nothing")
    parser.add_argument("fit_args", nargs=argparse.REMAINDER,
                        help="after --: more `lightning-grpo fit` arguments (e.g. -- --trainer.max_steps 100)")
    return parser


def _launch_options(args: argparse.Namespace, workdir: str, secret_file: Optional[str]) -> list[str]:
    """The options that make this launch again (for the SLURM job, which adds its hosts)."""
    options = ["--nodes", str(args.nodes), "--devices-per-node", str(args.devices_per_node), "--servers",
               str(args.servers), "--server-nodes", str(args.server_nodes), "--accelerator", args.accelerator]
    if args.server_gpus is not None:
        options += ["--server-gpus", str(args.server_gpus)]
    options += ["--master-port", str(args.master_port), "--server-port", str(args.server_port), "--group-port",
                str(args.group_port), "--health-timeout", f"{args.health_timeout:g}", "--workdir", workdir]
    if secret_file is not None:
        options += ["--secret-file", secret_file]
    if args.model is not None:
        options += ["--model", args.model]
    for config in args.config:
        options += ["--config", config]
    if args.serve_args:
        options += ["--serve-args", args.serve_args]
    if args.python is not None:
        options += ["--python", args.python]
    return options


def launch_main(argv: Sequence[str]) -> None:
    """The ``lightning-grpo launch`` command; a bad setting exits with status 2 and the reason."""
    parser = _parser()
    args = parser.parse_args(list(argv))
    fit_args = list(args.fit_args)
    if fit_args[:1] == ["--"]:
        fit_args = fit_args[1:]
    elif fit_args:
        parser.error(f"unrecognized arguments: {' '.join(fit_args)} (fit arguments go after --)")
    try:
        print(_launch(args, fit_args), end="")
    except (ValueError, OSError) as err:
        parser.error(str(err))


def _launch(args: argparse.Namespace, fit_args: list[str]) -> str:
    """Check the settings, then write (or with ``--dry-run`` only render) the scripts; returns what to print."""
    plan, settings = _plan(args, fit_args)
    out = os.path.abspath(args.out)
    if args.slurm:
        options = _launch_options(args, settings.workdir, plan.secret_file)
        scripts = {"job.sbatch": sbatch_script(plan, settings, options, out, args.job_name, args.sbatch_arg)}
        shown = {**scripts, **{f"(the job's {name}, its nodes named NODE0..)": text
                               for name, text in node_scripts(plan, settings, "srun").items()}}
    else:
        scripts = shown = node_scripts(plan, settings, args.launcher or "torchrun")
    secret_file = plan.secret_file
    secret_exists = secret_file is not None and os.path.exists(secret_file)
    if secret_file is not None and secret_exists:
        check_secret_file(secret_file)
    report = summary(plan)
    if args.dry_run:
        if secret_file is not None and not secret_exists:
            report += f"(dry run: {secret_file} would be made, with mode 600)\n"
        return report + "".join(f"\n==> {name} <==\n{text}" for name, text in shown.items())
    if secret_file is not None and not secret_exists:
        make_secret_file(secret_file)
        report += f"made {secret_file} (mode 600): every node must see it (a shared filesystem)\n"
    os.makedirs(out, exist_ok=True)
    for name, text in scripts.items():
        path = os.path.join(out, name)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(path, 0o755)
    report += f"wrote {', '.join(os.path.join(out, name) for name in scripts)}\n"
    return report + _how_to_run(plan, args, out)


def _plan(args: argparse.Namespace, fit_args: list[str]) -> tuple[LaunchPlan, RunSettings]:
    """The launch's plan and settings from the parsed options.

    Raises:
        ValueError: a bad combination of options, or what :class:`LaunchPlan` and :class:`RunSettings` refuse.
    """
    if args.slurm and (args.hosts is not None or args.launcher is not None):
        raise ValueError("--slurm names its nodes when the job runs and launches the trainer with srun: drop "
                         "--hosts and --launcher")
    if args.slurm and args.secret_file is None:
        raise ValueError("--slurm: the job's nodes are separate machines, so the servers need the shared secret: "
                         "give --secret-file PATH (created with mode 600 when missing)")
    args.server_nodes = args.server_nodes if args.server_nodes is not None else args.servers
    workdir = os.path.abspath(args.workdir or os.getcwd())
    placeholders = ",".join(f"NODE{i}" for i in range(max(1, args.nodes + args.server_nodes)))
    hosts = tuple(h.strip() for h in (placeholders if args.slurm else args.hosts or "127.0.0.1").split(","))
    plan = LaunchPlan(nodes=args.nodes, devices_per_node=args.devices_per_node, servers=args.servers,
                      server_nodes=args.server_nodes, hosts=hosts, accelerator=args.accelerator,
                      server_gpus=args.server_gpus, master_port=args.master_port, server_port=args.server_port,
                      group_port=args.group_port,
                      secret_file=os.path.abspath(args.secret_file) if args.secret_file else None)
    configured = model_from_configs([Path(workdir, c) for c in args.config])
    settings = RunSettings(configs=tuple(args.config), model=args.model or configured or EMBEDDED,
                           pass_model=args.model is not None, fit_args=tuple(fit_args),
                           serve_args=tuple(shlex.split(args.serve_args)), python=args.python, workdir=workdir,
                           health_timeout=args.health_timeout)
    return plan, settings


def _how_to_run(plan: LaunchPlan, args: argparse.Namespace, out: str) -> str:
    if args.slurm:
        return f"submit: sbatch {os.path.join(out, 'job.sbatch')}\n"
    run = [f"  on {plan.server_hosts[i]}: bash {os.path.join(out, f'server_node{i}.sh')}"
           for i in range(plan.server_nodes)]
    if args.launcher == "srun":
        run.append(f"  srun --nodes {plan.nodes} --ntasks-per-node {plan.devices_per_node} bash "
                   f"{os.path.join(out, 'trainer.sh')}")
    else:
        run += [f"  on {node.host}: bash {os.path.join(out, f'trainer_node{node.node_rank}.sh')}"
                for node in plan.trainer_nodes()]
    return "run (the trainer waits for the servers):\n" + "\n".join(run) + "\n"
