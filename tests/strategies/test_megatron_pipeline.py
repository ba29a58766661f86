"""MegatronStrategy with pipeline parallelism and the distributed optimizer, on CPU processes (gloo, real
megatron-core schedules, launched with torchrun running ``tests/support/megatron_pp_worker.py``), against the plain HF
GRPOModule and MegatronStrategy at TP=1/PP=1 in this process.

Every run trains two optimizer steps on one fixed rollout (two passes over it: the second step is off-policy, with
old logprobs; beta > 0: reference logprobs), with gradient clipping active, so the loss, the gradient norm, the
step normalizer, the reference and old logprobs and the tied embedding's two copies all go through the pipeline.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

from lightning_grpo.strategies.megatron.strategy import MegatronStrategy  # noqa: E402
from support import megatron_pp_worker as _megatron_pp_worker  # noqa: E402
from support import megatron_worker  # noqa: E402

WORKER = str(Path(_megatron_pp_worker.__file__).resolve())
CLIP = 0.05  # well below the gradient norms (about 3 and 1.5): clipping by the full norm is active


@pytest.fixture(scope="module")
def files(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("megatron_pipeline")
    return {"model": megatron_worker.save_tiny_model(str(root / "tied"), smollm2_path, tied=True),
            "prompts": megatron_worker.write_prompts(str(root / "prompts.jsonl"), 4),  # one rollout
            "more_prompts": megatron_worker.write_prompts(str(root / "more_prompts.jsonl"), 8)}  # two rollouts


def _torchrun(out: Path, processes: int, runs: list, timeout: int = 900, check: bool = True):
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}", WORKER,
               str(out), json.dumps(runs)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        pytest.fail(f"torchrun failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}")
    return done


def _result(out: Path, name: str, ranks: int) -> list[dict]:
    return [json.loads((out / f"{name}_rank{rank}.json").read_text()) for rank in range(ranks)]


def _weights(out: Path, name: str) -> dict:
    return torch.load(out / f"{name}_weights.pt", weights_only=True)


def _assert_same_weights(weights: dict, expected: dict, what: str, atol: float = 1e-5) -> None:
    assert sorted(weights) == sorted(expected), what
    for key, value in expected.items():
        torch.testing.assert_close(weights[key], value, atol=atol, rtol=0, msg=f"{what}: {key}")


@pytest.fixture(scope="module")
def references(files):
    """Two steps of the plain HF GRPOModule (one process) with SGD, three with AdamW (the third on a second
    rollout: the dataset's 4 prompts again), and two of MegatronStrategy at TP=1/PP=1 with SGD: per-step losses,
    gradient norms, final weights."""
    out = {}
    for name, strategy, optimizer, steps in (("plain_sgd", "auto", "sgd", 2), ("plain_adamw", "auto", "adamw", 3),
                                             ("tp1pp1_sgd", MegatronStrategy(), "sgd", 2)):
        module, losses, norms, _ = _megatron_pp_worker.run_steps(files["model"], files["prompts"], strategy, 1, 4,
                                                                clip=CLIP, optimizer=optimizer, max_steps=steps)
        out[name] = (losses, norms, {k: v.clone() for k, v in module.policy.state_dict().items()})
    if torch.distributed.is_initialized():  # MegatronStrategy leaves Lightning's default group, as DDP does
        torch.distributed.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, files):
    """PP=2 on two processes: two steps (checkpoint after each), the second step resumed at TP=2/PP=1 from the
    PP=2 checkpoint, and one unclipped step with 1 and with 4 micro-batches."""
    out = tmp_path_factory.mktemp("megatron_pp2")
    common = {"model_path": files["model"], "data_path": files["prompts"]}
    pp2 = {"pipeline_model_parallel_size": 2}
    _torchrun(out, 2, [
        {"name": "pp2", "layout": pp2, "clip": CLIP, "checkpoint_dir": str(out / "ckpt"), **common},
        {"name": "tp2_from_pp2", "layout": {"tensor_model_parallel_size": 2}, "clip": CLIP,
         "resume": str(out / "ckpt" / "epoch=0-step=1.ckpt"), **common},
        {"name": "pp2_accumulate1", "layout": pp2, "max_steps": 1, "accumulate": 1, **common},
        {"name": "pp2_accumulate4", "layout": pp2, "max_steps": 1, "accumulate": 4, **common},
    ])
    return out


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory, files):
    """Four processes: TP=2 x PP=2 (SGD, two steps); PP=2 x DP=2 with the distributed optimizer (AdamW, three
    steps over two rollouts, a checkpoint after each), resumed in the same layout from step 1 (mid-rollout) and at
    TP=2 x PP=2 with the module's own optimizer from step 2 (a rollout boundary: the DP size changes)."""
    out = tmp_path_factory.mktemp("megatron_four")
    common = {"model_path": files["model"], "data_path": files["prompts"], "clip": CLIP}
    distributed = {"pipeline_model_parallel_size": 2, "use_distributed_optimizer": True}
    adam = {"optimizer": "adamw", "max_steps": 3, **common}
    _torchrun(out, 4, [
        {"name": "tp2pp2", "layout": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2}, **common},
        {"name": "pp2dp2_distributed", "layout": distributed, "checkpoint_dir": str(out / "ckpt"), **adam},
        {"name": "pp2dp2_distributed_resumed", "layout": distributed,
         "resume": str(out / "ckpt" / "epoch=0-step=1.ckpt"), **adam},
        {"name": "tp2pp2_from_distributed", "layout": {"tensor_model_parallel_size": 2,
                                                       "pipeline_model_parallel_size": 2},
         "resume": str(out / "ckpt" / "epoch=0-step=2.ckpt"), **adam},
    ], timeout=1500)
    return out


