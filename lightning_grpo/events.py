"""Rollout events: what the experience maker and the rollout worker tell an optional event sink.

The components never import Lightning; they call ``sink(name, payload)``. :class:`lightning_grpo.GRPOModule`
forwards each event to the typed hook of that name of every :class:`~lightning_grpo.callbacks.GRPOCallback` in
``trainer.callbacks``, as ``callback.<name>(trainer, pl_module, payload)``
(:class:`lightning_grpo.callbacks.grpo_callback.EventRoute`; a plain ``Callback`` with such a method gets nothing, and
is warned about at setup).

Order within one optimizer step's rollout (documented and tested):

1. ``on_weights_synced(trainer, pl_module, version: int)``: the engine now generates with the weights after
   ``version`` optimizer steps. Fired when the worker pushes new weights (vLLM: before the first rollout and
   then every ``engine.sync_every`` steps; HF: the engine is the policy, fired at the first rollout after each
   optimizer step). Validation may fire it too (it forces a sync). With asynchronous rollouts
   (``GRPOConfig.max_staleness``) the sync happens before a later rollout is started in the background, so it
   precedes the ``on_rollout_end`` of an older rollout.
2. ``on_rollout_end(trainer, pl_module, rollout: RolloutEnd)``: the rollout is generated and scored, before any
   shaping or advantage (with dynamic sampling: once, for the batch that will be trained on).
3. ``on_experience(trainer, pl_module, experience: ExperienceReady)``: advantages (and old/ref logprobs) are
   computed; training on it follows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from torch import Tensor

from lightning_grpo.protocols.episode import EpisodeRecord
from lightning_grpo.training.experience import Experience

#: The event names, in the order they occur for one rollout.
ON_WEIGHTS_SYNCED = "on_weights_synced"
ON_ROLLOUT_END = "on_rollout_end"
ON_EXPERIENCE = "on_experience"
EVENTS = (ON_WEIGHTS_SYNCED, ON_ROLLOUT_END, ON_EXPERIENCE)

#: ``sink(event_name, payload)``.
EventSink = Callable[[str, Any], None]


@dataclass
class RolloutEnd:
    """A scored rollout of ``N = prompts x G`` completions, prompt-major (group ``i`` is rows ``i*G .. i*G+G-1``).

    Attributes:
        prompts: ``N`` prompts (message lists or strings), each repeated G times.
        completions: ``N`` completion texts.
        rewards: ``(N,)`` float32 weighted sum of the reward functions, NaN where none scored.
        per_function: ``(N, F)`` float32 each reward function's raw value, NaN = missing.
        reward_names: the ``F`` reward functions' names (as in ``rewards/<name>/mean``).
        lengths: ``(N,)`` long completion lengths in tokens (through the first EOS).
        truncated: ``(N,)`` bool, no EOS within ``max_new_tokens``.
        columns: the dataset's other columns, ``N`` values each (e.g. ``answer``).
        num_generations: G.
        weights_version: optimizer steps taken by the weights that generated it (older than the trained weights by
            ``rollout/staleness_max`` with asynchronous rollouts; streaming rollouts: those of its oldest token, each
            token's being in ``ExperienceReady.experience.completion_versions``), or None where unknown.
        episodes: multi-turn rollouts: each row's :class:`~lightning_grpo.protocols.episode.EpisodeRecord`
            (the whole transcript, turn by turn, with each turn's token span and whether the model wrote it);
            ``completions`` are then the episodes' last model turns and ``lengths`` count the model's tokens. None
            for single-turn rollouts.
        prompt_keys: streaming rollouts: each row's prompt key (its place in this process's data order over the run,
            :mod:`lightning_grpo.rollout.streaming`), ``N`` values; None in the fixed schedule.
    """

    prompts: list
    completions: list[str]
    rewards: Tensor
    per_function: Tensor
    reward_names: list[str]
    lengths: Tensor
    truncated: Tensor
    columns: dict[str, list] = field(default_factory=dict)
    num_generations: int = 1
    weights_version: Optional[int] = None
    episodes: Optional[list[EpisodeRecord]] = None
    prompt_keys: Optional[list[int]] = None


@dataclass
class ExperienceReady:
    """The experience about to be trained on and the rollout it came from (rows aligned).

    Attributes:
        experience: the :class:`~lightning_grpo.training.experience.Experience` (``advantages`` ``(N,)`` float32).
        rollout: the :class:`RolloutEnd` of the same rows.
        shaped_rewards: ``(N,)`` float32 rewards after shaping (overlong penalty, scale/clip, KL in the reward).
    """

    experience: Experience
    rollout: RolloutEnd
    shaped_rewards: Tensor

    @property
    def advantages(self) -> Tensor:
        """``(N,)`` float32 group-relative advantages."""
        return self.experience.advantages
