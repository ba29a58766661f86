"""On-policy distillation: the student samples, a frozen teacher scores the same tokens, and the per-token reverse KL
is the advantage.

Thinking Machines (Lu et al. 2025, "On-Policy Distillation"; the Qwen3 report, arXiv:2505.09388 sec. 4.5, and
Agarwal et al. 2024, GKD, arXiv:2306.13649, use the same on-policy reverse KL): for a completion ``y`` sampled from
the student ``pi``, the per-token estimate of KL(pi || pi_teacher) at token ``t`` is
``k_t = log pi(y_t) - log pi_teacher(y_t)``, and the student is trained with the policy gradient of the per-token
advantage ``A_t = -lambda * k_t`` (discount 0: each token is pushed by its own term only). Its gradient,
``-sum_t A_t grad log pi(y_t) = lambda * sum_t k_t grad log pi(y_t)``, is the REINFORCE gradient of the reverse KL
(the ``E[grad log pi]`` term vanishes in expectation). Mixed with rewards (slime ``--opd-kl-coef``, NeMo-RL's
MOPD): ``A_t = w * A_i - lambda * k_t`` with ``A_i`` the group advantage of the sequence.

``log pi`` is the student's behaviour logprob, the one the PPO ratio's old policy uses (the detached current
logprobs on a rollout's first update, the recomputed old ones later, the sampler's in bypass mode, which is
Thinking Machines' ``sampled_logprobs``), so the advantage is fixed for a rollout and a token's weight does not
depend on how the step is split into micro-batches.
"""

from __future__ import annotations

import torch
from torch import Tensor


def reverse_kl(student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor) -> Tensor:
    """Per-token ``k_t = log pi(y_t) - log pi_teacher(y_t)`` on the loss tokens (0 elsewhere; masked positions may
    hold anything, NaN included), float32 without grad: the k1 estimate of KL(pi || pi_teacher) from the student's
    own samples.

    Args:
        student_logprobs: ``(N, T)`` float student (behaviour) logprobs of the sampled tokens.
        teacher_logprobs: ``(N, T)`` float teacher logprobs of the same tokens, each given the same prefix.
        mask: ``(N, T)`` 0/1 loss mask.

    Example (golden): student [[-1.0, -0.5]], teacher [[-2.0, -0.25]] -> [[1.0, -0.25]] (sum 0.75).
    """
    with torch.no_grad():
        diff = student_logprobs.detach().float() - teacher_logprobs.float()
        return torch.where(mask.bool(), diff, 0.0)


def distillation_advantages(advantages: Tensor, student_logprobs: Tensor, teacher_logprobs: Tensor, mask: Tensor,
                            coef: float, reward_weight: float) -> Tensor:
    """Per-token advantages ``A_t = reward_weight * A_i - coef * (log pi(y_t) - log pi_teacher(y_t))``.

    Args:
        advantages: ``(N,)`` float group advantages of the sequences (from the rewards).
        student_logprobs: ``(N, T)`` float student (behaviour) logprobs.
        teacher_logprobs: ``(N, T)`` float teacher logprobs.
        mask: ``(N, T)`` 0/1 loss mask.
        coef: lambda (> 0; ``GRPOConfig.distillation.coef``).
        reward_weight: w (>= 0; 0 = distillation alone).

    Returns:
        ``(N, T)`` float32 advantages without grad, 0 on masked positions.

    Raises:
        ValueError: shapes disagree, or a loss token has a non-finite teacher logprob.

    Example (golden): A = [2.0], student [[-1.0, -0.5]], teacher [[-2.0, -0.25]], coef 1, weight 0.5 ->
    [[1.0 - 1.0, 1.0 + 0.25]] = [[0.0, 1.25]].
    """
    if student_logprobs.shape != teacher_logprobs.shape or student_logprobs.shape != mask.shape:
        raise ValueError(f"student {tuple(student_logprobs.shape)}, teacher {tuple(teacher_logprobs.shape)} and mask "
                         f"{tuple(mask.shape)} logprobs must have the same (N, T) shape")
    mask = mask.bool()
    if not torch.isfinite(teacher_logprobs[mask]).all():
        bad = (mask & ~torch.isfinite(teacher_logprobs)).nonzero()[0].tolist()
        raise ValueError(f"the teacher's logprob of loss token (row, position) {tuple(bad)} is not finite: the "
                         "teacher gives the sampled token probability 0 (a different vocabulary or tokenizer?)")
    with torch.no_grad():
        kl = reverse_kl(student_logprobs, teacher_logprobs, mask)
        total = reward_weight * advantages.float().unsqueeze(1) - coef * kl
        return torch.where(mask, total, 0.0)
