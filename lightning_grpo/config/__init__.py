"""The run's settings: :class:`GRPOConfig` (every knob of the algorithm, :mod:`lightning_grpo.config.grpo`) with its
nested groups (:class:`EngineConfig`, :class:`EvalConfig`, :class:`EpisodeConfig`, :mod:`lightning_grpo.config.groups`;
:class:`CorrectionConfig`, :mod:`lightning_grpo.config.correction`; :class:`DistillationConfig`,
:mod:`lightning_grpo.config.distillation`; :class:`StreamingConfig`, :mod:`lightning_grpo.config.streaming`), each
validated on construction and never changed by a run; and :class:`ResolvedConfig`, what a run made of the "auto"
values (:mod:`lightning_grpo.config.resolved`)."""

from lightning_grpo.config.correction import CorrectionConfig
from lightning_grpo.config.distillation import DistillationConfig
from lightning_grpo.config.groups import EngineConfig, EpisodeConfig, EvalConfig, parse_server_url
from lightning_grpo.config.grpo import ASYNC_IMPORTANCE_SAMPLING_CAP, GRPOConfig
from lightning_grpo.config.resolved import ResolvedConfig
from lightning_grpo.config.streaming import StreamingConfig

__all__ = ["ASYNC_IMPORTANCE_SAMPLING_CAP", "CorrectionConfig", "DistillationConfig", "EngineConfig", "EpisodeConfig",
           "EvalConfig", "GRPOConfig", "ResolvedConfig", "StreamingConfig", "parse_server_url"]
