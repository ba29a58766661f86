"""The package's shared vocabulary: the records and protocols that the rollout, training, episodes and backends all
speak, and nothing else (this folder imports only torch and the standard library; every other folder may import it).

* :mod:`~lightning_grpo.protocols.sampling`: the sampling distribution and :class:`SamplingConfig`;
* :mod:`~lightning_grpo.protocols.rollout`: :class:`RolloutOutput` (and its per-row :class:`RowMetric`), its layout
  (:func:`left_pad`, :func:`completion_mask_from_eos`, :func:`eos_token_ids_from`), :class:`StopFlag`,
  :class:`RolloutInterrupted`;
* :mod:`~lightning_grpo.protocols.engine`: :class:`RolloutEngine`, :class:`CoreRolloutEngine`, what an engine is
  (:class:`EngineCapabilities`), :class:`EngineWrapper`, and the engine that takes images (``ImageRolloutEngine``);
* :mod:`~lightning_grpo.protocols.sampler`: :class:`Sampler` and :class:`PromptEncoder`, the rollout path a worker is
  given (a sampler takes one :class:`EncodedPrompts` record);
* :mod:`~lightning_grpo.protocols.episode`: :class:`EpisodeRecord` and :class:`Turn` (what an episode was: every
  rollout row has one, a single-turn row a one-turn episode);
* :mod:`~lightning_grpo.protocols.vision`: images in prompts (a checkpoint's image facts, ``PromptImage``, the
  placeholder rule);
* :mod:`~lightning_grpo.protocols.weights`: :class:`PolicyWeights`, what an engine is synced with;
* :mod:`~lightning_grpo.protocols.collectives`: :class:`Collectives` over the data-parallel processes;
* :mod:`~lightning_grpo.protocols.teacher`: :class:`Teacher`, what scores a rollout's tokens for on-policy
  distillation.
"""

from lightning_grpo.protocols.collectives import Collectives
from lightning_grpo.protocols.engine import CoreRolloutEngine, EngineCapabilities, EngineWrapper, RolloutEngine
from lightning_grpo.protocols.episode import EpisodeRecord, Turn
from lightning_grpo.protocols.rollout import (
    RolloutInterrupted,
    RolloutOutput,
    RowMetric,
    StopFlag,
    completion_mask_from_eos,
    eos_token_ids_from,
    left_pad,
)
from lightning_grpo.protocols.sampler import AnyProcess, EncodedPrompts, PromptEncoder, Sampler
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.protocols.teacher import Teacher
from lightning_grpo.protocols.weights import PolicyWeights

__all__ = [
    "AnyProcess",
    "Collectives",
    "CoreRolloutEngine",
    "EngineCapabilities",
    "EncodedPrompts",
    "EngineWrapper",
    "EpisodeRecord",
    "PolicyWeights",
    "PromptEncoder",
    "RolloutEngine",
    "RolloutInterrupted",
    "RolloutOutput",
    "RowMetric",
    "Sampler",
    "SamplingConfig",
    "StopFlag",
    "Teacher",
    "Turn",
    "completion_mask_from_eos",
    "eos_token_ids_from",
    "left_pad",
]
