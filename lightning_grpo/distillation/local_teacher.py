"""On-policy distillation's local teacher (``GRPOConfig.distillation.teacher``): :class:`ModelTeacher`, a frozen
causal LM on each training process, scored like the reference model
(:meth:`lightning_grpo.training.logprobs.CompletionLogprobs.batched`: the same forward layouts, the same sampling
distribution, the backend's scorer), sharded or converted like it by the backend (``GRPOModels.teacher``); and
:func:`load_teacher`, which loads it frozen after checking its tokenizer against the policy's.

It implements :class:`~lightning_grpo.protocols.teacher.Teacher`: ``(N, T)`` float32 logprobs of each completion token
given the prompt and the completion before it (the environment's tokens of multi-turn episodes included as context),
0 where the row has no loss. The served teachers are :mod:`lightning_grpo.distillation.served_teachers`.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Optional

from torch import Tensor, nn

from lightning_grpo.distillation.tokenizer_check import check_same_tokenizer
from lightning_grpo.models.embedded import resolve_model_path
from lightning_grpo.models.loading import DTYPES
from lightning_grpo.training.experience import Experience
from lightning_grpo.training.logprobs import CompletionLogprobs


class ModelTeacher:
    """A frozen teacher model held outside the LightningModule's module tree (never checkpointed or optimized);
    the backend may replace :attr:`model` with a sharded one (``GRPOModels.teacher``).

    Args:
        model: the teacher causal LM (eval mode, no gradients).
        logprobs: the module's completion-logprob computer (the reference model's layouts and distribution).
    """

    def __init__(self, model: nn.Module, logprobs: CompletionLogprobs) -> None:
        self.model: Optional[nn.Module] = model
        self.logprobs = logprobs

    def score(self, experience: Experience, micro_batch_size: int, forward_context: Callable[[], ContextManager],
              max_tokens: Optional[int] = None) -> Tensor:
        assert self.model is not None
        return self.logprobs.batched(self.model, experience, micro_batch_size, forward_context, max_tokens=max_tokens)


def load_teacher(name_or_path: str, student_tokenizer: Any, dtype: str = "float32") -> nn.Module:
    """The teacher causal LM at ``name_or_path`` (a folder, a hub id or "embedded"), in eval mode without gradients,
    in ``dtype``, after checking its tokenizer against ``student_tokenizer``.

    Raises:
        TokenizerMismatchError: the tokenizers differ (the first difference is named).
        ValueError, FileNotFoundError: as :func:`lightning_grpo.models.embedded.resolve_model_path`; an unknown
            ``dtype``.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: choose one of {sorted(DTYPES)}")
    path = resolve_model_path(name_or_path)
    check_same_tokenizer(student_tokenizer, AutoTokenizer.from_pretrained(path),
                         f"GRPOConfig.distillation.teacher={name_or_path!r}")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, DTYPES[dtype]))
    return model.eval().requires_grad_(False)
