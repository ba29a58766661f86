"""The generate-then-train loop through a plain ``L.Trainer`` on a tiny random Llama."""

import csv
import glob
import json
import os

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from transformers import AutoModelForCausalLM

from lightning_grpo import GRPOConfig, GRPOModule
from lightning_grpo.data import PromptDataModule

METRICS = [
    "reward", "reward_std", "rewards/gsm8k_accuracy/mean", "rewards/gsm8k_format/mean", "frac_reward_zero_std",
    "completions/mean_length", "completions/clipped_ratio", "clip_ratio/region_mean", "kl", "entropy", "loss",
    "grad_norm", "timing/rollout_s", "timing/train_s", "tokens_per_s", "val/accuracy",
]


def _trainer(tmp_path, max_steps, **kwargs):
    kwargs.setdefault("logger", CSVLogger(str(tmp_path), name="logs"))
    return L.Trainer(
        max_steps=max_steps, accelerator="cpu", devices=1, log_every_n_steps=1, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(tmp_path), **kwargs
    )


def _reward_first_completion(prompts, completions, **kwargs):
    """1 for the even-numbered completions, 0 for the others: a reward that varies in every group of a random model."""
    return [1.0 if i % 2 == 0 else 0.0 for i in range(len(completions))]


def _module(path, **config):
    config = {"num_generations": 4, "max_new_tokens": 8, "max_prompt_length": 256, **config}
    rewards = ["gsm8k_accuracy", "gsm8k_format", _reward_first_completion]
    return GRPOModule(path, reward_funcs=rewards, config=GRPOConfig(**config), learning_rate=1e-3)


def _read_csv(tmp_path):
    (path,) = glob.glob(str(tmp_path / "logs" / "**" / "metrics.csv"), recursive=True)
    with open(path) as f:
        return list(csv.DictReader(f))


class StepRecorder(Callback):
    """Records each optimizer step's experience micro-batches and the weights after each step."""

    def __init__(self):
        self.batches, self.after_step, self.steps = [], [], 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.batches.append(batch)

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.steps += 1

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch.step_end:
            self.after_step.append({k: v.detach().clone() for k, v in module.policy.state_dict().items()})


def test_three_steps_log_checkpoint_and_export(tmp_path, tiny_llama_path):
    module = _module(tiny_llama_path, beta=0.04)
    datamodule = PromptDataModule(prompts_per_step=2, val_size=4, val_batch_size=4)
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True, every_n_train_steps=1)
    trainer = _trainer(tmp_path, 3, callbacks=[checkpoint], val_check_interval=3, check_val_every_n_epoch=None)
    trainer.fit(module, datamodule=datamodule)

    assert trainer.global_step == 3
    rows = _read_csv(tmp_path)
    assert set(METRICS) <= set(rows[0])
    train_rows = [r for r in rows if r["loss"] != ""]
    assert [int(r["step"]) for r in train_rows] == [0, 1, 2]
    for row in train_rows:
        assert float(row["reward"]) == pytest.approx(0.5)  # only the first-completion reward pays
        assert float(row["rewards/_reward_first_completion/mean"]) == pytest.approx(0.5)
        assert 1 <= float(row["completions/mean_length"]) <= 8
        assert float(row["kl"]) >= 0 and float(row["entropy"]) > 0 and float(row["grad_norm"]) > 0
    assert float(train_rows[0]["kl"]) == pytest.approx(0.0, abs=1e-6)  # policy == reference before step 1
    assert float(train_rows[2]["kl"]) > 0
    assert [r["val/accuracy"] for r in rows if r["val/accuracy"] != ""] == ["0.0"]  # a random model solves nothing
    assert os.path.exists(tmp_path / "ckpt" / "last.ckpt")
    export = module.export_path()
    reloaded = AutoModelForCausalLM.from_pretrained(export)
    for name, value in module.policy.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], value, rtol=0, atol=0)


