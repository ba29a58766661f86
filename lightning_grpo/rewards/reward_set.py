"""The reward set of a run: the functions, their names and weights, which may fail, which is primary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

from lightning_grpo.rewards.pool import PooledReward, RewardPool
from lightning_grpo.rewards.registry import resolve_reward_function
from lightning_grpo.rewards.scoring import (
    RewardScores,
    StartedScores,
    pooled_functions,
    reward_function_names,
    score_completions,
    start_pooled,
)

#: A reward function, a registered name, or an import path ``"pkg.module:function"``.
RewardSpec = Union[str, Callable[..., list]]


@dataclass
class RewardSet:
    """Reward functions with their metric names (``rewards/<name>/mean``), weights and roles.

    Attributes:
        funcs: the reward functions ``fn(prompts, completions, **columns) -> list[float | None]``.
        names: one unique name per function (:func:`reward_function_names`).
        weights: one weight per function, or None (all 1): the reward is the weighted sum.
        tolerant: names of functions whose exceptions become missing rewards instead of stopping the run.
        primary_index: the function whose spread decides dynamic sampling (``GRPOConfig.primary_reward``).
        accuracy: the function validation reports as ``val/accuracy``.
        pool: where the calls of the :class:`~lightning_grpo.rewards.pool.PooledReward` functions run (None: on
            the scoring thread).
        pooled: which of ``funcs`` are :class:`~lightning_grpo.rewards.pool.PooledReward` ones, by index (read once,
            when the set is made; the others are plain functions, called on the scoring thread).
    """

    funcs: list[Callable]
    names: list[str]
    weights: Optional[list[float]]
    tolerant: list[str]
    primary_index: int
    accuracy: Callable
    pool: Optional[RewardPool] = None
    pooled: dict[int, PooledReward] = field(init=False)

    def __post_init__(self) -> None:
        self.pooled = pooled_functions(self.funcs)

    @classmethod
    def from_specs(
        cls,
        reward_funcs: Sequence[RewardSpec],
        reward_weights: Optional[Sequence[float]] = None,
        tolerant: Sequence[str] = (),
        primary: Optional[str] = None,
        accuracy: Optional[RewardSpec] = None,
        pool_width: int = 1,
    ) -> "RewardSet":
        """Resolve and check the reward arguments of :class:`lightning_grpo.GRPOModule`; ``pool_width`` threads
        run the pooled functions' calls (``GRPOConfig.reward_num_workers``).

        Raises:
            ValueError: no reward function; a spec that does not resolve; ``reward_weights`` of the wrong length;
                a ``tolerant`` or ``primary`` name that is not a reward function's; ``pool_width < 1`` (each
                message names the value).
        """
        if not reward_funcs:
            raise ValueError("reward_funcs is empty: GRPO needs at least one reward function")
        funcs = [resolve_reward_function(f) for f in reward_funcs]
        names = reward_function_names(funcs)
        if reward_weights is not None and len(reward_weights) != len(funcs):
            raise ValueError(f"reward_weights has {len(reward_weights)} entries for {len(funcs)} reward_funcs")
        unknown = sorted(set(tolerant) - set(names))
        if unknown:
            raise ValueError(f"tolerant_reward_funcs {unknown} are not reward functions; known: {names}")
        if primary is not None and primary not in names:
            raise ValueError(f"GRPOConfig.primary_reward={primary!r} is not a reward function; known: {names}")
        return cls(
            funcs=funcs,
            names=names,
            weights=list(reward_weights) if reward_weights is not None else None,
            tolerant=list(tolerant),
            primary_index=0 if primary is None else names.index(primary),
            accuracy=resolve_reward_function(accuracy) if accuracy is not None else funcs[0],
            pool=RewardPool(pool_width),
        )

    def accuracy_for(self, check: Optional[RewardSpec]) -> Callable:
        """The correctness check an evaluation dataset names (a reward function, a registered name or an import
        path: the datamodule's :attr:`~lightning_grpo.data.source.EvalSource.eval_accuracy`); None: ``accuracy``.

        Raises:
            ValueError: a name that does not resolve (see :func:`resolve_reward_function`).
        """
        return self.accuracy if check is None else resolve_reward_function(check)

    @property
    def has_pooled(self) -> bool:
        """Some reward function is a :class:`~lightning_grpo.rewards.pool.PooledReward` (its calls can start early)."""
        return bool(self.pooled)

    def setup(self, device: object, compute_dtype: object = None) -> None:
        """Tell the pooled functions this process's device (:meth:`PooledReward.setup`) and the trainer's compute
        dtype (:attr:`PooledReward.compute_dtype`, None: leave it), before any scoring."""
        for fn in self.pooled.values():
            if compute_dtype is not None:
                fn.compute_dtype = compute_dtype
            fn.setup(device)

    def start(self, prompts: list, completions: list[str], columns: dict[str, list],
              group_size: Optional[int] = None) -> StartedScores:
        """Start the pooled functions' calls on N completions in the pool and return at once (e.g. on the thread
        that generated them, so that they run while the trainer trains); pass the result to :meth:`score`."""
        return start_pooled(self.funcs, prompts, completions, columns, self.pool, group_size, self.pooled)

    def score(self, prompts: list, completions: list[str], columns: dict[str, list],
              group_size: Optional[int] = None, started: Optional[StartedScores] = None) -> RewardScores:
        """Score N completions (see :func:`lightning_grpo.rewards.scoring.score_completions`); ``group_size``: G;
        ``started``: what :meth:`start` started for the same inputs."""
        return score_completions(self.funcs, prompts, completions, columns, self.weights, tolerant=self.tolerant,
                                 pool=self.pool, group_size=group_size, started=started, pooled=self.pooled)

    def close(self) -> None:
        """End the pool's threads (after the running calls)."""
        if self.pool is not None:
            self.pool.close()
