"""The first optimizer step of a ``lightning-grpo fit`` run in this process, seen from inside: what each trained
parameter was, its gradient as the optimizer got it and what it became, for tests that check an optimizer's update
against its formula (SGD: ``-lr * grad``; AdamW's first step: ``-lr * grad / (|grad| + eps)``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch.callbacks import Callback
from torch import Tensor


class FirstStepProbe(Callback):
    """Records, for the policy's parameters as the backend trains them (megatron-core's under ``MegatronStrategy``),
    at the first optimizer step: ``before`` (the weights) and ``grads`` (after the backend's reductions and any
    clipping, the gradients the optimizer steps with) in ``on_before_optimizer_step``, ``after`` (the weights) at the
    end of the step. Single process, unsharded parameters."""

    def __init__(self) -> None:
        self.before: Optional[dict[str, Tensor]] = None
        self.grads: dict[str, Tensor] = {}
        self.after: Optional[dict[str, Tensor]] = None
        self.trainable: list[str] = []

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        if self.before is None:
            named = list(module.policy.named_parameters())
            self.before = {n: p.detach().clone() for n, p in named}
            self.grads = {n: p.grad.detach().clone() for n, p in named if p.grad is not None}
            self.trainable = [n for n, p in named if p.requires_grad]

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch.step_end and self.after is None:
            self.after = {n: p.detach().clone() for n, p in module.policy.named_parameters()}


def write_prompts(path: Path, n: int = 4) -> str:
    """``n`` GSM8K-style rows ("What is i + 1?") in a jsonl file."""
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n")
    return str(path)


def cli_first_step(model_path: str, root: Path, *args: str) -> tuple[FirstStepProbe, Any]:
    """``lightning-grpo fit`` (:class:`~lightning_grpo.cli.GRPOCLI` in this process) of one optimizer step on one
    CPU device: 2 prompts x 2 completions of 4 tokens from the HF engine, the alternating reward (a nonzero gradient
    whatever the model samples), then ``args`` (more options: ``--optimizer``, ``--config recipes/megatron.yaml``,
    ...). Returns the probe of the step and the CLI."""
    from lightning_grpo.cli import GRPOCLI
    from lightning_grpo.data import PromptDataModule
    from lightning_grpo.module import GRPOModule

    probe = FirstStepProbe()
    common = ["--model.model", model_path, "--model.reward_funcs", "[support.fixtures:alternating_reward]",
              "--model.config.num_generations", "2", "--model.config.max_new_tokens", "4",
              "--model.config.engine.name", "hf", "--model.export_dir", "",
              "--data.dataset", write_prompts(root / "prompts.jsonl"), "--data.prompts_per_step", "2",
              "--data.val_size", "0", "--trainer.max_steps", "1", "--trainer.accelerator", "cpu",
              "--trainer.devices", "1", "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
              "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false",
              "--trainer.default_root_dir", str(root)]
    cli = GRPOCLI(GRPOModule, PromptDataModule, run=False, args=[*args, *common], save_config_callback=None,
                  trainer_defaults={"callbacks": [probe]})
    torch.manual_seed(0)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return probe, cli


def assert_first_step(probe: FirstStepProbe, update: Any) -> None:
    """Every trained parameter has a gradient and moved by exactly ``update(grad)`` (to float32 rounding), and the
    step changed the weights."""
    assert probe.before is not None and probe.after is not None
    assert probe.trainable and sorted(probe.grads) == sorted(probe.trainable)
    assert max(float(g.abs().max()) for g in probe.grads.values()) > 1e-3  # a real gradient
    moved = max(float((probe.after[n] - probe.before[n]).abs().max()) for n in probe.trainable)
    assert moved > 1e-4, moved
    for name in probe.trainable:
        expected = probe.before[name] + update(probe.grads[name])
        torch.testing.assert_close(probe.after[name], expected, atol=1e-6, rtol=0, msg=name)
