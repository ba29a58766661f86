"""The recipes: every YAML parses (fast); the main recipe (``recipes/gsm8k_grpo.yaml``, what the README's
``scripts/train.sh`` runs) validates, trains one step and validates on the real SmolLM2-135M-Instruct with the engine
it picks (vLLM where installed; slow); every other recipe's wiring (its rows, report lines, plot, completion table,
checkpoint names) runs one or two steps on the tiny random Llama with SmolLM2's tokenizer and the HF engine.
``recipes/server_async.yaml`` runs against a real rollout server in tests/rollout/server/test_vllm_server.py."""

import csv
import glob
import importlib.util
import os
from pathlib import Path

import pytest

from lightning_grpo.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[1]
#: YAML recipe -> the subcommand it is for, and the base recipe an overlay stacks on.
YAML_RECIPES = {"gsm8k_grpo.yaml": ("fit", None), "arithmetic_grpo.yaml": ("fit", None), "eval.yaml": ("test", None),
                "server_async.yaml": ("fit", "gsm8k_grpo.yaml"), "code_grpo.yaml": ("fit", None),
                "megatron.yaml": ("fit", "gsm8k_grpo.yaml")}


def _rows(root):
    (path,) = glob.glob(os.path.join(root, "**", "metrics.csv"), recursive=True)
    with open(path) as f:
        return list(csv.DictReader(f))


def test_every_yaml_recipe_is_listed_here():
    assert sorted(p.name for p in (ROOT / "recipes").glob("*.yaml")) == sorted(YAML_RECIPES)


