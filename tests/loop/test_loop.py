"""The generate-then-train loop through a plain ``L.Trainer`` on a tiny random Llama."""

import gc
import json
import os
import weakref

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from transformers import AutoModelForCausalLM

from lightning_grpo import GRPOConfig, GRPOModule
from lightning_grpo.data import PromptDataModule
from support.fixtures import alternating_reward, make_cpu_trainer, read_metrics_rows

METRICS = [
    "reward", "reward_std", "rewards/gsm8k_accuracy/mean", "rewards/gsm8k_format/mean", "frac_reward_zero_std",
    "completions/mean_length", "completions/clipped_ratio", "clip_ratio/region_mean", "kl", "entropy", "loss",
    "grad_norm", "timing/rollout_s", "timing/train_s", "tokens_per_s", "val/accuracy",
]


def _module(path, **config):
    config = {"num_generations": 4, "max_new_tokens": 8, "max_prompt_length": 256, **config}
    rewards = ["gsm8k_accuracy", "gsm8k_format", alternating_reward]
    return GRPOModule(path, reward_funcs=rewards, config=GRPOConfig(**config), learning_rate=1e-3)


class StepRecorder(Callback):
    """Records each optimizer step's experience micro-batches and the weights after each step."""

    def __init__(self):
        self.batches, self.after_step, self.grads, self.steps = [], [], [], 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.batches.append(batch)

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.steps += 1
        params = module.policy.named_parameters()
        self.grads.append({n: p.grad.detach().clone() for n, p in params if p.grad is not None})

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch.step_end:
            self.after_step.append({k: v.detach().clone() for k, v in module.policy.state_dict().items()})


def test_three_steps_log_checkpoint_and_export(tmp_path, tiny_llama_path, cpu_trainer, metrics_rows):
    module = _module(tiny_llama_path, beta=0.04)
    datamodule = PromptDataModule(prompts_per_step=2, val_size=4, val_batch_size=4)
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True, every_n_train_steps=1)
    trainer = cpu_trainer(3, callbacks=[checkpoint], val_check_interval=3, check_val_every_n_epoch=None)
    trainer.fit(module, datamodule=datamodule)

    assert trainer.global_step == 3
    rows = metrics_rows()
    assert set(METRICS) <= set(rows[0])
    train_rows = [r for r in rows if r["loss"] != ""]
    assert [int(r["step"]) for r in train_rows] == [0, 1, 2]
    for row in train_rows:
        assert float(row["reward"]) == pytest.approx(0.5)  # only the first-completion reward pays
        assert float(row["rewards/alternating_reward/mean"]) == pytest.approx(0.5)
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


def test_a_finished_fit_keeps_no_trainer_or_model_alive(tiny_llama_path, cpu_trainer):
    """Nothing of the package keeps a trainer after its fit: once the caller drops the trainer and the module, both
    are freed with their policy and optimizer (the installed loop holds its trainer, so a registry keyed by trainers
    kept every one of them, with its model, for the life of the process)."""

    def fit():
        module = _module(tiny_llama_path)
        trainer = cpu_trainer(1, logger=False)
        trainer.fit(module, datamodule=PromptDataModule(prompts_per_step=2))
        return trainer.global_step, [weakref.ref(obj) for obj in (trainer, trainer.fit_loop, module, module.policy,
                                                                   trainer.optimizers[0])]

    steps, refs = fit()
    gc.collect()
    assert steps == 1 and [ref() is None for ref in refs] == [True] * 5


def test_rollout_uses_the_weights_of_the_previous_step(tmp_path, tiny_llama_path, cpu_trainer):
    """Rollout k+1 must sample from the weights after step k: its old logprobs (computed right after the
    rollout) equal the logprobs under the weights recorded after step k."""
    recorder = StepRecorder()
    module = _module(tiny_llama_path, num_iterations=2)  # old logprobs are stored when num_iterations > 1
    trainer = cpu_trainer(4, callbacks=[recorder], logger=False)
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