@pytest.mark.distributed
def test_pp2_two_steps_equal_tp1_pp1_and_the_hf_path(two_processes, references):
    plain_losses, plain_norms, plain = references["plain_sgd"]
    tp1_losses, tp1_norms, tp1 = references["tp1pp1_sgd"]
    assert min(plain_norms) > 10 * CLIP and len(plain_losses) == 2 and abs(plain_losses[1]) > 1e-3
    runs = {"tp1pp1 (1 process)": (tp1_losses, tp1_norms, tp1)}
    for rank, result in enumerate(_result(two_processes, "pp2", 2)):
        assert result["policy_type"] == "LlamaForCausalLM"  # the HF policy is handed back after fit
        runs[f"pp2 rank {rank}"] = (result["losses"], result["grad_norms"], _weights(two_processes, "pp2"))
    for name, (losses, norms, weights) in runs.items():
        assert losses == pytest.approx(plain_losses, abs=1e-5), name
        assert norms == pytest.approx(plain_norms, rel=1e-5), name  # the full gradient's norm, both stages
        _assert_same_weights(weights, plain, name)


@pytest.mark.distributed
def test_checkpoint_written_at_pp2_resumes_at_tp2(two_processes):
    (pp2,) = _result(two_processes, "pp2", 1)
    for result in _result(two_processes, "tp2_from_pp2", 2):
        assert result["losses"] == pytest.approx(pp2["losses"][1:], abs=1e-5)  # the second step only
    saved = torch.load(two_processes / "ckpt" / "epoch=0-step=1.ckpt", weights_only=False)["optimizer_states"][0]
    assert saved["format"] == "megatron-hf" and "momentum_buffer" in saved["state"]["model.layers.1.mlp.up_proj.weight"]
    _assert_same_weights(_weights(two_processes, "tp2_from_pp2"), _weights(two_processes, "pp2"), "TP=2 from PP=2")