@pytest.mark.parametrize("name", sorted(YAML_RECIPES))
def test_every_yaml_recipe_parses(name, capsys):
    """``lightning-grpo <subcommand> --config <recipe> --print_config``: every key is an option of the CLI (a
    misspelled or removed option is a parser error)."""
    subcommand, base = YAML_RECIPES[name]
    configs = [a for b in ([base] if base else []) + [name] for a in ("--config", str(ROOT / "recipes" / b))]
    with pytest.raises(SystemExit) as exit_info:
        cli_main([subcommand, *configs, "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "model:" in printed and "data:" in printed


@pytest.mark.slow
@pytest.mark.engine  # engine "auto": vLLM where installed
def test_yaml_recipe_one_step_on_smollm2(tmp_path, smollm2_path, capsys):
    cli_main([
        "fit", "--config", str(ROOT / "recipes" / "gsm8k_grpo.yaml"),
        "--trainer.max_steps", "1", "--trainer.accumulate_grad_batches", "1", "--trainer.val_check_interval", "1",
        "--trainer.default_root_dir", str(tmp_path), "--trainer.logger.init_args.save_dir", str(tmp_path),
        "--data.prompts_per_step", "1", "--data.val_size", "2", "--data.val_batch_size", "2",
        "--model.config.num_generations", "2", "--model.config.max_new_tokens", "24",
        "--model.config.eval.max_new_tokens", "24", "--model.export_dir", str(tmp_path / "hf"),
    ])
    rows = _rows(tmp_path)
    (train,) = [r for r in rows if r["loss"]]
    assert 0 <= float(train["reward"]) <= 1.2
    assert 1 <= float(train["completions/mean_length"]) <= 24
    validations = [r for r in rows if r["val/accuracy"]]
    assert len(validations) == 2  # validate_before_fit, then after the step (both logged at step 0: max_steps 1)
    assert (tmp_path / "hf" / "model.safetensors").exists()
    (checkpoint,) = glob.glob(str(tmp_path / "**" / "checkpoints" / "*.ckpt"), recursive=True)  # one copy
    assert os.path.basename(checkpoint) == "last.ckpt"  # (every_n_train_steps 10 > 1 step: no step checkpoint)
    # the end-of-fit report: before/after table from metrics.csv, then the paths
    out = capsys.readouterr().out
    before, after = (float(r["val/accuracy"]) for r in validations)
    (line,) = [x for x in out.splitlines() if x.startswith("held-out val/accuracy")]
    assert line.split()[-3:] == [f"{before:.3f}", f"{after:.3f}", f"{after - before:+.3f}"]
    assert "train rewards/gsm8k_format/mean (first/last 5 steps)" in out
    folder = os.path.dirname(os.path.dirname(checkpoint))
    assert f"plot:        {folder}/metrics.png" in out and os.path.exists(f"{folder}/metrics.png")
    assert f"completions: {folder}/completions.csv" in out and f"checkpoint:  {folder}/checkpoints/last.ckpt" in out


def test_python_recipe_one_step(tmp_path, tiny_llama_path):
    spec = importlib.util.spec_from_file_location("gsm8k_grpo", ROOT / "recipes" / "gsm8k_grpo.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    trainer = recipe.main(max_steps=1, prompts_per_step=1, num_generations=2, max_new_tokens=16, val_size=2,
                          accumulate_grad_batches=1, root=str(tmp_path), model=tiny_llama_path, engine="hf")
    assert trainer.global_step == 1
    assert [r for r in _rows(tmp_path) if r["val/accuracy"]]


def test_arithmetic_recipe_validates_trains_validates_and_reports(tmp_path, tiny_llama_path, capsys):
    spec = importlib.util.spec_from_file_location("arithmetic_grpo", ROOT / "recipes" / "arithmetic_grpo.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    summary = recipe.main(max_steps=2, prompts_per_step=2, num_generations=2, max_new_tokens=16, val_size=4,
                          eval_samples=2, engine="hf", root=str(tmp_path), model=tiny_llama_path)
    rows = _rows(tmp_path)
    validations = [r for r in rows if r["val/accuracy"]]
    assert [int(r["step"]) for r in validations] == [0, 1]  # before training; after the last step (logged at step 1)
    assert summary["heldout_accuracy"] == {"before": float(validations[0]["val/accuracy"]),
                                           "after": float(validations[1]["val/accuracy"])}
    assert summary["curve"]["step"] == [0, 1]
    assert os.path.exists(summary["plot"]) and os.path.exists(summary["completions"])
    out = capsys.readouterr().out
    assert "held-out accuracy (greedy)" in out and f"plot: {summary['plot']}" in out


def test_arithmetic_recipe_distills_from_a_teacher_folder(tmp_path, tiny_llama_path, tiny_tied_llama_path):
    """``teacher`` and ``val_every`` (benchmarks/distillation.py's distillation stage): the student trains on the
    reverse KL to the teacher folder (logged every step), validates every step as well, and records its settings."""
    spec = importlib.util.spec_from_file_location("arithmetic_grpo", ROOT / "recipes" / "arithmetic_grpo.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    summary = recipe.main(max_steps=2, prompts_per_step=2, num_generations=2, max_new_tokens=16, val_size=4,
                          eval_samples=2, engine="hf", root=str(tmp_path), model=tiny_llama_path, val_every=1,
                          teacher=tiny_tied_llama_path, distill_coef=0.5)
    assert [step for step, _ in summary["reverse_kl"]] == [0, 1]
    assert all(value != 0 for _, value in summary["reverse_kl"])  # two different random models
    assert [step for step, _ in summary["val_curve"]] == [0, 0, 1]  # before training, after steps 1 and 2
    assert summary["settings"]["teacher"] == tiny_tied_llama_path and summary["settings"]["distill_coef"] == 0.5
    assert summary["export"] == str(Path(summary["log_dir"]) / "hf_model") and os.path.isdir(summary["export"])


def test_arithmetic_yaml_recipe_one_step(tmp_path, tiny_llama_path):
    cli_main([
        "fit", "--config", str(ROOT / "recipes" / "arithmetic_grpo.yaml"), "--trainer.max_steps", "1",
        "--model.model", tiny_llama_path, "--model.config.engine.name", "hf",
        "--trainer.val_check_interval", "1",  # the recipe's interval is its last step (30); here that is step 1
        "--trainer.default_root_dir", str(tmp_path), "--trainer.logger.init_args.save_dir", str(tmp_path),
        "--data.prompts_per_step", "1", "--data.val_size", "2", "--data.val_batch_size", "2",
        "--model.config.num_generations", "2", "--model.config.max_new_tokens", "8",
        "--model.config.eval.max_new_tokens", "8", "--model.config.eval.num_samples", "2", "--model.export_dir", "",
    ])
    rows = _rows(tmp_path)
    assert [r for r in rows if r["loss"]] and [r for r in rows if r["val/pass@2"]]


def test_math_recipe_one_step(tmp_path, tiny_llama_path):
    spec = importlib.util.spec_from_file_location("math_grpo", ROOT / "recipes" / "math_grpo.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    trainer = recipe.main(max_steps=1, prompts_per_step=1, num_generations=2, max_new_tokens=8, val_size=2,
                          engine="hf", root=str(tmp_path), model=tiny_llama_path)
    assert trainer.global_step == 1


def test_eval_recipe_tests_a_model(tmp_path, tiny_llama_path):
    cli_main([
        "test", "--config", str(ROOT / "recipes" / "eval.yaml"), "--trainer.default_root_dir", str(tmp_path),
        "--model.model", tiny_llama_path, "--model.config.engine.name", "hf",
        "--trainer.logger.init_args.save_dir", str(tmp_path), "--data.val_size", "2", "--data.val_batch_size", "2",
        "--model.config.max_new_tokens", "8",
    ])
    (row,) = [r for r in _rows(tmp_path) if r.get("test/accuracy")]
    assert float(row["test/accuracy"]) in (0.0, 0.5, 1.0) and row["test/math500/accuracy"] != ""


def _tool_recipe():
    spec = importlib.util.spec_from_file_location("arithmetic_tools", ROOT / "recipes" / "arithmetic_tools.py")
    recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(recipe)
    return recipe


def test_tool_recipe_questions_are_seeded_disjoint_and_right():
    recipe = _tool_recipe()
    splits = recipe.tool_arithmetic_rows(200, 50, seed=3)
    assert splits == recipe.tool_arithmetic_rows(200, 50, seed=3) and len(splits["train"]) == 200
    questions = {split: {r["question"] for r in rows} for split, rows in splits.items()}
    assert not questions["train"] & questions["test"] and len(questions["train"]) == 200
    for row in splits["train"] + splits["test"]:
        a, op, b = row["question"].removeprefix("What is ").removesuffix("?").split()
        assert row["answer"] == str(int(a) * int(b) if op == "*" else int(a) + int(b))
        assert (100 <= int(a) <= 999) if op == "*" else (1000 <= int(a) <= 9999)
    assert "What is 314 * 271?" not in questions["train"] | questions["test"]  # the worked example
    text = recipe.ShortToolInstructions().instructions([{"function": {"name": "calculator", "description": "d"}}])
    assert "- calculator: d" in text and '"expression": "12 * 34"' in text


def test_tool_recipe_validates_trains_validates_and_reports(tmp_path, tiny_llama_path, capsys):
    summary = _tool_recipe().main(max_steps=2, prompts_per_step=2, num_generations=2, val_size=4, train_size=8,
                                  eval_samples=0, engine="hf", root=str(tmp_path), model=tiny_llama_path)
    rows = _rows(tmp_path)
    assert [int(r["step"]) for r in rows if r["val/accuracy"]] == [0, 1]
    assert all(r["turns/mean"] and r["tools/calls_per_episode"] for r in rows if r["loss"])
    assert summary["curve"]["step"] == [0, 1] and len(summary["curve"]["tool_calls_per_episode"]) == 2
    with open(summary["completions"]) as f:
        table = list(csv.DictReader(f))
    assert table and all(r["completion"].startswith("[model, ") and r["turns"] for r in table)
    assert "tool calls per episode" in capsys.readouterr().out
