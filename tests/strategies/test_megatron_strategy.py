"""MegatronStrategy end to end: tensor parallelism on 2 CPU processes (gloo, real megatron-core, launched with
torchrun running ``tests/support/megatron_worker.py``) against transformers and the plain GRPOModule."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

from transformers import AutoModelForCausalLM  # noqa: E402

from lightning_grpo.strategies.megatron.strategy import MegatronStrategy  # noqa: E402
from support import megatron_worker  # noqa: E402

WORKER = str(Path(megatron_worker.__file__).resolve())
CLIP = 0.05  # gradient_clip_val of the one-step runs: well below the gradient norm, so clipping is active


@pytest.fixture(scope="module")
def files(tmp_path_factory, smollm2_path):
    root = tmp_path_factory.mktemp("megatron_strategy")
    save = megatron_worker.save_tiny_model
    models = {name: save(str(root / name), smollm2_path, tied=name == "tied", model_type=kind)
              for name, kind in (("tied", "llama"), ("untied", "llama"), ("qwen2", "qwen2"))}
    return {"models": models, "prompts": megatron_worker.write_prompts(str(root / "prompts.jsonl"))}


def _torchrun(out: Path, scenarios: list, timeout: int = 420) -> None:
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", WORKER, str(out),
               json.dumps(scenarios)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        pytest.fail(f"torchrun failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}")


def _results(out: Path, name: str) -> list[dict]:
    return [json.loads((out / f"{name}_rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, files):
    """One torchrun with 2 processes: TP=2 logits, TP=2 logprobs, one GRPO step at TP=2 (DP=1) and at TP=1 (DP=2),
    and one at TP=2 in each bf16 precision."""
    out = tmp_path_factory.mktemp("megatron_two_processes")
    step = {"model_path": files["models"]["tied"], "data_path": files["prompts"], "clip": CLIP}
    _torchrun(out, [["logits", {"model_paths": list(files["models"].values())}], ["logprobs", {}],
                    ["step", {**step, "tp": 2}], ["step", {**step, "tp": 1}], ["bf16_step", step]])
    return out


@pytest.fixture
def restore_distributed_env():
    """In-process strategy runs leave Lightning's default process group (as DDP does) and MASTER_* variables:
    remove them after the test."""
    names = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK")
    saved = {k: os.environ.get(k) for k in names}
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.mark.distributed
def test_tp2_logits_match_transformers_and_weights_round_trip(two_processes):
    for rank_result in _results(two_processes, "logits"):
        assert set(rank_result) == {"tied", "untied", "qwen2"}
        for name, r in rank_result.items():
            assert r["local_vocab"] == 49152 // 2, name  # each rank computes half of the vocabulary
            assert r["max_abs_diff"] < 1e-5, (name, r)
            assert r["logit_scale"] > 0.5, name
            assert r["same_names"] and r["bit_exact"], name


@pytest.mark.distributed
def test_tp2_vocab_parallel_logprobs_entropy_and_gradient(two_processes):
    for r in _results(two_processes, "logprobs"):
        assert r["tp"] == 2
        assert r["labels_on_other_ranks"] > 0  # the label logit had to come from the other rank
        assert r["logprob_diff"] < 1e-5 and r["entropy_diff"] < 1e-5
        assert r["grad_diff"] < 1e-5 and r["grad_scale"] > 0.1


@pytest.mark.distributed
def test_one_grpo_step_tp2_tp1_dp2_and_plain_agree(two_processes, files, restore_distributed_env):
    model, prompts = files["models"]["tied"], files["prompts"]
    plain, plain_loss, grad_norm = megatron_worker.run_one_step(model, prompts, "auto", 1, 4, CLIP)
    assert grad_norm > 10 * CLIP  # the clip is active, so the full-gradient norm under TP matters
    assert abs(plain_loss) > 1e-3
    in_process, tp1_loss, tp1_norm = megatron_worker.run_one_step(model, prompts, MegatronStrategy(1), 1, 4, CLIP)
    expected = plain.policy.state_dict()
    before = AutoModelForCausalLM.from_pretrained(model).state_dict()
    assert max((expected[k] - before[k]).abs().max() for k in expected) > 1e-2  # the step moved the weights
    tp2, dp2 = _results(two_processes, "step2"), _results(two_processes, "step1")
    runs = {
        "tp1 (1 process)": (tp1_loss, [tp1_norm], in_process.policy.state_dict()),
        "tp2 (2 processes)": (tp2[0]["loss"], [r["grad_norm"] for r in tp2],
                              torch.load(two_processes / "step_tp2_weights.pt", weights_only=True)),
        "tp1 x dp2 (2 processes)": (dp2[0]["loss"], [r["grad_norm"] for r in dp2],
                                    torch.load(two_processes / "step_tp1_weights.pt", weights_only=True)),
    }
    for name, (loss, norms, weights) in runs.items():
        assert loss == pytest.approx(plain_loss, abs=1e-6), name
        assert norms == pytest.approx([grad_norm] * len(norms), rel=1e-5), name  # the full, DP-averaged gradient
        assert sorted(weights) == sorted(expected), name
        for key, value in expected.items():
            torch.testing.assert_close(weights[key], value, atol=1e-5, rtol=0, msg=f"{name}: {key}")
    for result in _results(two_processes, "step2") + _results(two_processes, "step1"):
        assert result["policy_type"] == "LlamaForCausalLM"  # the HF policy is handed back after fit
        assert result["model_parallel_initialized"] is False and result["cpu_shims"] is False
        assert result["new_process_groups"] == 0  # the model-parallel groups are destroyed


@pytest.mark.distributed
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_a_bf16_grpo_step_at_tp2_agrees_with_plain_training_to_bf16_rounding(two_processes, files,
                                                                             restore_distributed_env, precision):
    """Issue 44: under "bf16-mixed" (float32 megatron-core weights, bf16 autocast) and "bf16-true" (megatron-core built
    in bfloat16), a TP=2 step agrees with plain one-process training in the same precision to bfloat16's bounds
    (support/bf16.py: loss and gradient norm 4 u relative; the SGD step (lr 5) moves each weight by lr * g, so the
    weights agree to lr * 4 u max|g| (gradient clipped to norm CLIP: max|g| <= CLIP), plus one bfloat16 spacing of the
    weights where they are bfloat16)."""
    from support.bf16 import U

    model, prompts = files["models"]["tied"], files["prompts"]
    plain, plain_loss, plain_norm = megatron_worker.run_one_step(model, prompts, "auto", 1, 4, CLIP,
                                                                 precision=precision)
    expected = plain.policy.state_dict()
    result, other = (r[precision] for r in _results(two_processes, "bf16_step"))
    assert result == other  # both ranks logged the same step
    assert result["megatron_dtypes"] == ["torch.float32" if precision == "bf16-mixed" else "torch.bfloat16"]
    assert math.isfinite(result["loss"]) and result["loss"] == pytest.approx(plain_loss, rel=4 * U, abs=1e-6)
    assert result["grad_norm"] == pytest.approx(plain_norm, rel=4 * U)
    weights = torch.load(two_processes / f"bf16_step_{precision}_weights.pt", weights_only=True)
    assert sorted(weights) == sorted(expected)
    for key, value in expected.items():
        spacing = 2 * U * float(value.float().abs().max()) if value.dtype == torch.bfloat16 else 0.0
        torch.testing.assert_close(weights[key].float(), value.float(), atol=5.0 * 4 * U * CLIP + spacing, rtol=0,
                                   msg=key)


@pytest.mark.distributed
def test_trainer_three_steps_with_hf_rollouts_then_resume(tmp_path, files):
    import csv
    import glob

    _torchrun(tmp_path, [["train", {"model_path": files["models"]["tied"], "data_path": files["prompts"]}]])
    rank0, rank1 = _results(tmp_path, "train")
    for r in (rank0, rank1):
        assert r["first_global_step"] == 3 and r["resumed_global_step"] == 5
        assert r["first_policy_type"] == "LlamaForCausalLM"
        assert r["completions_match"] == [True, True, True]  # both TP ranks trained on rank 0's rollouts
        assert r["resumed_weights_equal"] and r["resumed_optimizer_equal"] and r["resumed_optimizer_has_moments"]
        assert r["checkpoint_optimizer_format"] == "megatron-hf"
        for left in (r["first_run_left"], r["resumed_run_left"]):
            # only Lightning's default group (created by the first fit, reused by the second) is left
            assert left == {"model_parallel_initialized": False, "new_process_groups": 1, "cpu_shims": False}
    assert rank0["hf_copy_current"] == [True, True, True]  # every rollout sampled from the current weights
    hf_names = sorted("policy." + k for k in AutoModelForCausalLM.from_pretrained(files["models"]["tied"]).state_dict())
    assert rank0["checkpoint_policy_keys"] == hf_names  # a TP-independent checkpoint in HF names

    (metrics_path,) = glob.glob(str(tmp_path / "logs" / "**" / "metrics.csv"), recursive=True)
    with open(metrics_path) as f:
        rows = [row for row in csv.DictReader(f) if row.get("loss")]
    assert [int(row["step"]) for row in rows] == [0, 1, 2]
    # sums are over the data-parallel group (here one group): TP ranks are not counted twice
    assert [float(row["num_tokens"]) for row in rows] == [float(t) for t in rank0["step_tokens"]]
    for row in rows:
        assert float(row["kl"]) >= 0 and float(row["entropy"]) > 0 and 1 <= float(row["completions/mean_length"]) <= 8

    first = torch.load(tmp_path / "train_final_weights.pt", weights_only=True)
    checkpoint = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["state_dict"]
    final = torch.load(tmp_path / "resumed_final_weights.pt", weights_only=True)
    export = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf_export")).state_dict()
    for name, value in first.items():
        assert torch.equal(checkpoint["policy." + name], value), name  # the last checkpoint is the end of run 1
        assert torch.equal(export[name], final[name]), name  # the export is the end of the resumed run
    assert max((final[k] - first[k]).abs().max() for k in first) > 0  # the resumed run trained


@pytest.mark.distributed
def test_a_distillation_teacher_is_converted_and_scored_as_in_plain_training(files, restore_distributed_env):
    """On-policy distillation under MegatronStrategy (TP=1, one process): the teacher is converted like the
    reference policy and scored with the vocab-parallel logprobs (an HF teacher has no such scorer), so the step's
    loss and updated weights equal the plain module's; the teacher changes them (against the same step without
    one), and the HF teacher is handed back after the fit."""
    from lightning_grpo.config import DistillationConfig

    model, prompts = files["models"]["tied"], files["prompts"]
    distill = {"distillation": DistillationConfig(teacher=files["models"]["untied"], reward_weight=1.0)}
    plain, plain_loss, _ = megatron_worker.run_one_step(model, prompts, "auto", 1, 4, CLIP, **distill)
    _, without_teacher_loss, _ = megatron_worker.run_one_step(model, prompts, "auto", 1, 4, CLIP)
    assert abs(plain_loss - without_teacher_loss) > 1e-3
    megatron, loss, _ = megatron_worker.run_one_step(model, prompts, MegatronStrategy(1), 1, 4, CLIP, **distill)
    assert loss == pytest.approx(plain_loss, abs=1e-6)
    expected = plain.policy.state_dict()
    for key, value in megatron.policy.state_dict().items():
        torch.testing.assert_close(value, expected[key], atol=1e-5, rtol=0, msg=key)
    assert type(megatron.teacher_model).__name__ == "LlamaForCausalLM"


def test_unsupported_layouts_are_refused_naming_the_option():
    with pytest.raises(ValueError, match=r"virtual_pipeline_model_parallel_size=2\): the interleaved"):
        MegatronStrategy(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match=r"expert_model_parallel_size=0\) must be >= 1"):
        MegatronStrategy(expert_model_parallel_size=0)
    with pytest.raises(ValueError, match=r"expert_tensor_parallel_size=0\) must be >= 1"):
        MegatronStrategy(expert_tensor_parallel_size=0)
    with pytest.raises(ValueError, match="pipeline_model_parallel_size=0"):
        MegatronStrategy(pipeline_model_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_model_parallel_size=0"):
        MegatronStrategy(tensor_model_parallel_size=0)


def test_model_parallel_size_must_divide_the_processes(files, restore_distributed_env):
    message = r"TP x PP = 2 must divide the number of processes \(world size 1\)"
    for strategy in (MegatronStrategy(2), MegatronStrategy(pipeline_model_parallel_size=2)):
        with pytest.raises(ValueError, match=message):
            megatron_worker.run_one_step(files["models"]["tied"], files["prompts"], strategy, 1, 4, None)
    experts = r"EP x ETP = 2 must divide TP x DP = 1 \(the expert groups are carved out of the data-parallel replicas"
    with pytest.raises(ValueError, match=experts):
        megatron_worker.run_one_step(files["models"]["tied"], files["prompts"],
                                     MegatronStrategy(expert_model_parallel_size=2), 1, 4, None)


MEGATRON_RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "megatron.yaml")


@pytest.mark.parametrize("args, update", [
    # --optimizer SGD(lr=0.5) with --lr_scheduler ConstantLR(factor=0.5): exactly -0.25 * grad
    (["--optimizer", "torch.optim.SGD", "--optimizer.lr", "0.5", "--lr_scheduler",
      "torch.optim.lr_scheduler.ConstantLR", "--lr_scheduler.factor", "0.5"], lambda grad: -0.25 * grad),
    # the module's own AdamW (learning_rate=0.01): the first step is exactly -0.01 * g / (|g| + 1e-8)
    (["--model.learning_rate", "0.01"], lambda grad: -0.01 * grad / (grad.abs() + 1e-8)),
], ids=["cli_sgd_constant_lr", "module_adamw"])
def test_the_chosen_optimizer_steps_the_megatron_weights(tmp_path, tiny_llama_path, restore_distributed_env, args,
                                                         update):
    """``lightning-grpo fit --config recipes/megatron.yaml`` (one process): the optimizer is built over the converted
    megatron-core parameters, which the first step moves by the optimizer's formula (the CLI's optimizer used to be
    built over the HF policy's, and the Megatron weights never changed)."""
    from support.first_step import assert_first_step, cli_first_step

    probe, cli = cli_first_step(tiny_llama_path, tmp_path, "--config", MEGATRON_RECIPE, *args)
    assert type(cli.trainer.strategy) is MegatronStrategy
    assert all(name.startswith("model.") for name in probe.trainable)  # megatron-core's GPTModel's parameters
    assert_first_step(probe, update)


