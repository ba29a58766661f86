"""The optimizer of the policy: AdamW with a linear warmup, as Lightning's ``configure_optimizers`` returns it, and
what half-precision weights do to its updates (:func:`rounded_away_fraction`), and the check that the optimizers a
fit steps hold the parameters it trains."""

from __future__ import annotations

import logging
import math
import numbers
from typing import Any, Iterable, Sequence

import torch
from torch import nn

log = logging.getLogger(__name__)


def adamw_with_warmup(params: Iterable[torch.nn.Parameter], learning_rate: float, weight_decay: float,
                      betas: tuple[float, float], warmup_steps: int) -> dict[str, Any]:
    """AdamW (Loshchilov & Hutter 2019) whose learning rate rises linearly from ``lr / (warmup_steps + 1)`` to
    ``lr`` over ``warmup_steps`` optimizer steps and then stays constant; a per-step scheduler."""
    beta1, beta2 = betas
    optimizer = torch.optim.AdamW(list(params), lr=learning_rate, weight_decay=weight_decay, betas=(beta1, beta2))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / (warmup_steps + 1)) if warmup_steps else 1.0
    )
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


#: Significand bits (the implicit one included) of the half-precision weight dtypes.
_SIGNIFICAND_BITS = {torch.bfloat16: 8, torch.float16: 11}


@torch.no_grad()
def rounded_away_fraction(params: Iterable[torch.Tensor], learning_rate: float) -> float:
    """The fraction of the elements of ``params`` that an update of ``learning_rate`` leaves unchanged because their
    dtype cannot hold the sum: AdamW's first step moves each weight by about ``learning_rate`` (``g / (|g| + eps)``),
    and a bfloat16 (float16) weight ``w`` with ``2**(e - 1) <= |w| < 2**e`` (spacing ``2**(e - 8)``, ``2**(e - 11)``)
    rounds an update of at most half its spacing, ``2**(e - 9)`` (``2**(e - 12)``), away (to nearest); a zero weight
    takes any update (a power of two moving toward zero sees the finer spacing below it: counted as rounded away).
    Float32 (and float64) elements count as changed; 0.0 without elements. ``Trainer(precision="bf16-true")`` holds
    the weights (and AdamW's moments) in bfloat16: at ``learning_rate=1e-6`` this is 99.6 % of SmolLM2-135M's weights
    (``"bf16-mixed"`` keeps float32 weights)."""
    lost, total = 0, 0
    for p in params:
        total += p.numel()
        bits = _SIGNIFICAND_BITS.get(p.dtype)
        if bits is None or p.numel() == 0:
            continue
        _, exponent = torch.frexp(p.detach().float())  # |w| = m * 2**exponent, m in [0.5, 1): e = exponent
        half_spacing = torch.ldexp(torch.ones_like(p, dtype=torch.float32), exponent - bits - 1)
        lost += int(((half_spacing >= learning_rate) & (p != 0)).sum())  # a zero weight takes any update
    return lost / total if total else 0.0


def warn_rounded_away_updates(params: Iterable[torch.Tensor], learning_rate: float, precision: str,
                              threshold: float = 0.5) -> float:
    """Log a warning when more than ``threshold`` of the trainable weights cannot take an update of
    ``learning_rate`` (:func:`rounded_away_fraction`; a sharded parameter's local shard is counted), naming
    ``precision`` (Lightning's, e.g. "bf16-true") and the way out. Returns the fraction."""
    from torch.distributed.tensor import DTensor

    lost = rounded_away_fraction([p.to_local() if isinstance(p, DTensor) else p for p in params], learning_rate)
    if lost > threshold:
        log.warning("Trainer(precision=%r) keeps the weights and AdamW's moments in half precision: %.1f %% of the "
                    "trainable weights are too large for an update of learning_rate=%g to change them (rounded "
                    "away), so they will not train; use precision='bf16-mixed' (float32 weights and optimizer state, "
                    "bfloat16 compute) or a larger learning rate", precision, 100 * lost, learning_rate)
    return lost


