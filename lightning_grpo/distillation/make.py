"""The teacher of a run: :func:`make_teacher` picks one from ``GRPOConfig.distillation`` when ``GRPOModule`` is
made (a local model, :mod:`lightning_grpo.distillation.local_teacher`; a served one,
:mod:`lightning_grpo.distillation.served_teachers`)."""

from __future__ import annotations

from typing import Any, Optional

from lightning_grpo.config.distillation import DistillationConfig
from lightning_grpo.distillation.local_teacher import ModelTeacher, load_teacher
from lightning_grpo.distillation.served_teachers import OpenAITeacher, RolloutServerTeacher
from lightning_grpo.protocols.teacher import Teacher
from lightning_grpo.training.experience import Experience
from lightning_grpo.training.logprobs import CompletionLogprobs


def make_teacher(config: DistillationConfig, tokenizer: Any, dtype: str,
                 logprobs: CompletionLogprobs) -> Optional[Teacher[Experience]]:
    """The teacher ``config`` names (a local model is loaded now, its tokenizer checked), or None without one.

    Raises:
        TokenizerMismatchError: a local teacher's tokenizer differs from ``tokenizer``.
        ValueError: a teacher for a vision-language policy (``logprobs.vision``): a teacher scores token ids, and
            would score the image placeholder tokens without their pixels.
    """
    if logprobs.vision is not None and (config.teacher is not None or config.teacher_url is not None):
        raise ValueError("GRPOConfig.distillation with a vision-language policy is not supported: the teacher scores "
                         "token ids and would score the image placeholder tokens without their pixels")
    if config.teacher is not None:
        return ModelTeacher(load_teacher(config.teacher, tokenizer, dtype), logprobs)
    if config.teacher_url is None:
        return None
    if config.teacher_api == "openai":
        return OpenAITeacher(config, tokenizer)
    return RolloutServerTeacher(config, tokenizer)
