"""Dropout in the policy: what has it, and switching it off (``GRPOConfig.disable_dropout``, TRL's knob).

GRPO's ratio ``pi / pi_old`` compares the training forward pass (train mode: dropout on) with the old logprobs,
computed without gradients in eval mode (dropout off;
:meth:`lightning_grpo.training.logprobs.CompletionLogprobs.batched`).
With dropout the two differ even on the same weights, so at the first of several updates per rollout the ratio is
not 1 and clipping sees noise; with one update per rollout the old logprobs are the detached current ones and the
ratio is 1.
"""

from __future__ import annotations

import logging

from torch import nn

log = logging.getLogger(__name__)


def dropout_rates(model: nn.Module) -> dict[str, float]:
    """``{module name: p}`` of every dropout with ``p > 0``: ``nn.Dropout`` modules (LoRA's ``lora_dropout`` are
    these) and HF attention layers' float ``attention_dropout`` (applied inside the attention call, not a module)."""
    rates: dict[str, float] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            rates[name] = float(module.p)
        rate = getattr(module, "attention_dropout", None)
        if isinstance(rate, float) and rate > 0:
            rates[f"{name}.attention_dropout"] = rate
    return rates


def disable_dropout(model: nn.Module) -> int:
    """Set every dropout of :func:`dropout_rates` to 0 in place; returns how many were set."""
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Dropout) and module.p > 0:
            module.p = 0.0
            count += 1
        rate = getattr(module, "attention_dropout", None)
        if isinstance(rate, float) and rate > 0:
            module.attention_dropout = 0.0
            count += 1
    return count


def warn_dropout_with_reused_rollouts(model: nn.Module, updates_per_rollout: int) -> None:
    """Warn when ``model`` has dropout and each rollout is trained on more than once (see the module docstring)."""
    rates = dropout_rates(model)
    if rates and updates_per_rollout > 1:
        first = ", ".join(f"{k}={v:g}" for k, v in list(rates.items())[:3])
        log.warning("the policy has %d dropout layers with p > 0 (%s, ...) and %d updates per rollout: the ratio "
                    "pi / pi_old compares a dropout forward pass with old logprobs computed without dropout, so it is "
                    "not 1 at the first update; set GRPOConfig.disable_dropout=True (TRL's disable_dropout) to train "
                    "without dropout", len(rates), first, updates_per_rollout)
