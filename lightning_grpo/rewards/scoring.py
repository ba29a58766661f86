"""Run several reward functions over a rollout and combine them into one reward per completion.

A reward function is ``fn(prompts, completions, **columns) -> list[float | None]`` with one entry per
completion; ``None`` means "this function cannot score this sample" (as in TRL's ``GRPOTrainer``). The
combined reward of sample i is ``sum_f w_f * r_{i,f}`` over the functions whose entry is not ``None``
(TRL's ``nansum`` convention). When *every* function returned ``None`` for a sample its reward is NaN:
the caller must drop or fill such samples before computing advantages (nothing is silently set to 0).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

log = logging.getLogger(__name__)


@dataclass
class RewardScores:
    """Rewards of N completions under F reward functions.

    Attributes:
        rewards: ``(N,)`` float32, the weighted sum over functions of the non-NaN entries of ``per_function``;
            NaN where all F entries are NaN.
        per_function: ``(N, F)`` float32 raw (unweighted) rewards; NaN where a function returned ``None`` (or
            raised, for a function listed in ``tolerant``).
        names: ``F`` unique function names (see :func:`reward_function_names`), e.g. for metric keys.
    """

    rewards: Tensor
    per_function: Tensor
    names: list[str]


def _base_name(fn: Callable) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    name = getattr(fn, "__name__", None)
    return name if isinstance(name, str) else type(fn).__name__


def reward_function_names(reward_funcs: Sequence[Callable]) -> list[str]:
    """Unique names of reward functions, in order.

    A function's ``__name__``; a :func:`functools.partial` takes its wrapped function's name; a callable
    instance without ``__name__`` takes its class name. Repeats get suffixes: ``["f", "f_1", "f_2"]``.
    """
    names: list[str] = []
    for fn in reward_funcs:
        base = name = _base_name(fn)
        k = 0
        while name in names:
            k += 1
            name = f"{base}_{k}"
        names.append(name)
    return names


def _failing_index(fn: Callable, prompts: list, completions: list[str], columns: dict[str, list]) -> int | None:
    """Index of the first sample on which ``fn`` raises when called on that sample alone (None if none does)."""
    for i in range(len(completions)):
        try:
            fn([prompts[i]], [completions[i]], **{k: [v[i]] for k, v in columns.items()})
        except Exception:
            return i
    return None


def _call(fn: Callable, name: str, prompts: list, completions: list[str], columns: dict[str, list]) -> list:
    try:
        return fn(prompts, completions, **columns)
    except Exception as err:
        index = _failing_index(fn, prompts, completions, columns)
        where = f" on sample {index}" if index is not None else " (no single sample reproduces it)"
        raise RuntimeError(f"reward function {name!r} raised {type(err).__name__}{where}: {err}") from err


def _to_floats(values, name: str, n: int) -> list[float]:
    if hasattr(values, "tolist"):  # torch.Tensor, numpy.ndarray
        values = values.tolist()
    if not isinstance(values, Sequence) or isinstance(values, (str, bytes)):
        raise ValueError(f"reward function {name!r} returned {type(values).__name__}, expected a list of {n} floats")
    if len(values) != n:
        raise ValueError(f"reward function {name!r} returned {len(values)} rewards for {n} completions")
    floats = []
    for i, value in enumerate(values):
        if value is None:
            floats.append(math.nan)
            continue
        try:
            value = float(value)
        except (TypeError, ValueError) as err:
            raise ValueError(f"reward function {name!r} returned {value!r} at index {i}, not a number") from err
        if not math.isfinite(value):
            raise ValueError(f"reward function {name!r} returned non-finite {value} at index {i} (use None to skip)")
        floats.append(value)
    return floats


def score_completions(  # noqa: C901 - input checks, then one loop
    reward_funcs: Sequence[Callable],
    prompts: list,
    completions: list[str],
    columns: dict[str, list],
    reward_weights: Sequence[float] | None = None,
    tolerant: Collection[str] = (),
) -> RewardScores:
    """Score N completions with F reward functions and combine them (see the module docstring).

    Args:
        reward_funcs: F reward functions, each called once as ``fn(prompts, completions, **columns)``.
        prompts: N prompts (one per completion, prompt-major).
        completions: N completion texts.
        columns: dataset columns, each a list of N entries, passed as keyword arguments (e.g. ``answer``).
        reward_weights: F finite weights; ``None`` means all 1.0.
        tolerant: names (as in :func:`reward_function_names`) of functions whose exceptions are logged as a
            warning and turned into NaN entries instead of raised.

    Returns:
        :class:`RewardScores` with ``rewards`` ``(N,)``, ``per_function`` ``(N, F)`` (float32) and ``names``.

    Raises:
        ValueError: no functions; ``len(prompts) != N``; a column whose length is not N, or named ``prompts``
            or ``completions``; a ``tolerant`` name that is not a function name; ``reward_weights`` not of length
            F or not finite; a function returning a list whose length is not N, a non-number, or a non-finite
            value (naming the function and the index).
        RuntimeError: a function not in ``tolerant`` raised; names the function and, when calling it on each
            sample alone reproduces the error, the first failing index; chained from the original exception.
    """
    n, names = len(completions), reward_function_names(reward_funcs)
    if not names:
        raise ValueError("reward_funcs is empty: give at least one reward function")
    if len(prompts) != n:
        raise ValueError(f"prompts has {len(prompts)} entries but there are {n} completions")
    for key, values in columns.items():
        if key in ("prompts", "completions"):
            raise ValueError(f"column {key!r} clashes with the reward-function argument of the same name")
        if len(values) != n:
            raise ValueError(f"column {key!r} has {len(values)} entries but there are {n} completions")
    weights = [1.0] * len(names) if reward_weights is None else [float(w) for w in reward_weights]
    if len(weights) != len(names) or not all(math.isfinite(w) for w in weights):
        raise ValueError(f"reward_weights={list(weights)} must be {len(names)} finite numbers, one per function")
    unknown = sorted(set(tolerant) - set(names))
    if unknown:
        raise ValueError(f"tolerant names {unknown} are not reward functions; known: {names}")

    per_function = torch.full((n, len(names)), math.nan, dtype=torch.float32)
    for j, (fn, name) in enumerate(zip(reward_funcs, names, strict=True)):
        try:
            values = _call(fn, name, prompts, completions, columns)
        except RuntimeError as err:
            if name not in tolerant:
                raise
            log.warning("%s; its %d rewards are NaN (tolerant)", err, n)
            continue
        per_function[:, j] = torch.tensor(_to_floats(values, name, n), dtype=torch.float32)

    weighted = per_function * torch.tensor(weights, dtype=torch.float32)
    missing = per_function.isnan()
    rewards = weighted.masked_fill(missing, 0.0).sum(dim=1)
    rewards = rewards.masked_fill(missing.all(dim=1), math.nan)
    return RewardScores(rewards=rewards, per_function=per_function, names=names)
