"""A tiny-model GRPO run that can SIGKILL itself at a chosen point, then be resumed (tests/test_resume.py).

Usage: ``python tests/support/resume_worker.py '<json spec>'``.
Spec keys: ``model``, ``data``, ``out`` (folder: steps.jsonl
gets one line per optimizer step, final.pt the final weights), ``ckpt`` (checkpoint folder), ``max_steps``,
``accumulate``, ``config`` (GRPOConfig fields), ``lora`` (``peft.LoraConfig`` fields, optional), ``episode_turns``
(multi-turn episodes: each finished model turn gets an observation until this many turns, optional), ``kill``
(``{"at": "rollout" | "env_step" | "micro_batch" | "save" | "second_update", "step": k}`` or null; "env_step": in the
environment's step, between two turns of a multi-turn rollout) and ``resume`` (fit with ``ckpt_path="last"``).
"""

import json
import os
import signal
import sys

os.environ["HF_HUB_OFFLINE"] = "1"

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

from lightning_grpo import GRPOConfig, GRPOModule  # noqa: E402
from lightning_grpo.data import PromptDataModule  # noqa: E402
from lightning_grpo.episodes import BaseEnvironment, EnvStep  # noqa: E402

STATE: dict = {"trainer": None, "kill": None}


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _killing_now(at: str) -> bool:
    kill, trainer = STATE["kill"], STATE["trainer"]
    return bool(kill and kill["at"] == at and trainer is not None and trainer.global_step == kill["step"])


def length_reward(prompts, completions, **kwargs):
    """A reward that differs within groups of a random model: the completion's length modulo 3, halved."""
    if _killing_now("rollout"):
        _die()
    return [(len(c) % 3) / 2 for c in completions]


class Echo(BaseEnvironment):
    """Multi-turn episodes: an observation after each finished model turn until ``turns`` turns, reward 1 / turn."""

    def __init__(self, turns: int) -> None:
        self.turns, self.seen = turns, 0

    def step(self, turn: str) -> EnvStep:
        if _killing_now("env_step") and self.seen == 1:
            _die()
        self.seen += 1
        if self.seen >= self.turns:
            return EnvStep.finish(reward=1.0 / self.seen)
        return EnvStep.observe(f"go on ({self.seen})")


class Recorder(Callback):
    def __init__(self, out: str) -> None:
        self.out = out

    def on_train_start(self, trainer, module):
        STATE["trainer"] = trainer

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if _killing_now("second_update") and batch.step_start and not batch.on_policy:
            _die()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if not batch.step_end:
            if _killing_now("micro_batch"):
                _die()
            return
        metrics = trainer.callback_metrics
        record = {"step": trainer.global_step, "epoch": trainer.current_epoch,
                  "loss": float(metrics["loss"]), "reward": float(metrics["reward"])}
        with open(os.path.join(self.out, "steps.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")

    def on_save_checkpoint(self, trainer, module, checkpoint):
        if _killing_now("save"):
            _die()

    def on_train_end(self, trainer, module):
        torch.save({k: v.detach().clone() for k, v in module.policy.state_dict().items()},
                   os.path.join(self.out, "final.pt"))


def main(spec: dict) -> None:
    torch.set_num_threads(1)
    STATE["kill"] = None if spec.get("resume") else spec.get("kill")
    L.seed_everything(0, verbose=False)
    config = GRPOConfig.from_dict({"num_generations": 4, "max_new_tokens": 8, "temperature": 1.0, **spec["config"]})
    turns = spec.get("episode_turns")
    module = GRPOModule(spec["model"], reward_funcs=[length_reward], config=config, learning_rate=1e-3, export_dir="",
                        lora=spec.get("lora"), environment_factory=(lambda: Echo(turns)) if turns else None)
    data = PromptDataModule(dataset=spec["data"], prompts_per_step=2, val_size=0, answer_format="raw",
                            system_prompt=None, seed=3)
    checkpoint = ModelCheckpoint(dirpath=spec["ckpt"], every_n_train_steps=1, save_last=True)
    trainer = L.Trainer(
        max_steps=spec["max_steps"], accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, accumulate_grad_batches=spec.get("accumulate", 1),
        callbacks=[Recorder(spec["out"]), checkpoint], default_root_dir=spec["out"],
    )
    trainer.fit(module, datamodule=data, ckpt_path="last" if spec.get("resume") else None)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
