"""INTERIM (replaced by the backend branch): GRPOModels and a LocalBackend for single-process runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn


@dataclass
class GRPOModels:
    policy: nn.Module
    ref: Optional[nn.Module]
    engine: Any


class LocalBackend:
    def __init__(self, strategy: Any = None) -> None:
        self.strategy = strategy

    def _world(self) -> int:
        return 1 if self.strategy is None else int(getattr(self.strategy, "world_size", 1))

    @property
    def data_parallel_size(self) -> int:
        return self._world()

    def configure(self, models: GRPOModels) -> GRPOModels:
        return models

    def restore(self, models: GRPOModels) -> GRPOModels:
        return models

    def is_sharded(self, model: nn.Module) -> bool:
        return False

    def grad_norm(self, policy: nn.Module) -> Optional[Tensor]:
        grads = [p.grad for p in policy.parameters() if p.grad is not None]
        if not grads:
            return None
        return torch.nn.utils.get_total_norm(grads).float()

    def clip_gradients(self, policy, optimizer, gradient_clip_val, gradient_clip_algorithm, fallback: Callable):
        fallback(optimizer, gradient_clip_val, gradient_clip_algorithm)
        return None

    def export_state_dict(self, policy: nn.Module) -> Optional[dict]:
        return None

    def reduce_sum(self, tensor: Tensor) -> Tensor:
        return tensor if self._world() <= 1 else self.strategy.reduce(tensor, reduce_op="sum")

    def reduce_max(self, tensor: Tensor) -> Tensor:
        return tensor if self._world() <= 1 else self.strategy.reduce(tensor, reduce_op="max")

    def any_process(self, flag: bool, device: torch.device) -> bool:
        return bool(self.reduce_sum(torch.tensor([float(flag)], device=device)).item() > 0)


def backend_for(strategy: Any) -> LocalBackend:
    return LocalBackend(strategy)
