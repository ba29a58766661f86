"""Dynamic sampling (DAPO, Yu et al. 2025, arXiv:2503.14476, eq. 11 and Algorithm 1): keep only groups whose
completions are neither all correct nor all wrong, and generate more prompt batches until the batch is full.

The filter looks at the *primary* reward function's raw values (the accuracy), never at the shaped reward: a
group of four wrong answers whose lengths differ has a non-zero std after a length penalty but still carries no
correctness signal. :class:`DynamicSampler` is the bookkeeping, pure and process-local; the module decides, for
all processes together, whether to generate another round (so every process runs the same number of rollouts).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import torch
from torch import Tensor

from lightning_grpo.protocols.rollout import RolloutOutput
from lightning_grpo.protocols.tokens import ROW_META, select_rows


@dataclass
class ScoredRollout:
    """The scored completions of one or more generation rounds, prompt-major (group ``i`` is rows
    ``i*G .. i*G+G-1``).

    Attributes:
        rollout: the rows as the sampler returned them (:class:`~lightning_grpo.protocols.rollout.RolloutOutput`:
            ids, masks and every per-token field, texts, episodes, images).
        per_function: ``(N, F)`` float32 raw reward of each function, NaN = missing.
        rewards: ``(N,)`` float32 weighted sum, NaN where every function is missing.
        num_generations: G.
        pad_token_id: id used to pad ``prompt_ids`` / ``completion_ids``.
        row_index: ``(N,)`` long, each row's position among all generated rows (to find its text), or None.
    """

    rollout: RolloutOutput
    per_function: Tensor = field(metadata=ROW_META)
    rewards: Tensor = field(metadata=ROW_META)
    num_generations: int = 1
    pad_token_id: int = 0
    row_index: Optional[Tensor] = field(default=None, metadata=ROW_META)

    def __len__(self) -> int:
        return len(self.rollout)

    @property
    def num_groups(self) -> int:
        return len(self) // self.num_generations

    def groups(self, index: list[int]) -> "ScoredRollout":
        """The rollout restricted to the groups ``index`` (in that order)."""
        g = self.num_generations
        rows = torch.tensor([i * g + j for i in index for j in range(g)], dtype=torch.long)
        return replace(self, rollout=self.rollout.select(rows), **select_rows(self, rows))

    @staticmethod
    def cat(parts: list["ScoredRollout"]) -> "ScoredRollout":
        """Concatenate rollouts row-wise (:meth:`RolloutOutput.cat`: prompts re-padded on the left, completions and
        every per-token field on the right).

        Raises:
            ValueError: no parts, or parts that differ in G, reward functions or the fields they carry.
        """
        if not parts:
            raise ValueError("ScoredRollout.cat needs at least one part")
        first = parts[0]
        if len(parts) == 1:
            return first
        for part in parts[1:]:
            same_functions = part.per_function.shape[1] == first.per_function.shape[1]
            if part.num_generations != first.num_generations or not same_functions:
                raise ValueError("ScoredRollout.cat: parts differ in num_generations or number of reward functions")
        return replace(
            first,
            rollout=RolloutOutput.cat([x.rollout for x in parts], first.pad_token_id),
            per_function=torch.cat([x.per_function for x in parts]),
            rewards=torch.cat([x.rewards for x in parts]),
            row_index=None if any(x.row_index is None for x in parts)
            else torch.cat([x.row_index for x in parts if x.row_index is not None]),
        )


def informative_groups(primary: Tensor, num_generations: int) -> Tensor:
    """Which groups have at least two different valid values of the primary reward (DAPO eq. 11:
    ``0 < |{o_i correct}| < G``, generalized to any reward).

    Args:
        primary: ``(num_prompts * G,)`` float raw primary-reward values, NaN = missing (ignored).
        num_generations: G.

    Returns:
        ``(num_prompts,)`` bool.

    Example (golden): G = 4, [1,1,1,1, 0,1,0,0, 0,0,0,0, 0.5,nan,0.5,nan] -> [False, True, False, False].
    """
    grouped = primary.float().view(-1, num_generations)  # [P, G]
    valid = ~torch.isnan(grouped)
    highest = torch.where(valid, grouped, -torch.inf).amax(dim=1)
    lowest = torch.where(valid, grouped, torch.inf).amin(dim=1)
    return (valid.sum(dim=1) >= 2) & (highest > lowest)


class DynamicSampler:
    """Collects the groups of successive generation rounds until ``target_groups`` informative groups are held.

    :meth:`batch` then returns exactly ``target_groups`` groups: the first informative ones in generation order;
    when fewer exist (the round limit or the data ran out), the batch is filled up with the earliest
    uninformative groups, which are trained on like any other group (their advantages are 0 unless another
    reward function varies within them) and counted in ``filled_groups``.

    Args:
        target_groups: groups (prompts) per rollout batch on this process.
        primary_index: column of ``ScoredRollout.per_function`` that the filter reads.
        enabled: False keeps every group of a single round (dynamic sampling off).
    """

    def __init__(self, target_groups: int, primary_index: int = 0, enabled: bool = True) -> None:
        if target_groups < 1:
            raise ValueError(f"target_groups={target_groups} must be >= 1")
        self.target_groups = target_groups
        self.primary_index = primary_index
        self.enabled = enabled
        self._parts: list[tuple[ScoredRollout, Tensor]] = []

    def add(self, rollout: ScoredRollout) -> None:
        """Add one round's scored groups."""
        if self.enabled:
            keep = informative_groups(rollout.per_function[:, self.primary_index], rollout.num_generations)
        else:
            keep = torch.ones(rollout.num_groups, dtype=torch.bool)
        self._parts.append((rollout, keep.cpu()))

    @property
    def num_informative(self) -> int:
        return sum(int(keep.sum()) for _, keep in self._parts)

    @property
    def gen_batches(self) -> int:
        return len(self._parts)

    @property
    def need_more(self) -> bool:
        """Whether fewer than ``target_groups`` informative groups are held (always False when disabled)."""
        return self.enabled and self.num_informative < self.target_groups

    def batch(self) -> tuple[ScoredRollout, dict[str, float]]:
        """The rollout batch of ``target_groups`` groups (fewer only if fewer were generated) and its statistics
        ``gen_batches``, ``dropped_groups`` (uninformative groups left out), ``filled_groups`` (uninformative
        groups kept to fill the batch) and ``surplus_groups`` (informative groups beyond the target, left out).

        Raises:
            ValueError: nothing was added.
        """
        if not self._parts:
            raise ValueError("DynamicSampler.batch: no rollout was added")
        if not self.enabled:
            rollout, _ = self._parts[-1]
            return rollout, {"gen_batches": 1.0}
        chosen: list[ScoredRollout] = []
        budget = self.target_groups
        informative = uninformative = 0
        for rollout, keep in self._parts:
            index = keep.nonzero().flatten().tolist()[:budget]
            informative += int(keep.sum())
            budget -= len(index)
            if index:
                chosen.append(rollout.groups(index))
        filled = 0
        for rollout, keep in self._parts:
            index = (~keep).nonzero().flatten().tolist()
            uninformative += len(index)
            index = index[:budget]
            budget -= len(index)
            filled += len(index)
            if index:
                chosen.append(rollout.groups(index))
        stats = {
            "gen_batches": float(len(self._parts)),
            "dropped_groups": float(uninformative - filled),
            "filled_groups": float(filled),
            "surplus_groups": float(max(informative - self.target_groups, 0)),
        }
        return ScoredRollout.cat(chosen), stats
