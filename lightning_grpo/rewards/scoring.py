"""Run several reward functions over a rollout and combine them into one reward per completion.

A reward function is ``fn(prompts, completions, **columns) -> list[float | None]`` with one entry per
completion; ``None`` means "this function cannot score this sample" (as in TRL's ``GRPOTrainer``). The
combined reward of sample i is ``sum_f w_f * r_{i,f}`` over the functions whose entry is not ``None``
(TRL's ``nansum`` convention). When *every* function returned ``None`` for a sample its reward is NaN:
the caller must drop or fill such samples before computing advantages (nothing is silently set to 0).

Plain functions are called on the caller's thread, one after the other, with the whole batch. A
:class:`~lightning_grpo.rewards.pool.PooledReward` (a reward model, a judge, a sandboxed code reward, or a function
wrapped by :func:`~lightning_grpo.rewards.pool.pooled`) is called on slices of ``chunk_size`` completions in a
:class:`~lightning_grpo.rewards.pool.RewardPool` when one is given (:func:`start_pooled` submits them, and may do
so before the plain functions run, e.g. on the thread that generated the rollout), else on the caller's thread; the
rewards are the same either way.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from lightning_grpo.rewards.pool import PooledReward, RewardChunk, RewardPool

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
        seconds: ``name -> wall seconds`` each function ran, for ``timing/reward_<name>_s``: a plain function's call;
            a pooled one's calls, the length of the union of their spans (:func:`busy_seconds`: calls that ran at
            once count once, the time a call waited for a pool thread or its start does not count).
        outcomes: ``"<name>/<outcome>" -> completions`` counted by the pooled functions' declared ``outcomes``
            (every declared outcome is present, 0 included), for ``rewards/<name>/<outcome>``.
    """

    rewards: Tensor
    per_function: Tensor
    names: list[str]
    seconds: dict[str, float] = field(default_factory=dict)
    outcomes: dict[str, float] = field(default_factory=dict)


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


def _to_floats(values, name: str, n: int, offset: int = 0) -> list[float]:
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
            raise ValueError(f"reward function {name!r} returned {value!r} at index {offset + i}, not a number") \
                from err
        if not math.isfinite(value):
            raise ValueError(f"reward function {name!r} returned non-finite {value} at index {offset + i} (use None "
                             "to skip)")
        floats.append(value)
    return floats


def _check_inputs(reward_funcs: Sequence[Callable], prompts: list, completions: list[str], columns: dict[str, list],
                  reward_weights: Sequence[float] | None, tolerant: Collection[str]) -> tuple[list[str], list[float]]:
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
    return names, weights


def _slices(fn: PooledReward, name: str, n: int, group_size: Optional[int]) -> list[tuple[int, int]]:
    """The ``[start, end)`` row ranges of ``fn``'s calls: fixed by its ``chunk_size`` (and G), never by the pool."""
    size = fn.chunk_size
    if size == "group":
        if group_size is None or group_size < 1 or n % group_size:
            raise ValueError(f"reward function {name!r} scores whole groups (chunk_size='group'), which needs the "
                             f"group size G dividing the {n} completions; got group_size={group_size!r}")
        size = group_size
    elif size is None:
        size = max(n, 1)
    return [(start, min(start + size, n)) for start in range(0, n, size)]


@dataclass
class _Call:
    """One call of a pooled function on rows ``[start, end)``: its result or error and its wall-clock span."""

    start: int
    end: int
    chunk: Optional[RewardChunk] = None
    error: Optional[BaseException] = None
    began: float = 0.0
    ended: float = 0.0


def _run_call(fn: PooledReward, call: _Call, prompts: list, completions: list[str], columns: dict[str, list]) -> _Call:
    call.began = time.perf_counter()
    try:
        rows = slice(call.start, call.end)
        call.chunk = fn.score_chunk(prompts[rows], completions[rows], {k: v[rows] for k, v in columns.items()})
    except Exception as err:  # reported, with the rows, when the calls are collected
        call.error = err
    call.ended = time.perf_counter()
    return call