@pytest.mark.distributed
def test_pp2_one_or_four_micro_batches_give_the_same_gradient(two_processes, files):
    before = _megatron_pp_worker.make_module(files["model"], "sgd", "fixed").policy.state_dict()
    one, four = _weights(two_processes, "pp2_accumulate1"), _weights(two_processes, "pp2_accumulate4")
    lr = _megatron_pp_worker.LEARNING_RATES["sgd"]
    for key in before:  # one SGD step from the same weights: the update is -lr * gradient
        torch.testing.assert_close((before[key] - four[key]) / lr, (before[key] - one[key]) / lr, atol=1e-5, rtol=0,
                                   msg=key)
    assert max(float((before[k] - one[k]).abs().max()) for k in before) > 1e-2  # the step moved the weights
    (r1,), (r4,) = _result(two_processes, "pp2_accumulate1", 1), _result(two_processes, "pp2_accumulate4", 1)
    assert r4["grad_norms"] == pytest.approx(r1["grad_norms"], rel=1e-5)
    assert r4["losses"] == pytest.approx(r1["losses"], abs=1e-6)


@pytest.mark.distributed
def test_tp2_pp2_and_pp2_dp2_distributed_optimizer_equal_the_hf_path(four_processes, references):
    plain_losses, plain_norms, plain = references["plain_sgd"]
    for rank, result in enumerate(_result(four_processes, "tp2pp2", 4)):
        assert result["losses"] == pytest.approx(plain_losses, abs=1e-5), rank
        assert result["grad_norms"] == pytest.approx(plain_norms, rel=1e-5), rank
    _assert_same_weights(_weights(four_processes, "tp2pp2"), plain, "TP=2 x PP=2")
    adam_losses, adam_norms, adam = references["plain_adamw"]
    for rank, result in enumerate(_result(four_processes, "pp2dp2_distributed", 4)):
        assert result["losses"] == pytest.approx(adam_losses, abs=1e-5), rank
        assert result["grad_norms"] == pytest.approx(adam_norms, rel=1e-5), rank  # megatron-core's sharded norm
    _assert_same_weights(_weights(four_processes, "pp2dp2_distributed"), adam, "PP=2 x DP=2, distributed optimizer")


@pytest.mark.distributed
def test_distributed_optimizer_checkpoints_resume_in_the_same_and_another_layout(four_processes):
    full = _weights(four_processes, "pp2dp2_distributed")
    (first,) = _result(four_processes, "pp2dp2_distributed", 1)
    resumed = _weights(four_processes, "pp2dp2_distributed_resumed")
    assert all(torch.equal(resumed[k], full[k]) for k in full)  # the DP-sharded Adam states were restored exactly
    for rank, result in enumerate(_result(four_processes, "pp2dp2_distributed_resumed", 4)):
        assert result["losses"] == first["losses"][1:], rank
    for rank, result in enumerate(_result(four_processes, "tp2pp2_from_distributed", 4)):
        assert result["losses"] == pytest.approx(first["losses"][2:], abs=1e-5), rank
    _assert_same_weights(_weights(four_processes, "tp2pp2_from_distributed"), full, "TP=2 x PP=2 from the shards")
    saved = torch.load(four_processes / "ckpt" / "epoch=0-step=1.ckpt", weights_only=False)
    state = saved["optimizer_states"][0]["state"]["model.embed_tokens.weight"]
    assert saved["optimizer_states"][0]["format"] == "megatron-hf" and {"exp_avg", "exp_avg_sq", "step"} <= set(state)
    assert state["exp_avg"].shape == (49152, 128)
    assert bool((state["exp_avg"].abs().sum(dim=1) > 0).all())  # every row's moments: no DP shard's range missing
    replicas = saved["loops"]["fit_loop"]["state_dict"]["data_parallel_replicas"]
    assert replicas == [[0, 2], [1, 2], [0, 2], [1, 2]]  # megatron-core's order tp-dp-pp


