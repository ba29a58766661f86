"""The wiring of a multi-node launch, worked by hand: ranks per node, ``MASTER_ADDR`` / ``MASTER_PORT``, the servers'
addresses, ports and GPUs, their URLs in ``engine.server_urls``, the weight-sync groups, the secret file; and the
commands of the scripts (:mod:`lightning_grpo.launch.scripts`) read back word by word with ``shlex``."""

from __future__ import annotations

import shlex

import pytest

from lightning_grpo.launch.plan import LaunchPlan, ServerSpec, TrainerNode, WeightSyncGroup
from lightning_grpo.launch.scripts import (
    RunSettings,
    node_scripts,
    sbatch_script,
    srun_trainer_script,
    summary,
)

HOSTS = ("n0", "n1", "n2", "n3")
SECRET = "/shared/secret"
URLS = "[http://n2:8000, http://n3:8000]"


def two_by_two(**kwargs) -> LaunchPlan:
    """2 trainer nodes x 4 GPUs, 2 servers on 2 nodes of their own."""
    return LaunchPlan(**{**dict(nodes=2, devices_per_node=4, servers=2, server_nodes=2, hosts=HOSTS,
                                secret_file=SECRET), **kwargs})


def settings(**kwargs) -> RunSettings:
    return RunSettings(**{**dict(configs=("recipes/gsm8k_grpo.yaml",), model="/models/policy", pass_model=True,
                                 fit_args=("--trainer.max_steps", "3"), serve_args=("--max-model-len", "4096"),
                                 python=None, workdir="/shared/run", health_timeout=600.0), **kwargs})


def commands(script: str) -> list[list[str]]:
    """The script's command lines (continuations joined), each split into words as the shell would; comments, the
    shebang and ``set`` dropped."""
    text = script.replace("\\\n", " ")
    return [shlex.split(line) for line in text.splitlines()
            if line and not line.startswith(("#", "set ", "trap ", "wait "))]


FIT = ["fit", "--config", "recipes/gsm8k_grpo.yaml", "--trainer.accelerator", "gpu", "--trainer.num_nodes", "2",
       "--trainer.devices", "4", "--model.model", "/models/policy", "--model.config.engine.name", "vllm_server",
       "--model.config.engine.server_urls", URLS, "--model.config.engine.server_group_host", "n0",
       "--model.config.engine.server_group_port", "51216", "--model.config.engine.server_secret_file", SECRET,
       "--trainer.max_steps", "3"]
HEALTH = ["lightning-grpo", "health", "--wait", "600", "--secret-file", SECRET, "http://n2:8000", "http://n3:8000"]


def test_two_trainer_nodes_and_two_servers_wiring():
    plan = two_by_two()
    assert (plan.world_size, plan.master_addr, plan.master_port) == (8, "n0", 29500)
    assert plan.trainer_nodes() == [TrainerNode(0, "n0", (0, 1, 2, 3)), TrainerNode(1, "n1", (4, 5, 6, 7))]
    assert plan.servers_list() == [ServerSpec(0, 0, "n2", 8000, (0, 1, 2, 3)),
                                   ServerSpec(1, 1, "n3", 8000, (0, 1, 2, 3))]
    assert plan.server_urls() == ["http://n2:8000", "http://n3:8000"]
    # one group per server at the trainer's rank 0 (n0), one port for all: rank 0 + the server's 4 workers
    assert plan.weight_sync_groups() == [WeightSyncGroup("http://n2:8000", "n0", 51216, 5),
                                         WeightSyncGroup("http://n3:8000", "n0", 51216, 5)]


def test_torchrun_scripts_carry_the_node_rank_master_and_the_servers_wiring():
    plan, run = two_by_two(), settings()
    scripts = node_scripts(plan, run, "torchrun")
    assert list(scripts) == ["server_node0.sh", "server_node1.sh", "trainer_node0.sh", "trainer_node1.sh"]
    for r in range(2):
        assert commands(scripts[f"trainer_node{r}.sh"]) == [
            ["cd", "/shared/run"], HEALTH,
            ["exec", "torchrun", "--nnodes", "2", "--node-rank", str(r), "--nproc-per-node", "4", "--master-addr",
             "n0", "--master-port", "29500", "-m", "lightning_grpo.cli", *FIT]]
    for i, host in enumerate(("n2", "n3")):
        assert commands(scripts[f"server_node{i}.sh"]) == [
            ["cd", "/shared/run"],
            ["exec", "env", "CUDA_VISIBLE_DEVICES=0,1,2,3", "lightning-grpo", "serve", "--model", "/models/policy",
             "--host", host, "--port", "8000", "--secret-file", SECRET, "--tensor-parallel-size", "4",
             "--max-model-len", "4096"]]


def test_the_srun_task_script_exports_the_master_and_runs_fit():
    assert commands(srun_trainer_script(two_by_two(), settings())) == [
        ["cd", "/shared/run"], ["export", "MASTER_ADDR=n0", "MASTER_PORT=29500"], HEALTH,
        ["exec", "lightning-grpo", *FIT]]


