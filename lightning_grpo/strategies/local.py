"""The backend of unsharded models: one device, or DDP (every process holds the whole model), and the gradient
norm functions every backend shares.

:class:`LocalBackend` leaves the models as they are and reduces through the Lightning strategy
(``strategy.reduce``) when there is more than one process. ``LocalBackend()`` without a strategy is the
single-process backend (tests that build an experience without a Trainer).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, ContextManager, Iterable, Optional, Sequence, Union

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_grpo.algorithm import ObjectiveOutput
from lightning_grpo.config import GRPOConfig
from lightning_grpo.protocols.collectives import Collectives
from lightning_grpo.strategies.backend import ClipFallback, GRPOModels, StepObjective
from lightning_grpo.strategies.module_weights import ModuleWeights
from lightning_grpo.training.experience import Experience


def grad_norm(parameters: Iterable[Tensor], norm_type: float = 2.0) -> Optional[Tensor]:
    """The ``norm_type``-norm of all gradients of ``parameters`` as one vector (0-dim float32 tensor), or None
    when none has a gradient.

    For FSDP2 ``DTensor`` gradients it is the norm of the *full* gradient: each rank takes the norm of its
    shard and the partial norms are all-reduced (a collective: every rank must call it), never gathering a
    gradient in full.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return None
    total = torch.nn.utils.get_total_norm(grads, norm_type=norm_type)
    full = getattr(total, "full_tensor", None)
    return (full() if callable(full) else total).float()


def clip_grad_norm_(parameters: Iterable[Tensor], max_norm: float, norm_type: float = 2.0) -> Optional[Tensor]:
    """Scale the gradients of ``parameters`` in place so their total norm is at most ``max_norm``
    (``torch.nn.utils.clip_grad_norm_`` semantics: factor ``min(1, max_norm / (norm + 1e-6))``), with the total
    norm of the full gradient also for FSDP2 ``DTensor`` gradients (see :func:`grad_norm`).

    Returns:
        the total norm before clipping (0-dim float32 tensor), or None when no parameter has a gradient.

    Raises:
        ValueError: ``max_norm <= 0``.
    """
    if max_norm <= 0:
        raise ValueError(f"gradient_clip_val={max_norm} must be > 0 to clip by norm")
    parameters = [p for p in parameters if p.grad is not None]
    total = grad_norm(parameters, norm_type)
    if total is None:
        return None
    torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total)
    return total


class LocalBackend:
    """:class:`~lightning_grpo.strategies.backend.ParallelBackend` for unsharded models (single device, DDP).

    Args:
        strategy: the Lightning strategy (its ``world_size`` and ``reduce``); None: one process.
    """

    def __init__(self, strategy: Optional[Any] = None) -> None:
        self.strategy = strategy

    def configure(self, models: GRPOModels) -> GRPOModels:
        """Nothing to shard: DDP replicates the models (Lightning wraps the module itself); the engines read the
        policy's own weights (:class:`~lightning_grpo.strategies.module_weights.ModuleWeights`, probed in the trainer's
        precision)."""
        weights = ModuleWeights(models.policy, forward_context=self.forward_context)
        return dataclasses.replace(models, weights=weights, scorer=None, sharded=False)

    @property
    def forward_context(self) -> Callable[[], ContextManager]:
        """The strategy's precision context (``precision_plugin.forward_context``: bf16 autocast under
        ``precision="bf16-mixed"``), a null context without a strategy."""
        return contextlib.nullcontext if self.strategy is None else self.strategy.precision_plugin.forward_context

    def restore(self, models: GRPOModels) -> GRPOModels:
        """The models are plain HF models already."""
        return models

    def grad_norm(self, policy: nn.Module) -> Optional[Tensor]:
        """:func:`grad_norm` of the policy's parameters."""
        return grad_norm(policy.parameters())

    def clip_gradients(
        self,
        policy: nn.Module,
        optimizer: Optimizer,
        gradient_clip_val: Optional[Union[int, float]],
        gradient_clip_algorithm: Optional[str],
        fallback: ClipFallback,
    ) -> Optional[Tensor]:
        """Lightning's own clipping (``fallback``); returns None."""
        fallback(optimizer, gradient_clip_val, gradient_clip_algorithm)
        return None

    def export_state_dict(self, policy: nn.Module) -> Optional[dict[str, Any]]:
        """None: the policy holds its full weights."""
        return None

    @property
    def data_parallel_size(self) -> int:
        """The number of processes (each holds different data): the strategy's ``world_size``, 1 without one."""
        return 1 if self.strategy is None else int(self.strategy.world_size)

    @property
    def runs_whole_step(self) -> bool:
        """False: Lightning runs each micro-batch's backward (accumulation)."""
        return False

    def train_step(self, policy: nn.Module, micro_batches: Sequence[Experience], objective: StepObjective,
                   config: GRPOConfig) -> list[ObjectiveOutput]:
        """Not used: this backend trains micro-batch by micro-batch through Lightning."""
        raise NotImplementedError(f"{type(self).__name__} does not run whole optimizer steps (runs_whole_step=False)")

    def reduce_sum(self, tensor: Tensor) -> Tensor:
        """``strategy.reduce(tensor, reduce_op="sum")`` with more than one process, else ``tensor`` itself."""
        if self.data_parallel_size <= 1:
            return tensor
        return self.strategy.reduce(tensor, reduce_op="sum")

    def reduce_max(self, tensor: Tensor) -> Tensor:
        """``strategy.reduce(tensor, reduce_op="max")`` with more than one process, else ``tensor`` itself."""
        if self.data_parallel_size <= 1:
            return tensor
        return self.strategy.reduce(tensor, reduce_op="max")

    def collectives(self, device: torch.device) -> Collectives:
        """:meth:`reduce_sum` and :meth:`reduce_max`, flags on ``device``."""
        return Collectives(self.reduce_sum, self.reduce_max, device)
