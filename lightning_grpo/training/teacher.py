"""On-policy distillation's teacher seam and its local model (``GRPOConfig.distillation.teacher``).

* :class:`Teacher`: what :class:`~lightning_grpo.experience.passes.LogprobPasses` calls to score a rollout's tokens;
* :class:`ModelTeacher`: a frozen causal LM on each training process, scored like the reference model
  (:meth:`lightning_grpo.training.logprobs.CompletionLogprobs.batched`: the same forward layouts, the same sampling
  distribution, the backend's scorer), sharded or converted like it by the backend (``GRPOModels.teacher``).

The served teachers (a rollout server, an OpenAI-compatible server) are :mod:`lightning_grpo.rollout.teacher`. Every
teacher returns ``(N, T)`` float32 logprobs of each completion token given the prompt and the completion before it
(the environment's tokens of multi-turn episodes included as context), 0 where the row has no loss.
"""

from __future__ import annotations

from typing import Callable, ContextManager, Optional, Protocol

from torch import Tensor, nn

from lightning_grpo.training.experience import Experience
from lightning_grpo.training.logprobs import CompletionLogprobs


class Teacher(Protocol):
    """Scores a rollout's completion tokens (the seam :class:`~lightning_grpo.experience.passes.LogprobPasses` calls).

    Attributes:
        model: the teacher model this process runs (``GRPOModule`` hands it to the backend as ``GRPOModels.teacher``
            and sets the sharded or converted one it gets back), or None for a served teacher.
    """

    model: Optional[nn.Module]

    def score(self, experience: Experience, micro_batch_size: int, forward_context: Callable[[], ContextManager],
              max_tokens: Optional[int] = None) -> Tensor:
        """``(N, T)`` float32 teacher logprobs of ``experience``'s completion tokens (0 on rows without loss tokens),
        on the experience's device; a model scores ``micro_batch_size`` sequences (or ``max_tokens`` tokens) per
        forward pass inside ``forward_context()``. A collective for a sharded teacher model (every process calls
        it)."""
        ...


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
