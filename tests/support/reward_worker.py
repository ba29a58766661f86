"""A 2-process GRPO run with a reward model among the rewards, run as a script (``tests/support/dist.py: run_worker``):
each rank writes the texts of its own rollouts, the reward model's scores of them, and whether the model was loaded
in that process, to ``<out>/reward_model_rank<r>.pt``."""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path[:0] = [str(Path(__file__).resolve().parents[i]) for i in (2, 1)]  # the checkout, tests/ (for support.*)

collecting = gc.isenabled()  # the cyclic collector is paused while the libraries below are imported
gc.disable()  # (why: lightning_grpo/__init__.py)
import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_grpo import GRPOConfig, GRPOModule  # noqa: E402
from lightning_grpo.callbacks import GRPOCallback  # noqa: E402
from lightning_grpo.data import PromptDataModule  # noqa: E402
from support.dist_worker import make_strategy, rank_file  # noqa: E402

if collecting:
    gc.enable()


class Rollouts(GRPOCallback):
    def __init__(self) -> None:
        self.rollouts: list[dict] = []

    def on_rollout_end(self, trainer, module, rollout):
        self.rollouts.append({"prompts": rollout.prompts, "completions": rollout.completions,
                              "per_function": rollout.per_function.clone(), "names": rollout.reward_names})


def reward_model_run(cfg: dict) -> None:
    L.seed_everything(0, verbose=False)
    config = GRPOConfig(num_generations=2, max_new_tokens=6, max_prompt_length=128, reward_num_workers=2)
    module = GRPOModule(cfg["model"], reward_funcs=[cfg["reward_model"], "gsm8k_format"], config=config,
                        learning_rate=1e-3, export_dir="")
    rollouts = Rollouts()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=make_strategy(cfg["strategy"]), max_steps=2,
                        logger=False, callbacks=[rollouts], enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=cfg["out"], limit_val_batches=0)
    trainer.fit(module, datamodule=PromptDataModule("arithmetic", prompts_per_step=2, val_size=0))
    reward_model = module.rewards.funcs[0]
    torch.save({"rollouts": rollouts.rollouts, "pid": os.getpid(), "loaded": reward_model._model is not None,
                "device": str(next(reward_model._model.parameters()).device),
                "process_device": str(reward_model._process_device)},
               rank_file(cfg["out"], f"reward_model_{cfg['strategy']['name']}", trainer.global_rank))


if __name__ == "__main__":
    torch.set_num_threads(1)
    with open(sys.argv[1]) as f:
        config = json.load(f)
    reward_model_run(config)
    from support.exit import end_if_launched_rank

    end_if_launched_rank()
