"""The single-turn sampler: one ``engine.generate`` call per rollout (a
:class:`~lightning_grpo.protocols.sampler.Sampler`; the multi-turn one is
:class:`~lightning_grpo.episodes.turn_loop.EpisodeRunner`)."""

from __future__ import annotations

from typing import Optional

from lightning_grpo.protocols.engine import RolloutEngine, generate
from lightning_grpo.protocols.rollout import RolloutOutput
from lightning_grpo.protocols.sampler import AnyProcess, EncodedPrompts
from lightning_grpo.protocols.sampling import SamplingConfig


class SingleTurnSampler:
    """G completions per prompt from one ``engine.generate``; the dataset rows and the processes' agreement are not
    needed (an engine's ``generate`` is one call on every process alike)."""

    def sample(self, engine: RolloutEngine, prompts: EncodedPrompts, num_generations: int, sampling: SamplingConfig,
               any_process: Optional[AnyProcess] = None) -> RolloutOutput:
        """``engine.generate(prompts.ids, num_generations, sampling)``, with each prompt's images when there are some
        (:func:`lightning_grpo.protocols.engine.generate`); raises as it (``RolloutInterrupted`` on a stop request;
        ``ValueError`` for images with an engine that does not take them)."""
        return generate(engine, prompts.ids, num_generations, sampling, prompts.images)