def test_a_mid_rollout_checkpoint_refuses_a_layout_that_moves_processes_between_replicas():
    from lightning_grpo.loop.resume import check_replicas

    pp2_dp2 = [[0, 2], [1, 2], [0, 2], [1, 2]]  # PP=2 x DP=2: [sampler rank, replicas] of global ranks 0..3
    tp2_pp2 = [[0, 1]] * 4
    with pytest.raises(ValueError, match=r"replicas \[sampler rank, replicas\] \[\[0, 2\], \[1, 2\], \[0, 2\], "
                                         r"\[1, 2\]\]; this run's are \[\[0, 1\], .* another replica's"):
        check_replicas(pp2_dp2, tp2_pp2, pending=True)
    check_replicas(pp2_dp2, pp2_dp2, pending=True)  # the same replicas
    check_replicas(pp2_dp2, tp2_pp2, pending=False)  # nothing partly used: any layout
    check_replicas(None, tp2_pp2, pending=True)  # a checkpoint from before the replicas were saved


@pytest.mark.distributed
def test_kill_9_and_resume_under_pp2_with_the_distributed_optimizer_is_bitwise_exact(tmp_path, files):
    run = {"layout": {"pipeline_model_parallel_size": 2, "use_distributed_optimizer": True}, "model_path":
           files["model"], "data_path": files["more_prompts"], "clip": CLIP, "optimizer": "adamw", "engine": "hf",
           "max_steps": 3}  # HF rollouts from the pipelined policy; step 3 is the second rollout's
    _torchrun(tmp_path, 2, [{"name": "uninterrupted", **run}])
    killed = _torchrun(tmp_path, 2, [{"name": "killed", **run, "checkpoint_dir": str(tmp_path / "ckpt"),
                                      "kill_at": 1}], check=False)
    assert killed.returncode != 0 and "SIGKILL" in killed.stderr  # killed mid-rollout, after step 1's checkpoint
    assert torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["global_step"] == 1
    _torchrun(tmp_path, 2, [{"name": "resumed", **run, "resume": str(tmp_path / "ckpt" / "last.ckpt")}])
    (full,), (resumed,) = _result(tmp_path, "uninterrupted", 1), _result(tmp_path, "resumed", 1)
    assert resumed["losses"] == full["losses"][1:] and resumed["grad_norms"] == full["grad_norms"][1:]
    expected, weights = _weights(tmp_path, "uninterrupted"), _weights(tmp_path, "resumed")
    assert sorted(weights) == sorted(expected)
    assert all(torch.equal(weights[k], expected[k]) for k in expected)


@pytest.mark.distributed
def test_asynchronous_rollouts_under_tp2_equal_the_hf_path(tmp_path, files):
    """``max_staleness=2``: the second rollout of an epoch is generated on a background thread (its broadcast to the
    other TP rank on the rollout group) while the first one trains (TP collectives on the trainer's thread)."""
    run = {"data_path": files["more_prompts"], "clip": CLIP, "max_steps": 4, "distributed_sampler": False,
           # the fixed engine declares its own weights (as vLLM's), which asynchronous rollouts need
           "config": {"max_staleness": 2}}
    plain, losses, norms, staleness = _megatron_pp_worker.run_steps(files["model"], strategy="auto", devices=1,
                                                                    prompts_per_step=4, **run)
    expected = {k: v.clone() for k, v in plain.policy.state_dict().items()}
    assert max(staleness) > 0  # a rollout was trained on after optimizer steps it did not see
    _torchrun(tmp_path, 2, [{"name": "async", "layout": {"tensor_model_parallel_size": 2}, "model_path": files["model"],
                             **run}])
    for rank, result in enumerate(_result(tmp_path, "async", 2)):
        assert result["staleness"] == staleness, rank
        assert result["losses"] == pytest.approx(losses, abs=1e-5), rank
        assert result["grad_norms"] == pytest.approx(norms, rel=1e-5), rank
    _assert_same_weights(_weights(tmp_path, "async"), expected, "TP=2, asynchronous rollouts")
