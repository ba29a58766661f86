"""Validation and test with sampled pass@k / maj@k / mean@k through a plain Trainer, per dataset."""

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_grpo import GRPOConfig, GRPOModule
from lightning_grpo.config import EvalConfig
from lightning_grpo.data import PromptDataModule


def test_validation_logs_pass_at_k_maj_and_mean_for_each_dataset(tmp_path, tiny_llama_path, cpu_trainer, metrics_rows,
                                                                  alternating_reward):
    config = GRPOConfig(num_generations=2, max_new_tokens=4, max_prompt_length=400, eval=EvalConfig(num_samples=4, k=2))
    module = GRPOModule(tiny_llama_path, reward_funcs=[alternating_reward], config=config)
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), monitor="val/pass@2", mode="max")
    trainer = cpu_trainer(1, callbacks=[checkpoint], val_check_interval=1, check_val_every_n_epoch=None,
                          num_sanity_val_steps=0)
    data = PromptDataModule(prompts_per_step=2, val_size=4, val_batch_size=2, eval_datasets=["math500"])
    trainer.fit(module, datamodule=data)

    (row,) = [r for r in metrics_rows() if r.get("val/accuracy")]
    # samples of every prompt score 1, 0, 1, 0 (by position): unbiased pass@1 = 1/2, pass@2 = 1 - C(2,2)/C(4,2)
    assert float(row["val/pass@1"]) == pytest.approx(0.5)
    assert float(row["val/pass@2"]) == pytest.approx(1 - 1 / 6)
    assert float(row["val/mean@2"]) == pytest.approx(0.5)
    assert 0.0 <= float(row["val/maj@2"]) <= 1.0
    assert float(row["val/accuracy"]) == pytest.approx(0.5)  # greedy batches of 2: scores 1, 0
    # MATH-500 is checked by its own reward (math_accuracy: a random model gets 0), logged under its name
    assert float(row["val/math500/accuracy"]) == 0.0 and float(row["val/math500/pass@2"]) == 0.0
    assert checkpoint.best_model_score is not None and float(checkpoint.best_model_score) == pytest.approx(1 - 1 / 6)


def test_test_stage_evaluates_an_hf_folder(tmp_path, tiny_llama_path, cpu_trainer, alternating_reward):
    config = GRPOConfig(num_generations=2, max_new_tokens=4, max_prompt_length=400)
    module = GRPOModule(tiny_llama_path, reward_funcs=[alternating_reward], config=config)
    trainer = cpu_trainer()
    (results,) = trainer.test(module, datamodule=PromptDataModule(val_size=4, val_batch_size=4))
    assert results["test/accuracy"] == pytest.approx(0.5) and results["test/pass@1"] == pytest.approx(0.5)


def test_cli_test_subcommand_evaluates_gsm8k_and_math500_from_the_eval_recipe(tmp_path, tiny_llama_path):
    from pathlib import Path

    from lightning_grpo.cli import GRPOCLI
    from lightning_grpo.data import PromptDataModule as Data

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "eval.yaml"
    cli = GRPOCLI(GRPOModule, Data, args=["--config", str(recipe), "--model.model", tiny_llama_path,
                                           "--model.config.engine.name", "hf", "--model.config.max_new_tokens", "4",
                                           "--data.val_size", "2", "--data.val_batch_size", "2",
                                           "--trainer.default_root_dir", str(tmp_path),
                                           "--trainer.logger.init_args.save_dir", str(tmp_path),
                                           "--trainer.enable_progress_bar", "false"], run=False)
    assert cli.datamodule.eval_names == ["gsm8k", "math500"]
    assert cli.datamodule.eval_accuracy == [None, "math_accuracy"]  # the module's for the first, the preset's
    gsm8k, math500 = cli.trainer.test(cli.model, datamodule=cli.datamodule)  # one dict per dataset
    assert {"test/accuracy", "test/pass@1", "test/mean_length"} <= set(gsm8k)
    assert {"test/math500/accuracy", "test/math500/pass@1"} <= set(math500)
    assert math500["test/math500/accuracy"] == 0.0  # a random tiny model solves no MATH problem


def test_validate_before_fit_then_validate_after(tmp_path, tiny_llama_path, cpu_trainer, metrics_rows,
                                                 alternating_reward):
    # trainer.validate makes the metric states under inference mode; the fit's validation updates them without it
    config = GRPOConfig(num_generations=2, max_new_tokens=4, max_prompt_length=400, eval=EvalConfig(num_samples=2))
    module = GRPOModule(tiny_llama_path, reward_funcs=[alternating_reward], config=config)
    trainer = cpu_trainer(1, val_check_interval=1, check_val_every_n_epoch=None, num_sanity_val_steps=0)
    data = PromptDataModule(prompts_per_step=2, val_size=4, val_batch_size=2)
    trainer.validate(module, datamodule=data)
    trainer.fit(module, datamodule=data)
    rows = [r for r in metrics_rows() if r.get("val/pass@1")]
    assert len(rows) == 2 and all(float(r["val/pass@1"]) == pytest.approx(0.5) for r in rows)
