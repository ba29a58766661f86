"""Shared pieces of the tiny-model algorithm tests: a rollout engine with fixed completions, a small prompt file,
a quiet Trainer, and callbacks that record gradients, experience micro-batches and logged metrics."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lightning_grpo.protocols.engine import EngineCapabilities
from lightning_grpo.protocols.rollout import RolloutOutput, completion_mask_from_eos, left_pad
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.protocols.weights import PolicyWeights
from support.fixtures import make_cpu_trainer


def fixed_completions(lengths: Sequence[int], width: int, eos_id: int, seed: int = 0) -> torch.Tensor:
    """``(len(lengths), width)`` ids: row i has ``lengths[i]`` tokens ending in EOS, or ``width`` tokens without
    EOS (a truncated completion) when ``lengths[i] > width``; padded with EOS."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, 1000, (len(lengths), width), generator=generator)
    for row, length in enumerate(lengths):
        if length <= width:
            ids[row, length - 1 :] = eos_id
    return ids


class FixedRolloutEngine:
    """A :class:`~lightning_grpo.protocols.engine.RolloutEngine` whose completions are fixed ids (the same at every
    call), so that two runs train on the same experience. ``sampler_offsets`` (``(N, T)``) makes it report
    sampler logprobs = ``logprob_fn(...) + offsets`` like an engine whose numerics differ from the trainer's. It stands
    in for the HF engine: it declares ``uses_policy_parameters`` (nothing to sync) and no per-request seeds."""

    capabilities = EngineCapabilities(uses_policy_parameters=True)

    def __init__(self, completion_ids: torch.Tensor, eos_id: int, sampler_logprobs: Optional[torch.Tensor] = None):
        self.completion_ids = completion_ids
        self.eos_id = eos_id
        self.pad_token_id = eos_id
        self.sampler_logprobs = sampler_logprobs
        self.calls = 0

    def set_lockstep(self, enabled: bool) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def sleep(self, level: int = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def sync_weights(self, weights: PolicyWeights) -> None:
        pass

    def generate(self, prompt_ids, num_generations: int, sampling: SamplingConfig) -> RolloutOutput:
        n = len(prompt_ids) * num_generations
        offset = (self.calls * n) % len(self.completion_ids)
        self.calls += 1
        rows = torch.arange(offset, offset + n) % len(self.completion_ids)
        ids = self.completion_ids[rows, : sampling.max_new_tokens]
        mask, truncated = completion_mask_from_eos(ids, [self.eos_id])
        prompts, prompt_mask = left_pad(prompt_ids, self.pad_token_id, torch.device("cpu"))
        return RolloutOutput(
            prompt_ids=prompts.repeat_interleave(num_generations, dim=0),
            prompt_mask=prompt_mask.repeat_interleave(num_generations, dim=0),
            completion_ids=ids,
            completion_mask=mask,
            truncated=truncated,
            completions=[f"completion {int(r)}" for r in rows],
            sampler_logprobs=None if self.sampler_logprobs is None else self.sampler_logprobs[rows],
        )


def write_prompts(path: Path, count: int = 16) -> str:
    """A jsonl of ``count`` short questions with answers "1" .. str(count)."""
    with open(path, "w") as f:
        for i in range(count):
            f.write(json.dumps({"question": f"{i} + 1 = ?", "answer": str(i + 1)}) + "\n")
    return str(path)


def quiet_trainer(root: Path, max_steps: int, **kwargs) -> L.Trainer:
    """:func:`support.fixtures.make_cpu_trainer` without a logger, checkpoints or sanity validation."""
    kwargs.setdefault("logger", False)
    return make_cpu_trainer(root, max_steps, enable_checkpointing=False, num_sanity_val_steps=0, **kwargs)


class Recorder(Callback):
    """Records the experience micro-batches, the gradient of each optimizer step and the metrics logged at each
    step end."""

    def __init__(self, grads: bool = False) -> None:
        self.batches: list = []
        self.grads: list[dict[str, torch.Tensor]] = []
        self.metrics: list[dict[str, float]] = []
        self.record_grads = grads

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.batches.append(batch)

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if self.record_grads:
            params = module.policy.named_parameters()
            self.grads.append({n: p.grad.detach().clone() for n, p in params if p.grad is not None})

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch.step_end:
            self.metrics.append({k: float(v) for k, v in trainer.logged_metrics.items()})
