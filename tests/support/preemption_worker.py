"""A tiny-model GRPO fit for the SIGTERM test (tests/runtime/test_fault_tolerance.py), run as its own process:

    forked.start("support.preemption_worker:main", model_path, out_dir, log=...)  (tests/support/forked.py)

Step 1 is an ordinary step; after it the policy is saved to ``<out_dir>/after_step1.pt``, ``max_new_tokens`` is
raised to 100000 (a rollout of many minutes on this model) and ``<out_dir>/rollout2_started`` is written just
before that rollout starts. The only checkpoint callback saves on exception (and at step 100), so any checkpoint in
``<out_dir>/ckpt`` comes from the SIGTERM.
"""

import logging
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_grpo import GRPOConfig, GRPOModule
from lightning_grpo.data import PromptDataModule


def reward_even(prompts, completions, **kwargs):
    return [1.0 if i % 2 == 0 else 0.0 for i in range(len(completions))]


class LongSecondRollout(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch.step_end and trainer.global_step == 1:
            torch.save(module.policy.state_dict(), self.out / "after_step1.pt")
            module.config.max_new_tokens = 100_000

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step >= 1:
            raise AssertionError("the second rollout finished: SIGTERM did not interrupt it")


class MarkRolloutStart(Callback):
    """Writes the marker at the end of step 1's logging, right before the loop asks for the next rollout."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch.step_end and trainer.global_step == 1:
            (self.out / "rollout2_started").write_text("1")


def main(model_path: str, out: str) -> None:
    logging.basicConfig(level=logging.INFO)
    out_dir = Path(out)
    L.seed_everything(0)
    module = GRPOModule(model_path, reward_funcs=[reward_even], learning_rate=1e-3,
                        config=GRPOConfig(num_generations=4, max_new_tokens=8, max_prompt_length=256))
    checkpoint = ModelCheckpoint(dirpath=str(out_dir / "ckpt"), every_n_train_steps=100, save_last="link",
                                 save_on_exception=True)
    trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(out_dir),
                        callbacks=[LongSecondRollout(out_dir), MarkRolloutStart(out_dir), checkpoint])
    trainer.fit(module, datamodule=PromptDataModule(prompts_per_step=2, val_size=0))
    (out_dir / "finished").write_text("the run finished without being stopped")


if __name__ == "__main__":
    main(*sys.argv[1:])