def test_the_sbatch_allocates_every_node_and_runs_one_step_per_role():
    plan = two_by_two()
    text = sbatch_script(plan, settings(), ["--nodes", "2", "--secret-file", SECRET], "/shared/run/launch",
                         sbatch_args=["--time=04:00:00"])
    sbatch = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert sbatch == ["#SBATCH --job-name=lightning-grpo", "#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=4",
                      "#SBATCH --gpus-per-node=4", "#SBATCH --time=04:00:00"]
    steps = [" ".join(line.split()) for line in text.replace("\\\n", " ").splitlines()
             if line.startswith(("srun", "lightning-grpo"))]
    assert steps == [
        'lightning-grpo launch --nodes 2 --secret-file /shared/secret --launcher srun --hosts '
        '"$(IFS=,; echo "${NODES[*]}")" --out "$OUT" -- --trainer.max_steps 3',
        'srun --nodes=1 --ntasks=1 --nodelist="${NODES[2]}" bash "$OUT/server_node0.sh" &',
        'srun --nodes=1 --ntasks=1 --nodelist="${NODES[3]}" bash "$OUT/server_node1.sh" &',
        'srun --nodes=2 --ntasks-per-node=4 --nodelist="${NODES[0]},${NODES[1]}" bash "$OUT/trainer.sh"']
    assert 'OUT=/shared/run/launch/job-"$SLURM_JOB_ID"' in text and '-ne 4 ]' in text


def test_one_host_for_every_node_gives_consecutive_ports_and_needs_no_secret():
    plan = LaunchPlan(nodes=2, devices_per_node=1, servers=2, server_nodes=2, accelerator="cpu", server_port=9000)
    assert plan.hosts == ("127.0.0.1",) * 4 and plan.secret_file is None
    assert plan.server_urls() == ["http://127.0.0.1:9000", "http://127.0.0.1:9001"]
    assert [g.world_size for g in plan.weight_sync_groups()] == [2, 2]  # rank 0 + one CPU worker
    run = settings(configs=(), fit_args=(), serve_args=(), python="/venv/bin/python")
    assert commands(node_scripts(plan, run, "torchrun")["server_node1.sh"])[1] == [
        "exec", "/venv/bin/python", "-m", "lightning_grpo.cli", "serve", "--model", "/models/policy", "--host",
        "127.0.0.1", "--port", "9001"]
    assert "shared secret: none" in summary(plan)


def test_several_servers_per_node_split_its_gpus():
    plan = two_by_two(servers=4, devices_per_node=8)
    assert [(s.host, s.port, s.gpus) for s in plan.servers_list()] == [
        ("n2", 8000, (0, 1, 2, 3)), ("n2", 8001, (4, 5, 6, 7)), ("n3", 8000, (0, 1, 2, 3)), ("n3", 8001, (4, 5, 6, 7))]
    assert [s.gpus for s in two_by_two(servers=4, devices_per_node=8, server_gpus=2).servers_list()][:2] == [
        (0, 1), (2, 3)]


def test_the_embedded_model_is_found_on_each_server_node():
    scripts = node_scripts(two_by_two(), settings(model="embedded", pass_model=False), "torchrun")
    assert '--model "$(lightning-grpo-model)"' in scripts["server_node0.sh"]
    assert "--model.model" not in scripts["trainer_node0.sh"]


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(secret_file=None), "need the shared secret: give --secret-file"),
    (dict(hosts=("127.0.0.1", "n1", "n2", "n3")), "mixes loopback and other addresses"),
    (dict(hosts=("n0", "n1", "n2")), "--hosts has 3 entries: give one per node"),
    (dict(hosts=("n0", "n 1", "n2", "n3")), "--hosts entry 'n 1' is not a host name"),
    (dict(servers=3), "--servers must be a multiple of --server-nodes"),
    (dict(server_gpus=5), "--server-gpus=5: 1 servers per node x 5 GPUs must fit the node's 4 GPUs"),
    (dict(accelerator="cpu", server_gpus=1), "--server-gpus=1 with --accelerator cpu"),
    (dict(nodes=0), "--nodes=0: must be an integer >= 1"),
    (dict(group_port=29500), "--group-port uses port 29500 on n0, as --master-port does"),
    (dict(master_port=70000), "--master-port=70000: a port is in [1, 65535]"),
])
def test_bad_launches_are_refused_naming_the_option(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        two_by_two(**kwargs)


def test_a_server_port_taken_on_the_same_host_is_refused():
    with pytest.raises(ValueError, match=r"server 1 \(http://127.0.0.1:29500\) uses port 29500 on 127.0.0.1"):
        LaunchPlan(nodes=1, devices_per_node=1, servers=2, server_nodes=1, accelerator="cpu", server_port=29499)


@pytest.mark.parametrize("arg", ["--trainer.num_nodes=4", "--model.config.engine.server_urls", "--config"])
def test_fit_arguments_the_launcher_sets_are_refused(arg):
    with pytest.raises(ValueError, match="the launcher sets .* itself; use"):
        settings(fit_args=(arg, "x"))
