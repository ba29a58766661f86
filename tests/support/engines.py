"""A rollout engine for the component tests (RolloutWorker, RolloutPrefetcher, ExperienceMaker): the fixed completions
of :class:`support.algorithm.FixedRolloutEngine`, its own copy of the weights, and a log of every call."""

from __future__ import annotations

import threading
from typing import Optional

import torch

from lightning_grpo.protocols.rollout import RolloutInterrupted, RolloutOutput, StopFlag
from lightning_grpo.protocols.sampling import SamplingConfig
from support.algorithm import FixedRolloutEngine


def weights_of(model: torch.nn.Module) -> float:
    """A fingerprint of a model's weights (the sum of its parameters)."""
    return float(sum(p.detach().double().sum() for p in model.parameters()))


class RecordingEngine(FixedRolloutEngine):
    """An engine with its own weights (``uses_policy_parameters`` False) that seeds per request and records its calls
    in ``log``: ``("wake_up",)``, ``("sync", weights)``, ``("generate", weights, seed, thread name)``,
    ``("generated", weights)``, ``("sleep", level)``, ``("close",)``; ``prompts`` holds the prompt ids of each
    ``generate``.

    Args:
        completion_ids, eos_id: as :class:`FixedRolloutEngine`.
        stop: polled while a closed ``gate`` holds a generation (set: ``RolloutInterrupted``, as real engines).
        gate: a ``threading.Event`` each generation waits for (None: generate at once).
    """

    uses_policy_parameters = False
    seeds_per_request = True

    def __init__(self, completion_ids: torch.Tensor, eos_id: int, stop: Optional[StopFlag] = None,
                 gate: Optional[threading.Event] = None) -> None:
        super().__init__(completion_ids, eos_id)
        self.stop, self.gate = stop, gate
        self.weights: Optional[float] = None  # the fingerprint of the weights it generates with
        self.log: list[tuple] = []
        self.prompts: list[list[list[int]]] = []

    def wake_up(self) -> None:
        self.log.append(("wake_up",))

    def sleep(self, level: int = 1) -> None:
        self.log.append(("sleep", level))

    def close(self) -> None:
        self.log.append(("close",))

    def sync_weights(self, model: torch.nn.Module) -> None:
        self.weights = weights_of(model)
        self.log.append(("sync", self.weights))

    def generate(self, prompt_ids, num_generations: int, sampling: SamplingConfig) -> RolloutOutput:
        self.log.append(("generate", self.weights, sampling.seed, threading.current_thread().name))
        self.prompts.append([list(p) for p in prompt_ids])
        if self.gate is not None:
            while not self.gate.wait(0.01):
                if self.stop is not None and self.stop.is_set():
                    raise RolloutInterrupted("the rollout was stopped")
        out = super().generate(prompt_ids, num_generations, sampling)
        self.log.append(("generated", self.weights))
        return out