def test_one_step_raises_the_rewarded_completion(tmp_path, tiny_llama_path, cpu_trainer):
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"question": "What is 1 + 1?", "answer": "2"}) + "\n")
    recorder = StepRecorder()
    module = GRPOModule(
        tiny_llama_path, reward_funcs=[alternating_reward],
        config=GRPOConfig(num_generations=2, max_new_tokens=8), learning_rate=1e-3,
    )
    before = AutoModelForCausalLM.from_pretrained(tiny_llama_path).eval()
    trainer = cpu_trainer(1, callbacks=[recorder], logger=False)
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


def test_resume_runs_exactly_the_remaining_steps(tmp_path, tiny_llama_path, cpu_trainer):
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True, every_n_train_steps=1)
    trainer = cpu_trainer(2, callbacks=[checkpoint], logger=False)
    trainer.fit(_module(tiny_llama_path), datamodule=PromptDataModule(prompts_per_step=2, val_size=0))
    assert trainer.global_step == 2

    recorder = StepRecorder()
    resumed = cpu_trainer(4, callbacks=[recorder], logger=False)
    resumed.fit(
        _module(tiny_llama_path), datamodule=PromptDataModule(prompts_per_step=2, val_size=0),
        ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"),
    )
    assert resumed.global_step == 4
    assert recorder.steps == 2
    # training resumed from the checkpoint's weights, not from scratch
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["state_dict"]
    assert state["policy.model.embed_tokens.weight"].shape[0] > 0


def test_accumulation_and_mini_batches_give_the_planned_number_of_steps(tmp_path, tiny_llama_path, cpu_trainer):
    recorder = StepRecorder()
    module = _module(tiny_llama_path, mini_batch_size=4, num_iterations=2)  # 8 sequences -> 2 mini x 2 passes
    trainer = cpu_trainer(4, callbacks=[recorder], logger=False, accumulate_grad_batches=2)
    trainer.fit(module, datamodule=PromptDataModule(prompts_per_step=2, val_size=0))
    assert recorder.steps == 4 and len(recorder.batches) == 8
    assert [len(b) for b in recorder.batches] == [2] * 8
    assert [b.step_end for b in recorder.batches] == [False, True] * 4
    assert all(b.loss_scale == 2.0 for b in recorder.batches)


def test_mini_batch_size_must_divide_the_rollout(tmp_path, tiny_llama_path, cpu_trainer):
    module = _module(tiny_llama_path, mini_batch_size=3)
    trainer = cpu_trainer(1, logger=False)
    with pytest.raises(ValueError, match="mini_batch_size=3"):
        trainer.fit(module, datamodule=PromptDataModule(prompts_per_step=2, val_size=0))


def _first_step_weights_and_batches(tmp_path, tiny_llama_path, accumulate, **config):
    recorder = StepRecorder()
    L.seed_everything(0)
    module = _module(tiny_llama_path, **config)
    trainer = make_cpu_trainer(tmp_path, 1, callbacks=[recorder], logger=CSVLogger(str(tmp_path), name="logs"),
                               accumulate_grad_batches=accumulate)
    trainer.fit(module, datamodule=PromptDataModule(prompts_per_step=2, val_size=0))
    grad_norm = float(next(r["grad_norm"] for r in read_metrics_rows(tmp_path) if r.get("grad_norm")))
    return recorder, grad_norm


def test_token_budget_step_equals_the_fixed_count_step(tmp_path, tiny_llama_path):
    """One optimizer step on the same rollout: 2 fixed micro-batches vs micro-batches formed by a token budget
    (a varying count, Trainer(accumulate_grad_batches=1)) give the same gradient (not the last micro-batch's
    alone: the gradients are zeroed once per step)."""
    fixed, fixed_norm = _first_step_weights_and_batches(tmp_path / "fixed", tiny_llama_path, 2)
    first = fixed.batches[0]
    per_sequence = int(first.prompt_mask.sum(dim=1).max()) + 8  # a budget of ~2.5 sequences of the rollout
    budget, budget_norm = _first_step_weights_and_batches(
        tmp_path / "budget", tiny_llama_path, 1, max_tokens_per_microbatch=int(per_sequence * 2.5)
    )
    assert len(fixed.batches) == 2
    assert len(budget.batches) >= 3 and budget.steps == 1  # several micro-batches, one optimizer step
    assert [b.step_end for b in budget.batches] == [False] * (len(budget.batches) - 1) + [True]
    assert [b.step_start for b in budget.batches] == [True] + [False] * (len(budget.batches) - 1)
    assert sum(len(b) for b in budget.batches) == 8
    assert budget_norm == pytest.approx(fixed_norm, rel=1e-5)
    assert set(budget.grads[0]) == set(fixed.grads[0])
    for name, grad in fixed.grads[0].items():
        torch.testing.assert_close(budget.grads[0][name], grad, atol=1e-7, rtol=1e-4, msg=name)