def pooled_functions(reward_funcs: Sequence[Callable]) -> dict[int, PooledReward]:
    """The :class:`PooledReward` functions among ``reward_funcs``, by index: what the reward set reads once, when it
    is made (:attr:`lightning_grpo.rewards.RewardSet.pooled`)."""
    return {j: fn for j, fn in enumerate(reward_funcs) if isinstance(fn, PooledReward)}


@dataclass
class StartedScores:
    """The calls of a rollout's pooled reward functions, started by :func:`start_pooled` (running or done)."""

    index: list[int]  # which of the reward functions are pooled
    calls: list[list[tuple[_Call, Optional[Future]]]]  # per pooled function; future None: not started (no pool)
    n: int

    def futures(self) -> list[Future]:
        """The calls running in the pool (a caller may wait for them without blocking, e.g. an event loop)."""
        return [future for calls in self.calls for _, future in calls if future is not None]


def start_pooled(reward_funcs: Sequence[Callable], prompts: list, completions: list[str], columns: dict[str, list],
                 pool: Optional[RewardPool], group_size: Optional[int] = None,
                 pooled: Optional[Mapping[int, PooledReward]] = None) -> StartedScores:
    """Submit the calls of the :class:`PooledReward` functions among ``reward_funcs`` (``pooled``: which they are,
    default :func:`pooled_functions`) to ``pool`` (None: they run later, on the thread that collects them); returns
    at once. Pass the result to :func:`score_completions`.

    Raises:
        ValueError: a function with ``chunk_size="group"`` and no ``group_size`` dividing N.
    """
    names = reward_function_names(reward_funcs)
    pooled = pooled_functions(reward_funcs) if pooled is None else pooled
    index = sorted(pooled)
    calls = []
    for j in index:
        fn = pooled[j]
        mine = []
        for start, end in _slices(fn, names[j], len(completions), group_size):
            call = _Call(start, end)
            future = pool.submit(_run_call, fn, call, prompts, completions, columns) if pool is not None else None
            mine.append((call, future))
        calls.append(mine)
    return StartedScores(index, calls, len(completions))


def _collect(fn: PooledReward, name: str, calls: list[tuple[_Call, Optional[Future]]], prompts: list,
             completions: list[str], columns: dict[str, list]) -> tuple[list[float], dict[str, int], float]:
    """Wait for (or run) ``fn``'s calls; its N rewards, outcome counts and wall seconds.

    Raises:
        RuntimeError: a call raised (the function and the call's rows are named; chained from the error).
        ValueError: a call returned the wrong number of rewards or a non-number.
    """
    values: list[float] = []
    outcomes = dict.fromkeys(fn.outcomes, 0)
    for call, future in calls:
        if future is None:
            _run_call(fn, call, prompts, completions, columns)
        else:
            future.result()
    for call, _ in calls:
        if call.error is not None:
            rows = f"sample {call.start}" if call.end - call.start == 1 else f"samples {call.start}..{call.end - 1}"
            err = call.error
            raise RuntimeError(f"reward function {name!r} raised {type(err).__name__} on {rows}: {err}") from err
        assert call.chunk is not None
        values += _to_floats(call.chunk.values, name, call.end - call.start, offset=call.start)
        for key, count in call.chunk.outcomes.items():
            if key not in outcomes:
                raise ValueError(f"reward function {name!r} counted outcome {key!r}, which it does not declare "
                                 f"(outcomes={fn.outcomes})")
            outcomes[key] += int(count)
    return values, outcomes, busy_seconds([(c.began, c.ended) for c, _ in calls])


def busy_seconds(spans: Sequence[tuple[float, float]]) -> float:
    """The seconds during which at least one of the ``(began, ended)`` spans ran: the length of their union (calls
    that ran at once count once; the gaps between them, a call waiting for a pool thread, count not at all).

    Example: ``[(0, 2), (1, 3), (5, 6)]`` -> 4.0 (``[0, 3]`` and ``[5, 6]``).
    """
    total, end = 0.0, -math.inf
    for began, ended in sorted(spans):
        if ended > end:
            total += ended - max(began, end)
            end = ended
    return total


