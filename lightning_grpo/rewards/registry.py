"""Reward functions addressable by name in configs, and the resolution of a spec into a function."""

from __future__ import annotations

import importlib
from typing import Callable, Union

from lightning_grpo.rewards.code import CodeReward, code_block_format
from lightning_grpo.rewards.env_reward import env_reward
from lightning_grpo.rewards.format import gsm8k_format
from lightning_grpo.rewards.gsm8k import gsm8k_accuracy, make_gsm8k_accuracy
from lightning_grpo.rewards.math import math_accuracy

#: Reward functions addressable by name in configs.
REWARD_FUNCTIONS: dict[str, Callable] = {
    "gsm8k_accuracy": gsm8k_accuracy,
    "gsm8k_accuracy_strict": make_gsm8k_accuracy(last_number_fallback=False),
    "gsm8k_format": gsm8k_format,
    "math_accuracy": math_accuracy,
    "code_pass_rate": CodeReward(),  # unit-test pass rate in the sandbox (default limits and isolation)
    "code_block_format": code_block_format,
    "env_reward": env_reward,  # multi-turn: the environment's reward (docs/multiturn.md)
}


def resolve_reward_function(spec: Union[str, Callable]) -> Callable:
    """The reward function named by ``spec``.

    Args:
        spec: a callable (returned as is); a key of :data:`REWARD_FUNCTIONS`; or an import path
            ``"pkg.module:function"`` (the part after ``:`` may be dotted, ``"pkg.module:Class.method"``) or
            ``"pkg.module.function"``.

    Raises:
        ValueError: ``spec`` is not registered, cannot be imported, or does not name a callable (the message names
            ``spec`` and, for a bare name, the registered names).
    """
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"reward function spec {spec!r} must be a callable or a string")
    if spec in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[spec]
    if ":" in spec:
        module_name, _, attr_path = spec.partition(":")
    elif "." in spec:
        module_name, _, attr_path = spec.rpartition(".")
    else:
        raise ValueError(f"unknown reward function {spec!r}; registered: {sorted(REWARD_FUNCTIONS)}")
    try:
        obj = importlib.import_module(module_name)
        for attr in attr_path.split("."):
            obj = getattr(obj, attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"cannot import reward function {spec!r}: {err}") from err
    if not callable(obj):
        raise ValueError(f"reward function {spec!r} resolves to {type(obj).__name__}, which is not callable")
    return obj