def test_step_time_breakdown_is_logged(tmp_path, tiny_llama_path, cpu_trainer, metrics_rows):
    trainer = cpu_trainer(2, accumulate_grad_batches=2)
    trainer.fit(_module(tiny_llama_path), datamodule=PromptDataModule(prompts_per_step=2, val_size=0))
    rows = [r for r in metrics_rows() if r.get("timing/step_s")]
    assert len(rows) == 2
    parts = ["rollout_s", "scoring_s", "logprobs_s", "sync_s", "forward_s", "backward_s", "optimizer_s"]
    for row in rows:
        values = {k: float(row[f"timing/{k}"]) for k in parts}
        assert all(v >= 0 for v in values.values())
        assert min(values["rollout_s"], values["forward_s"], values["backward_s"], values["optimizer_s"]) > 0
        assert float(row["timing/other_s"]) >= 0
        assert float(row["timing/step_s"]) == pytest.approx(sum(values.values()) + float(row["timing/other_s"]))
        assert float(row["generated_tokens"]) == pytest.approx(8 * float(row["completions/mean_length"]))
        assert float(row["train_tokens"]) > float(row["generated_tokens"])


def test_token_budget_resume_skips_the_drawn_prompt_batches(tmp_path, tiny_llama_path, cpu_trainer):
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True, every_n_train_steps=1)
    config = {"max_tokens_per_microbatch": 64}
    trainer = cpu_trainer(2, callbacks=[checkpoint], logger=False)
    trainer.fit(_module(tiny_llama_path, **config), datamodule=PromptDataModule(prompts_per_step=2, val_size=0))
    assert trainer.global_step == 2
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert saved["loops"]["fit_loop"]["state_dict"]["rollout_cursors"][0]["prompt_batches_drawn"] == 2

    class DrawnRecorder(StepRecorder):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.drawn = trainer.fit_loop._data_fetcher.cursor.prompt_batches_drawn

    recorder = DrawnRecorder()
    resumed = cpu_trainer(4, callbacks=[recorder], logger=False)
    module = _module(tiny_llama_path, **config)
    resumed.fit(module, datamodule=PromptDataModule(prompts_per_step=2, val_size=0),
                ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert resumed.global_step == 4 and recorder.steps == 2
    assert resumed.fit_loop.resume_state["prompt_batches_drawn"] == 2
    assert recorder.drawn == 4  # 2 skipped + 2 trained on

    # a checkpoint without the position (not written by GRPOFitLoop) inside an epoch is refused, not guessed
    del saved["loops"]["fit_loop"]["state_dict"]["rollout_cursors"]
    torch.save(saved, tmp_path / "foreign.ckpt")
    with pytest.raises(ValueError, match="holds no 'rollout_cursors'"):
        cpu_trainer(4, logger=False).fit(_module(tiny_llama_path, **config),
                                                datamodule=PromptDataModule(prompts_per_step=2, val_size=0),
                                                ckpt_path=str(tmp_path / "foreign.ckpt"))


def test_token_budget_needs_accumulate_grad_batches_1(tmp_path, tiny_llama_path, cpu_trainer):
    trainer = cpu_trainer(1, logger=False, accumulate_grad_batches=2)
    with pytest.raises(ValueError, match=r"max_tokens_per_microbatch=64 .*accumulate_grad_batches=1\), not 2"):
        trainer.fit(_module(tiny_llama_path, max_tokens_per_microbatch=64),
                    datamodule=PromptDataModule(prompts_per_step=2, val_size=0))
