"""Scoring a streamed group as it arrives: its rows
(:func:`~lightning_grpo.rollout.streaming.scored_groups.group_rollout`), its slow rewards started in the reward pool
(:mod:`lightning_grpo.rewards.pool`) at once, the rest scored on the producer's scoring thread, and dynamic sampling's
filter (DAPO eq. 11: a group whose primary reward does not vary is dropped on arrival, and the producer draws more
prompts)."""

from __future__ import annotations

from typing import Any, Optional

from lightning_grpo.algorithm.dynamic_sampling import ScoredRollout, informative_groups
from lightning_grpo.protocols.rollout import RolloutOutput
from lightning_grpo.protocols.streaming import SampledGroup
from lightning_grpo.rewards import RewardSet, StartedScores
from lightning_grpo.rollout.streaming.scored_groups import PromptItem, ScoredGroup, group_rollout


class GroupScorer:
    """Turns a sampled group into a :class:`ScoredGroup` (or None: dropped by dynamic sampling).

    Args:
        rewards: the run's reward set (its pool runs the slow rewards).
        tokenizer: decodes the completions' texts.
        pad_token_id: pads the ids.
        dynamic_sampling: drop groups whose primary reward (``rewards.primary_index``) does not vary.
    """

    def __init__(self, rewards: RewardSet, tokenizer: Any, pad_token_id: int, dynamic_sampling: bool) -> None:
        self.rewards, self.tokenizer, self.pad_token_id = rewards, tokenizer, pad_token_id
        self.dynamic_sampling = dynamic_sampling

    def _inputs(self, item: PromptItem, out: RolloutOutput) -> tuple[list, list[str], dict[str, list]]:
        """The reward functions' prompts, completions and dataset columns (each repeated G times)."""
        g = len(out)
        columns = {k: [v] * g for k, v in item.row.items() if k != "prompt"}
        return [item.row["prompt"]] * g, out.completions, columns

    def start(self, item: PromptItem, group: SampledGroup) -> tuple[RolloutOutput, Optional[StartedScores]]:
        """The group's rows, and its pooled rewards started in the pool (None: the reward set has none); returns at
        once."""
        out = group_rollout(group, self.tokenizer, self.pad_token_id)
        if not self.rewards.has_pooled:
            return out, None
        prompts, completions, columns = self._inputs(item, out)
        return out, self.rewards.start(prompts, completions, columns, group_size=len(out))

    def score(self, item: PromptItem, group: SampledGroup, out: RolloutOutput,
              started: Optional[StartedScores]) -> Optional[ScoredGroup]:
        """Score the group (the plain reward functions run here, the pooled ones' results are collected); None when
        dynamic sampling drops it.

        Raises:
            ValueError, RuntimeError: as :meth:`lightning_grpo.rewards.RewardSet.score` (a reward function that
                raises, not tolerant).
        """
        prompts, completions, columns = self._inputs(item, out)
        scores = self.rewards.score(prompts, completions, columns, group_size=len(out), started=started)
        g = len(out)
        if self.dynamic_sampling:
            primary = scores.per_function[:, self.rewards.primary_index]
            if not bool(informative_groups(primary, g)[0]):
                return None
        scored = ScoredRollout(out, per_function=scores.per_function, rewards=out.unscored_as_nan(scores.rewards),
                               num_generations=g, pad_token_id=self.pad_token_id)
        outcomes = {key: float(count) for key, count in scores.outcomes.items()}
        return ScoredGroup(item, scored, group.engine, outcomes, dict(scores.seconds))
