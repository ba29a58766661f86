"""Non-finite numbers never reach the weights: a guard before each optimizer step, and weight checks before a
rollout samples from the policy and before a checkpoint is written.

* :class:`NonFiniteGuard` looks at the step's loss and gradient norm, both already computed for logging (no extra
  pass): with ``GRPOConfig.on_nonfinite="error"`` a non-finite one stops the run with :class:`NonFiniteError`
  before the optimizer step; with ``"skip"`` the step's gradients are dropped (the optimizer then changes
  nothing: AdamW skips parameters without a gradient) and the step is counted in ``nonfinite_steps``.
* :func:`check_finite_parameters` and :func:`check_finite_checkpoint` scan the weights (one max-abs per tensor);
  they run only before rollouts and checkpoint saves.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Iterable, Iterator, Optional

import torch
from torch import Tensor, nn

from lightning_grpo.protocols.collectives import Collectives

log = logging.getLogger(__name__)

class NonFiniteError(FloatingPointError):
    """A NaN or infinite loss, gradient norm or weight where the run cannot continue safely."""


def _local(tensor: Tensor) -> list[Tensor]:
    """This process's part of ``tensor``: a ``DTensor``'s (FSDP2) local tensor, a ``ShardedTensor``'s (FSDP1 sharded
    state dicts) local shards, else the tensor itself; no collective per tensor."""
    if hasattr(tensor, "to_local"):
        return [tensor.to_local()]
    if hasattr(tensor, "local_shards"):
        return [shard.tensor for shard in tensor.local_shards()]
    return [tensor]


def nonfinite_names(named: Iterable[tuple[str, Any]]) -> list[str]:
    """The names of the floating-point tensors of ``named`` that hold a NaN or an infinity (local shards only).

    One ``max |x|`` per tensor (NaN propagates through max; no overflow, unlike a sum in float16)."""
    bad = []
    for name, value in named:
        if not isinstance(value, Tensor):
            continue
        for tensor in _local(value):
            tensor = tensor.detach()
            if tensor.is_floating_point() and tensor.numel() and not torch.isfinite(tensor.abs().amax()):
                bad.append(name)
                break
    return bad


def _agree(bad: list[str], collectives: Optional[Collectives]) -> bool:
    return collectives.any_process(bool(bad)) if collectives is not None else bool(bad)


def check_finite_parameters(model: nn.Module, when: str, collectives: Optional[Collectives] = None) -> None:
    """Raise :class:`NonFiniteError` if a parameter of ``model`` holds a NaN or an infinity on any process.

    Args:
        model: the policy.
        when: what was about to happen (in the message), e.g. "sampling a rollout".
        collectives: the data-parallel agreement (every process must call); None on one process.

    Raises:
        NonFiniteError: naming the first parameters found (on another process: says so).
    """
    bad = nonfinite_names(model.named_parameters())
    if _agree(bad, collectives):
        where = f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''} ({len(bad)} tensors)" if bad else \
            "a parameter shard of another process"
        raise NonFiniteError(f"the policy has non-finite weights before {when}: {where}; refusing to continue "
                             "(resume from an earlier checkpoint, e.g. with a lower learning rate)")


def _checkpoint_tensors(checkpoint: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    for key, value in checkpoint.get("state_dict", {}).items():
        yield f"state_dict[{key!r}]", value
    for index, optimizer in enumerate(checkpoint.get("optimizer_states", ())):
        for param, state in optimizer.get("state", {}).items():
            for key, value in state.items():
                yield f"optimizer_states[{index}]['state'][{param!r}][{key!r}]", value


def check_finite_checkpoint(checkpoint: dict[str, Any], collectives: Optional[Collectives] = None) -> None:
    """Raise :class:`NonFiniteError` if a weight or an optimizer state of a checkpoint about to be written holds a
    NaN or an infinity (Lightning's ``state_dict`` and ``optimizer_states``; local shards when sharded).

    Raises:
        NonFiniteError: naming the first tensors found; the checkpoint is not written.
    """
    bad = nonfinite_names(_checkpoint_tensors(checkpoint))
    if _agree(bad, collectives):
        where = f"{', '.join(bad[:3])}{' ...' if len(bad) > 3 else ''} ({len(bad)} tensors)" if bad else \
            "a shard of another process"
        raise NonFiniteError(f"refusing to save a checkpoint with non-finite values in {where}")


class NonFiniteGuard:
    """Checks each optimizer step's loss and gradient norm before the step is taken.

    Args:
        mode: ``"error"`` (raise :class:`NonFiniteError` naming the step and the quantity) or ``"skip"`` (drop the
            step's gradients and count it).

    Attributes:
        skipped: steps skipped so far (saved in checkpoints by the module; logged as ``nonfinite_steps``).
    """

    def __init__(self, mode: str = "error") -> None:
        if mode not in ("error", "skip"):
            raise ValueError(f"GRPOConfig.on_nonfinite={mode!r} is invalid: choose one of error, skip")
        self.mode = mode
        self.skipped = 0
        self._loss: Optional[float] = None

    def observe_loss(self, loss: Optional[float]) -> None:
        """The step's loss (summed over its micro-batches and processes), known at its last micro-batch."""
        self._loss = loss

    def before_optimizer_step(self, step: int, grad_norm: Optional[Tensor], optimizer: torch.optim.Optimizer,
                              check_grad_norm: bool = True) -> dict[str, float]:
        """Check the step about to be taken; returns the metrics to log (``nonfinite_steps`` with ``"skip"``).

        Args:
            step: ``trainer.global_step`` (0-based: the step about to be taken is number ``step + 1``).
            grad_norm: the norm of the full gradient (already computed for ``grad_norm``), or None.
            optimizer: its gradients are dropped (``zero_grad(set_to_none=True)``) when the step is skipped.
            check_grad_norm: False when a GradScaler owns non-finite gradients (float16 mixed precision skips
                those steps itself and lowers its scale).

        Raises:
            NonFiniteError: ``mode="error"`` and the loss or the gradient norm is NaN or infinite.
        """
        loss, self._loss = self._loss, None
        bad = {}
        if loss is not None and not math.isfinite(loss):
            bad["loss"] = loss
        if check_grad_norm and grad_norm is not None:
            norm = float(grad_norm)
            if not math.isfinite(norm):
                bad["grad_norm"] = norm
        if bad:
            what = ", ".join(f"{k}={v}" for k, v in bad.items())
            if self.mode == "error":
                raise NonFiniteError(
                    f"optimizer step {step + 1} (global_step={step}): non-finite {what} before the optimizer step; "
                    "the step was not taken, so the weights and the optimizer state are still finite. Set "
                    "GRPOConfig(on_nonfinite='skip') to drop such steps and continue"
                )
            optimizer.zero_grad(set_to_none=True)
            self.skipped += 1
            log.warning("optimizer step %d (global_step=%d): non-finite %s: skipped (gradients dropped, weights "
                        "unchanged; %d skipped so far)", step + 1, step, what, self.skipped)
        return {"nonfinite_steps": float(self.skipped)} if self.mode == "skip" else {}

    def state_dict(self) -> dict[str, int]:
        return {"skipped": self.skipped}

    def load_state_dict(self, state: Optional[dict[str, int]]) -> None:
        self.skipped = int((state or {}).get("skipped", 0))