def test_rollout_uses_the_weights_of_the_previous_step(tmp_path, tiny_llama_path):
    """Rollout k+1 must sample from the weights after step k: its old logprobs (computed right after the
    rollout) equal the logprobs under the weights recorded after step k."""
    recorder = StepRecorder()
    module = _module(tiny_llama_path, num_iterations=2)  # old logprobs are stored when num_iterations > 1
    trainer = _trainer(tmp_path, 4, callbacks=[recorder], logger=False)
    trainer.fit(module, datamodule=PromptDataModule(prompts_per_step=2, val_size=0))
    firsts = [b for i, b in enumerate(recorder.batches) if i % 2 == 0]  # first micro-batch of rollouts 1 and 2
    assert len(recorder.batches) == 4 and recorder.steps == 4
    probe = AutoModelForCausalLM.from_pretrained(tiny_llama_path)
    for rollout, weights in ((firsts[1], recorder.after_step[1]),):
        probe.load_state_dict(weights)
        probe.eval()
        with torch.no_grad():
            logprobs, _ = module.completion_logprobs(probe, rollout)
        mask = rollout.completion_mask.bool()
        torch.testing.assert_close(logprobs[mask], rollout.old_logprobs[mask], atol=1e-5, rtol=0)
    # ...and not the weights after step 1 (the previous rollout's first step)
    probe.load_state_dict(recorder.after_step[0])
    with torch.no_grad():
        stale, _ = module.completion_logprobs(probe, firsts[1])
    assert (stale - firsts[1].old_logprobs)[firsts[1].completion_mask.bool()].abs().max() > 1e-4


def test_one_step_raises_the_rewarded_completion(tmp_path, tiny_llama_path):
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"question": "What is 1 + 1?", "answer": "2"}) + "\n")
    recorder = StepRecorder()
    module = GRPOModule(
        tiny_llama_path, reward_funcs=[_reward_first_completion],
        config=GRPOConfig(num_generations=2, max_new_tokens=8), learning_rate=1e-3,
    )
    before = AutoModelForCausalLM.from_pretrained(tiny_llama_path).eval()
    trainer = _trainer(tmp_path, 1, callbacks=[recorder], logger=False)
    trainer.fit(module, datamodule=PromptDataModule(dataset=str(data), prompts_per_step=1, val_size=0))
    (batch,) = recorder.batches
    torch.testing.assert_close(batch.advantages, torch.tensor([0.7071, -0.7071]), atol=1e-3, rtol=0)
    module.policy.eval()
    with torch.no_grad():
        old, _ = module.completion_logprobs(before, batch)
        new, _ = module.completion_logprobs(module.policy, batch)
    mask = batch.completion_mask.bool()
    summed_old = torch.where(mask, old, 0.0).sum(1)
    summed_new = torch.where(mask, new, 0.0).sum(1)
    assert summed_new[0] > summed_old[0] + 1e-3  # rewarded completion more likely
    assert summed_new[1] < summed_old[1] - 1e-3  # the other less likely


def test_resume_runs_exactly_the_remaining_steps(tmp_path, tiny_llama_path):
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True, every_n_train_steps=1)
    trainer = _trainer(tmp_path, 2, callbacks=[checkpoint], logger=False)
    trainer.fit(_module(tiny_llama_path), datamodule=PromptDataModule(prompts_per_step=2, val_size=0))
    assert trainer.global_step == 2

    recorder = StepRecorder()
    resumed = _trainer(tmp_path, 4, callbacks=[recorder], logger=False)
    resumed.fit(
        _module(tiny_llama_path), datamodule=PromptDataModule(prompts_per_step=2, val_size=0),
        ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"),
    )
    assert resumed.global_step == 4
    assert recorder.steps == 2
    # training resumed from the checkpoint's weights, not from scratch
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["state_dict"]
    assert state["policy.model.embed_tokens.weight"].shape[0] > 0


def test_accumulation_and_mini_batches_give_the_planned_number_of_steps(tmp_path, tiny_llama_path):
    recorder = StepRecorder()
    module = _module(tiny_llama_path, mini_batch_size=4, num_iterations=2)  # 8 sequences -> 2 mini x 2 passes
    trainer = _trainer(tmp_path, 4, callbacks=[recorder], logger=False, accumulate_grad_batches=2)
    trainer.fit(module, datamodule=PromptDataModule(prompts_per_step=2, val_size=0))
    assert recorder.steps == 4 and len(recorder.batches) == 8
    assert [len(b) for b in recorder.batches] == [2] * 8
    assert [b.step_end for b in recorder.batches] == [False, True] * 4
    assert all(b.loss_scale == 2.0 for b in recorder.batches)


def test_mini_batch_size_must_divide_the_rollout(tmp_path, tiny_llama_path):
    module = _module(tiny_llama_path, mini_batch_size=3)
    trainer = _trainer(tmp_path, 1, logger=False)
    with pytest.raises(ValueError, match="mini_batch_size=3"):
        trainer.fit(module, datamodule=PromptDataModule(prompts_per_step=2, val_size=0))
