"""The single-turn sampler: one ``engine.generate`` call per rollout (a
:class:`~lightning_grpo.protocols.sampler.Sampler`; the multi-turn one is
:class:`~lightning_grpo.episodes.runner.EpisodeRunner`)."""

from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from lightning_grpo.protocols.engine import RolloutEngine
from lightning_grpo.protocols.images import RowImages
from lightning_grpo.protocols.multimodal import generate
from lightning_grpo.protocols.rollout import RolloutOutput
from lightning_grpo.protocols.sampler import AnyProcess
from lightning_grpo.protocols.sampling import SamplingConfig


class SingleTurnSampler:
    """G completions per prompt from one ``engine.generate``; the dataset rows and the processes' agreement are not
    needed (an engine's ``generate`` is one call on every process alike)."""

    def sample(self, engine: RolloutEngine, prompt_ids: Sequence[Sequence[int]], num_generations: int,
               sampling: SamplingConfig, rows: Sequence[Mapping[str, Any]],
               any_process: Optional[AnyProcess] = None,
               images: Optional[Sequence[Optional[RowImages]]] = None) -> RolloutOutput:
        """``engine.generate(prompt_ids, num_generations, sampling)`` (with ``images``, each prompt's, when there are
        some: :func:`lightning_grpo.protocols.multimodal.generate`); raises as it (``RolloutInterrupted`` on a stop
        request; ``ValueError`` for images with an engine that does not take them)."""
        return generate(engine, prompt_ids, num_generations, sampling, images)
