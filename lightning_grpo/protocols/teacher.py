"""On-policy distillation's teacher seam: :class:`Teacher`, what a rollout's logprob passes (``LogprobPasses``)
call to score its completion tokens.

The implementations are :mod:`lightning_grpo.distillation` (a frozen local model, a rollout server, an
OpenAI-compatible server). The protocol is generic in the rollout record it scores (``Teacher[Experience]``, the
trainer's :class:`~lightning_grpo.training.experience.Experience`), so that this leaf imports nothing above it.
"""

from __future__ import annotations

from typing import Callable, ContextManager, Optional, Protocol, TypeVar

from torch import Tensor, nn

#: The rollout record a teacher scores (the trainer's ``Experience``).
ExperienceT = TypeVar("ExperienceT", contravariant=True)


class Teacher(Protocol[ExperienceT]):
    """Scores a rollout's completion tokens (the seam ``LogprobPasses`` calls).

    Attributes:
        model: the teacher model this process runs (``GRPOModule`` hands it to the backend as ``GRPOModels.teacher``
            and sets the sharded or converted one it gets back), or None for a served teacher.
    """

    model: Optional[nn.Module]

    def score(self, experience: ExperienceT, micro_batch_size: int, forward_context: Callable[[], ContextManager],
              max_tokens: Optional[int] = None) -> Tensor:
        """``(N, T)`` float32 teacher logprobs of ``experience``'s completion tokens (0 on rows without loss tokens),
        on the experience's device; a model scores ``micro_batch_size`` sequences (or ``max_tokens`` tokens) per
        forward pass inside ``forward_context()``. A collective for a sharded teacher model (every process calls
        it)."""
        ...
