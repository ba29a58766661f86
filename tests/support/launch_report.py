"""What a launched trainer process reports for ``tests/launch/test_multinode_loopback.py``: the test starts
``lightning-grpo fit`` through the launcher's scripts, so the run is read back from files, written by a callback
named in the run's YAML (``support.launch_report.RankReport``) and a reward function named the same way."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback


def alternating_reward(prompts, completions, **columns):
    """1 for every other completion of a group, else 0 (groups of 2): nonzero advantages whatever is sampled, so
    every optimizer step changes the weights."""
    return [float(k % 2) for k in range(len(completions))]


def write_prompts(path: Path, count: int) -> None:
    """``count`` prompts "What is i + 1?" as a JSONL dataset."""
    with open(path, "w") as f:
        for i in range(count):
            f.write(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n")


class RankReport(Callback):
    """At each optimizer step's end, this process's policy weights (``weights_step<n>_rank<r>.pt``); when training
    ends, ``rank<r>.json``: the cluster environment Lightning chose and the ranks it read from it, the global step,
    the losses and the rollout engine's weights version.

    Args:
        out: the folder (made if missing).
    """

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if batch.step_end:
            self.losses.append(float(trainer.callback_metrics["loss"]))
            self.out.mkdir(parents=True, exist_ok=True)
            state = {k: v.detach().clone() for k, v in module.policy.state_dict().items()}
            torch.save(state, self.out / f"weights_step{trainer.global_step}_rank{trainer.global_rank}.pt")

    def on_train_end(self, trainer, module) -> None:
        environment = trainer.strategy.cluster_environment
        report = dict(environment=type(environment).__name__, global_rank=trainer.global_rank,
                      local_rank=trainer.local_rank, node_rank=trainer.node_rank, world_size=trainer.world_size,
                      num_nodes=trainer.num_nodes, main_address=environment.main_address,
                      main_port=environment.main_port, global_step=trainer.global_step, losses=self.losses,
                      engine_version=module.rollout_engine.version,
                      slurm_procid=os.environ.get("SLURM_PROCID"))
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report))
