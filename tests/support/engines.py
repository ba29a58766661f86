"""A rollout engine for the component tests (RolloutWorker, RolloutPrefetcher, ExperienceMaker): the fixed completions
of :class:`support.algorithm.FixedRolloutEngine`, its own copy of the weights, and a log of every call."""

from __future__ import annotations

import threading
from typing import Optional

import torch

from lightning_grpo.protocols.engine import EngineCapabilities
from lightning_grpo.protocols.rollout import RolloutInterrupted, RolloutOutput, StopFlag
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.protocols.weights import PolicyWeights
from support.algorithm import FixedRolloutEngine


def weights_of(model: torch.nn.Module) -> float:
    """A fingerprint of a model's weights (the sum of its parameters)."""
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def stream_of(weights: PolicyWeights) -> float:
    """The same fingerprint of the weights an engine is synced with (a tied ``lm_head``, the embedding's tensor
    again, is counted once)."""
    seen, total = set(), 0.0
    for _, tensor in weights.tensors():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += float(tensor.double().sum())
    return total


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

    capabilities = EngineCapabilities(seeds_per_request=True)

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

    def sync_weights(self, weights: PolicyWeights) -> None:
        self.weights = stream_of(weights)
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


class WithoutTensor(PolicyWeights):
    """``weights`` with some tensors left out: a sync that skips them (the stale-tensor bug the post-sync check is
    for); everything else is ``weights``'."""

    def __init__(self, weights: PolicyWeights, *names: str) -> None:
        self.weights, self.names = weights, set(names)

    def tensors(self):
        return ((name, tensor) for name, tensor in self.weights.tensors() if name not in self.names)

    def probe_logprobs(self, sequences):
        return self.weights.probe_logprobs(sequences)

    @property
    def vocab_size(self) -> int:
        return self.weights.vocab_size