#: Names of the dtypes :class:`lightning_grpo.GRPOModule` loads model weights in (``dtype=``).
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def check_optimizer_arguments(
    learning_rate: float,
    weight_decay: float,
    adam_betas: Sequence[float],
    warmup_steps: int,
    dtype: str,
) -> None:
    """Validate the optimizer and weight arguments of :class:`lightning_grpo.GRPOModule` (AdamW, Loshchilov and
    Hutter 2019, with a linear warmup).

    Args:
        learning_rate: AdamW peak learning rate: finite and > 0.
        weight_decay: AdamW weight decay: finite and >= 0.
        adam_betas: AdamW ``(beta1, beta2)``: two finite numbers, each in [0, 1).
        warmup_steps: optimizer steps of linear warmup: an int >= 0.
        dtype: one of :data:`DTYPE_NAMES`.

    Raises:
        ValueError: an argument out of range or not finite; the message names the argument and its value.
    """
    if not _is_number(learning_rate) or not math.isfinite(learning_rate) or learning_rate <= 0:
        raise ValueError(f"learning_rate={learning_rate!r} is invalid: must be a finite number > 0")
    if not _is_number(weight_decay) or not math.isfinite(weight_decay) or weight_decay < 0:
        raise ValueError(f"weight_decay={weight_decay!r} is invalid: must be a finite number >= 0")
    betas = tuple(adam_betas) if isinstance(adam_betas, (tuple, list)) else None
    if betas is None or len(betas) != 2 or not all(_is_number(b) and math.isfinite(b) and 0 <= b < 1 for b in betas):
        raise ValueError(f"adam_betas={adam_betas!r} is invalid: must be two finite numbers, each in [0, 1)")
    if not isinstance(warmup_steps, numbers.Integral) or isinstance(warmup_steps, bool) or warmup_steps < 0:
        raise ValueError(f"warmup_steps={warmup_steps!r} is invalid: must be an int >= 0")
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype={dtype!r} is invalid: choose one of {', '.join(DTYPE_NAMES)}")


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_optimized_parameters(policy: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Check that ``optimizers`` (the trainer's, from ``configure_optimizers``) step exactly the parameters the fit
    trains: every parameter they hold is one of ``policy``'s as the trainer's backend made it (converted by
    ``MegatronStrategy``, sharded by FSDP), and every parameter of ``policy`` with ``requires_grad`` is held by one.

    An optimizer built before the backend's ``configure_model`` (in ``__init__``, or by LightningCLI's ``--optimizer``
    as Lightning itself instantiates it) holds parameters that the converted or sharded policy no longer trains: each
    step would leave the trained weights unchanged.

    Args:
        policy: the trained policy (``GRPOModule.policy`` after ``configure_model``).
        optimizers: the trainer's optimizers (their ``param_groups``).

    Raises:
        ValueError: an optimizer holds a parameter that is not the policy's (their number and shapes are named), or
            a trainable parameter of the policy is in no optimizer (named): either way ``configure_optimizers``
            must build the optimizer from ``GRPOModule.trained_parameters()``.
    """
    owned = {id(param) for param in policy.parameters()}
    held = {id(param): param for optimizer in optimizers for group in optimizer.param_groups
            for param in group["params"]}
    foreign = [param for key, param in held.items() if key not in owned]
    if foreign:
        shapes = ", ".join(str(tuple(param.shape)) for param in foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise ValueError(
            f"configure_optimizers returned an optimizer over {len(foreign)} parameters that the trained policy "
            f"({type(policy).__name__}) does not hold (shapes {shapes}): they were taken before the trainer's "
            "backend converted or sharded the policy in configure_model, so no step would change the trained "
            "weights; build the optimizer inside configure_optimizers from self.trained_parameters()")
    missing = [name for name, param in policy.named_parameters() if param.requires_grad and id(param) not in held]
    if missing:
        names = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise ValueError(
            f"{len(missing)} trainable parameters of the policy are in no optimizer that configure_optimizers "
            f"returned ({names}): they would get gradients but never change; build the optimizer from "
            "self.trained_parameters(), or freeze those parameters with requires_grad_(False)")