def test_an_optimizer_over_the_hf_policy_is_refused_under_megatron(tmp_path, tiny_llama_path, restore_distributed_env):
    """An optimizer built before configure_model (over the HF policy, as LightningCLI built ``--optimizer``) holds
    none of the parameters MegatronStrategy trains: the fit stops at its start, naming configure_optimizers."""
    import lightning as L

    from lightning_grpo import GRPOModule
    from lightning_grpo.config import EngineConfig, GRPOConfig
    from lightning_grpo.data import PromptDataModule
    from support.first_step import write_prompts

    class Early(GRPOModule):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.early = [torch.optim.SGD(self.policy.parameters(), lr=0.1)]  # before the conversion

        def configure_optimizers(self):
            return self.early[0]

    module = Early(tiny_llama_path, reward_funcs=["gsm8k_accuracy"], export_dir="",
                   config=GRPOConfig(num_generations=2, top_k=0, engine=EngineConfig(name="hf")))
    trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=1, strategy=MegatronStrategy(), logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path))
    message = (r"configure_optimizers returned an optimizer over 21 parameters that the trained policy "
               r"\(MegatronPolicy\) does not hold")
    with pytest.raises(ValueError, match=message):
        trainer.fit(module, datamodule=PromptDataModule(dataset=write_prompts(tmp_path / "p.jsonl"),
                                                        prompts_per_step=2, val_size=0))


def test_the_distributed_optimizer_refuses_the_optimizers_it_cannot_build():
    from lightning_grpo.strategies.megatron.optimizer import megatron_optimizer_config

    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))]
    refused = {
        r"SGD is neither torch.optim.AdamW nor Adam": torch.optim.SGD(params, lr=0.1),
        r"AdamW\(amsgrad=True\) has no megatron-core equivalent": torch.optim.AdamW(params, amsgrad=True),
        r"takes an optimizer with one param group, got 2": torch.optim.AdamW([{"params": params[:1]},
                                                                             {"params": params[1:]}]),
    }
    for message, optimizer in refused.items():
        with pytest.raises(ValueError, match=message):
            megatron_optimizer_config(optimizer, torch.float32)