def score_completions(  # noqa: C901 - input checks, then one loop
    reward_funcs: Sequence[Callable],
    prompts: list,
    completions: list[str],
    columns: dict[str, list],
    reward_weights: Sequence[float] | None = None,
    tolerant: Collection[str] = (),
    pool: Optional[RewardPool] = None,
    group_size: Optional[int] = None,
    started: Optional[StartedScores] = None,
    pooled: Optional[Mapping[int, PooledReward]] = None,
) -> RewardScores:
    """Score N completions with F reward functions and combine them (see the module docstring).

    Args:
        reward_funcs: F reward functions, each called once as ``fn(prompts, completions, **columns)`` (a
            :class:`~lightning_grpo.rewards.pool.PooledReward`: once per slice of its ``chunk_size``).
        prompts: N prompts (one per completion, prompt-major).
        completions: N completion texts.
        columns: dataset columns, each a list of N entries, passed as keyword arguments (e.g. ``answer``).
        reward_weights: F finite weights; ``None`` means all 1.0.
        tolerant: names (as in :func:`reward_function_names`) of functions whose exceptions are logged as a
            warning and turned into NaN entries instead of raised.
        pool: where the pooled functions' calls run (None: on this thread).
        group_size: G, for functions that score whole groups (``chunk_size="group"``).
        started: the pooled calls :func:`start_pooled` already started for these same inputs (None: start them
            now).
        pooled: which functions are :class:`PooledReward` ones, by index (default :func:`pooled_functions`).

    Returns:
        :class:`RewardScores` with ``rewards`` ``(N,)``, ``per_function`` ``(N, F)`` (float32), ``names``,
        ``seconds`` and ``outcomes``.

    Raises:
        ValueError: no functions; ``len(prompts) != N``; a column whose length is not N, or named ``prompts``
            or ``completions``; a ``tolerant`` name that is not a function name; ``reward_weights`` not of length
            F or not finite; a function returning a list whose length is not N, a non-number, or a non-finite
            value (naming the function and the index); a pooled function counting an undeclared outcome.
        RuntimeError: a function not in ``tolerant`` raised; names the function and, when calling it on each
            sample alone reproduces the error, the first failing index (a pooled function: the rows of the call
            that raised); chained from the original exception.
    """
    names, weights = _check_inputs(reward_funcs, prompts, completions, columns, reward_weights, tolerant)
    n = len(completions)
    pooled = pooled_functions(reward_funcs) if pooled is None else pooled
    if started is None:
        started = start_pooled(reward_funcs, prompts, completions, columns, pool, group_size, pooled)
    if started.n != n:
        raise ValueError(f"the started pooled rewards are for {started.n} completions, not {n}")
    pooled_calls = dict(zip(started.index, started.calls, strict=True))
    per_function = torch.full((n, len(names)), math.nan, dtype=torch.float32)
    seconds: dict[str, float] = {}
    outcomes: dict[str, float] = {}
    order = [j for j in range(len(names)) if j not in pooled_calls] + started.index  # plain ones while pooled run
    for j in order:
        fn, name = reward_funcs[j], names[j]
        began = time.perf_counter()
        try:
            if j in pooled_calls:
                values, counts, seconds[name] = _collect(pooled[j], name, pooled_calls[j], prompts, completions,
                                                         columns)
                outcomes.update({f"{name}/{k}": float(v) for k, v in counts.items()})
            else:
                values = _to_floats(_call(fn, name, prompts, completions, columns), name, n)
                seconds[name] = time.perf_counter() - began
        except RuntimeError as err:
            if name not in tolerant:
                raise
            log.warning("%s; its %d rewards are NaN (tolerant)", err, n)
            if j in pooled:
                outcomes.update({f"{name}/{k}": 0.0 for k in pooled[j].outcomes})
            seconds.setdefault(name, time.perf_counter() - began)
            continue
        per_function[:, j] = torch.tensor(values, dtype=torch.float32)

    weighted = per_function * torch.tensor(weights, dtype=torch.float32)
    missing = per_function.isnan()
    rewards = weighted.masked_fill(missing, 0.0).sum(dim=1)
    rewards = rewards.masked_fill(missing.all(dim=1), math.nan)
    return RewardScores(rewards=rewards, per_function=per_function, names=names, seconds=seconds, outcomes=outcomes)
