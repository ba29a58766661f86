"""Documented commands, run as a new user would: the console script ``lightning-grpo`` in a fresh process, from an
empty working directory, with the recipe paths as written and only tiny overrides (a tiny model, one step, two
prompts, a few tokens, the HF engine).

* docs/cli.md and ``recipes/eval.yaml``: ``lightning-grpo validate --config recipes/eval.yaml --ckpt_path
  <run>/checkpoints/last.ckpt`` and ``lightning-grpo test ...`` on a checkpoint of ``lightning-grpo fit --config
  recipes/gsm8k_grpo.yaml``, whose checkpoint holds two weighted rewards where eval.yaml has one;
* docs/distributed.md: the 2-process CPU DDP command line.

``lightning-grpo serve --model ... --port ...`` as documented is run in tests/rollout/server/test_vllm_server.py.
"""

from __future__ import annotations

import csv
import glob
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.distributed, pytest.mark.slow]  # processes of their own, minutes on 2 cores

REPO = Path(__file__).resolve().parents[1]
TINY = ["--model.config.engine.name", "hf", "--model.config.max_new_tokens", "4", "--model.config.eval.max_new_tokens",
        "4", "--data.val_size", "2", "--data.val_batch_size", "2"]


def _data_dir() -> str:
    """The preset data folder this test session finds (a fresh process in another folder looks in the same)."""
    from lightning_grpo.data.datamodule import default_data_dirs

    found = [d for d in default_data_dirs() if (d / "gsm8k").is_dir() and (d / "math500").is_dir()]
    if not found:
        pytest.skip("no GSM8K / MATH-500 data folder (set LIGHTNING_GRPO_DATA_DIR)")
    return str(found[0])


_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK",
               "LOCAL_WORLD_SIZE")


def lightning_grpo(args: list[str], cwd: Path, timeout: float = 900) -> str:
    """``lightning-grpo ARGS`` in ``cwd``; returns its output, raises with it on failure."""
    script = Path(sys.executable).with_name("lightning-grpo")
    command = [str(script)] if script.exists() else [sys.executable, "-m", "lightning_grpo.cli"]
    # A rendezvous left in this process's environment by an earlier in-process run (Lightning sets MASTER_PORT and
    # friends in os.environ) would pin the child to that port: the child picks its own.
    inherited = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}
    env = {**inherited, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get(
        "PYTHONPATH", "")]), "COLUMNS": "80", "LIGHTNING_GRPO_DATA_DIR": _data_dir()}
    for _attempt in range(2):
        proc = subprocess.run([*command, *args], cwd=str(cwd), env=env, capture_output=True, text=True,
                              timeout=timeout)
        output = proc.stdout + proc.stderr
        # A multi-process run's rendezvous port (Lightning picks a free one, torch binds it later) can be taken in
        # between by another socket on the machine: then once more, on a newly picked port; any other failure fails.
        if proc.returncode == 0 or "EADDRINUSE" not in output:
            break
    assert proc.returncode == 0, f"lightning-grpo {' '.join(args)} failed ({proc.returncode}):\n{output[-6000:]}"
    return output


def _metrics(folder: Path) -> list[dict]:
    (path,) = glob.glob(str(folder / "**" / "metrics.csv"), recursive=True)
    with open(path) as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def gsm8k_run(tmp_path_factory, tiny_llama_path) -> Path:
    """``lightning-grpo fit --config recipes/gsm8k_grpo.yaml`` for one step on the tiny Llama: its checkpoint
    holds ``reward_weights=[1.0, 0.2]`` for the recipe's two rewards."""
    cwd = tmp_path_factory.mktemp("gsm8k_run")
    (cwd / "recipes").symlink_to(REPO / "recipes")
    lightning_grpo(["fit", "--config", "recipes/gsm8k_grpo.yaml", "--model.model", tiny_llama_path,
                    "--validate_before_fit", "false", "--trainer.max_steps", "1",
                    "--trainer.accumulate_grad_batches", "1", "--data.prompts_per_step", "1",
                    "--model.config.num_generations", "2", *TINY], cwd)
    (last,) = glob.glob(str(cwd / "outputs/gsm8k_grpo/lightning_logs/version_0/checkpoints/last.ckpt"))
    hparams = torch.load(last, weights_only=True, map_location="cpu", mmap=True)["hyper_parameters"]
    assert hparams["reward_weights"] == [1.0, 0.2] and hparams["model"] == tiny_llama_path
    return cwd


@pytest.mark.parametrize("subcommand", ["validate", "test"])
def test_eval_recipe_on_a_gsm8k_recipe_checkpoint(gsm8k_run, subcommand):
    """recipes/eval.yaml's command on the GSM8K recipe's ``last.ckpt``: the evaluation's own reward
    (gsm8k_accuracy; math_accuracy for MATH-500) is used, the checkpoint's weights and model are loaded."""
    ckpt = "outputs/gsm8k_grpo/lightning_logs/version_0/checkpoints/last.ckpt"
    lightning_grpo([subcommand, "--config", "recipes/eval.yaml", "--ckpt_path", ckpt, *TINY], gsm8k_run)
    stage = "val" if subcommand == "validate" else "test"
    rows = [r for r in _metrics(gsm8k_run / "outputs" / "eval") if r.get(f"{stage}/accuracy")]
    assert rows, "no evaluation metrics logged"
    assert 0.0 <= float(rows[-1][f"{stage}/accuracy"]) <= 1.0
    assert 0.0 <= float(rows[-1][f"{stage}/math500/accuracy"]) <= 1.0
    for path in glob.glob(str(gsm8k_run / "outputs" / "eval" / "**" / "metrics.csv"), recursive=True):
        os.remove(path)  # the next subcommand writes its own


def test_two_process_cpu_ddp_command_from_the_docs(tmp_path, tiny_llama_path):
    """docs/distributed.md: ``lightning-grpo fit --config recipes/gsm8k_grpo.yaml --trainer.accelerator cpu
    --trainer.devices 2 --trainer.strategy ddp``, one step."""
    (tmp_path / "recipes").symlink_to(REPO / "recipes")
    lightning_grpo(["fit", "--config", "recipes/gsm8k_grpo.yaml", "--trainer.accelerator", "cpu",
                    "--trainer.devices", "2", "--trainer.strategy", "ddp", "--model.model", tiny_llama_path,
                    "--validate_before_fit", "false", "--trainer.max_steps", "1",
                    "--trainer.accumulate_grad_batches", "1", "--data.prompts_per_step", "1",
                    "--model.config.num_generations", "2", *TINY], tmp_path)
    rows = [r for r in _metrics(tmp_path / "outputs") if r.get("loss")]
    assert len(rows) == 1 and float(rows[0]["completions/mean_length"]) >= 1
