"""The GRPO algorithm as pure torch functions: advantages, policy loss, KL, aggregation, logprobs.

No Lightning in here. Shapes: ``N`` sequences (prompt-major: the G completions of prompt i are rows
``i*G .. i*G+G-1``), ``T`` completion tokens. All masks are 0/1 (or bool) tensors of shape ``(N, T)``;
values at masked positions never influence any result (they may hold NaN or 1e9).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor

from lightning_grpo.protocols.sampling import check_truncation, sampling_logits, sampling_removed  # noqa: F401 (API)

LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to +-20 before any ``exp``: exp(20) = 4.9e8 is finite in float32 and bfloat16."""


def group_advantages(  # noqa: C901 - argument checks, then one formula per estimator
    rewards: Tensor,
    num_generations: int,
    scale_rewards: str = "group",
    eps: float = 1e-4,
    *,
    estimator: str = "grpo",
    std_floor: float = 0.0,
    valid: Optional[Tensor] = None,
    batch_std: Optional[float] = None,
) -> Tensor:
    """Group-relative advantages (DeepSeekMath eq. 3, outcome supervision; RLOO; Dr. GRPO sec. 3.1 for "none").

    With ``r`` the valid rewards of a group of ``k`` (= G unless some are missing) completions:

    * ``estimator="grpo"``: ``c_i = r_i - mean(r)`` (DeepSeekMath eq. 3).
    * ``estimator="rloo"``: ``c_i = r_i - mean_{j != i}(r_j) = k / (k - 1) * (r_i - mean(r))``, the leave-one-out
      baseline (Kool et al. 2019; Ahmadian et al. 2024, "Back to Basics", arXiv:2402.14740, eq. 6). With
      ``scale_rewards="none"`` this is verl's ``adv_estimator=rloo``; with "group" it is the GRPO advantage times
      ``k / (k - 1)``.

    Then ``A_i = c_i / (max(std, std_floor) + eps)`` with the unbiased std of the group ("group", as TRL, verl and
    AReaL) or of all valid rewards of the batch ("batch"), or ``A_i = c_i`` ("none", Dr. GRPO).

    A group whose valid rewards are all equal, or that has fewer than two valid rewards, gets exactly 0 (no
    float noise is ever divided by a near-zero std). ``std_floor`` bounds the denominator from below: a group whose
    rewards differ only by float32 rounding (std ~ 1e-8) then gets advantages of the size of that difference over
    the floor instead of being promoted to +-1 (see docs/algorithm.md). Means and stds are computed in float64, so
    float32 rewards of any finite size are normalized (in float32 a spread of ~2e19 overflows the squared deviations).

    Args:
        rewards: ``(num_prompts * G,)`` float rewards in prompt-major order.
        num_generations: G, the group size (>= 2).
        scale_rewards: "group", "batch" or "none" (see above).
        eps: added to the (floored) std.
        estimator: "grpo" or "rloo".
        std_floor: lower bound (>= 0) of the std a group is divided by.
        valid: ``(num_prompts * G,)`` bool; False marks a missing reward (e.g. every reward function returned
            None). Missing rewards may be NaN; they are left out of every mean and std and get advantage 0.
            None: every reward is valid.
        batch_std: the std to use for ``scale_rewards="batch"`` instead of this batch's own (the std over all
            data-parallel processes).

    Returns:
        ``(num_prompts * G,)`` float32 advantages, finite.

    Raises:
        ValueError: if ``rewards`` is not 1-D, its length is not a multiple of G, G < 2, a valid reward is NaN/inf,
            ``valid`` has another shape, ``std_floor < 0``, or ``scale_rewards`` / ``estimator`` is unknown; or
            rewards too large to normalize (a std, mean or advantage that is not finite in float64 / float32, e.g.
            float64 rewards of 1e200; the group and its rewards are named).
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (num_prompts * G,), got shape {tuple(rewards.shape)}")
    if num_generations < 2:
        raise ValueError(f"num_generations={num_generations}: group advantages need G >= 2")
    if rewards.numel() % num_generations != 0:
        raise ValueError(f"rewards has {rewards.numel()} entries, not a multiple of num_generations={num_generations}")
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"scale_rewards={scale_rewards!r}: choose group, batch or none")
    if estimator not in ("grpo", "rloo"):
        raise ValueError(f"advantage estimator={estimator!r}: choose grpo or rloo")
    if std_floor < 0:
        raise ValueError(f"std_floor={std_floor} must be >= 0")
    if valid is None:
        valid = torch.ones_like(rewards, dtype=torch.bool)
    if valid.shape != rewards.shape:
        raise ValueError(f"valid {tuple(valid.shape)} must have the shape of rewards {tuple(rewards.shape)}")
    valid = valid.bool()
    if not torch.isfinite(rewards[valid]).all():
        raise ValueError(f"rewards must be finite where valid, got {rewards.tolist()}")
    # float64 statistics: in float32 the squared deviations overflow from a reward spread of ~2e19 on (3.4e38 is
    # the largest float32), the std becomes inf and every advantage of the group a silent 0
    grouped = torch.where(valid, rewards.double(), 0.0).view(-1, num_generations)  # [P, G] float64
    member = valid.view(-1, num_generations)  # [P, G]
    count = member.sum(dim=1, keepdim=True).double()  # [P, 1]
    mean = grouped.sum(dim=1, keepdim=True) / count.clamp(min=1)  # [P, 1]
    centered = torch.where(member, grouped - mean, 0.0)  # [P, G]
    std = (centered.square().sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()  # [P, 1] unbiased
    highest = torch.where(member, grouped, -torch.inf).amax(dim=1, keepdim=True)
    lowest = torch.where(member, grouped, torch.inf).amin(dim=1, keepdim=True)
    constant = (count < 2) | (highest == lowest)  # [P, 1]
    if estimator == "rloo":
        centered = centered * count / (count - 1).clamp(min=1)
    if scale_rewards == "group":
        _check_normalizable(rewards, num_generations, ~constant & ~torch.isfinite(std), "group std")
        advantages = centered / (std.clamp(min=std_floor) + eps)
    elif scale_rewards == "batch":
        if batch_std is None:
            batch_std = float(rewards[valid].double().std()) if int(valid.sum()) > 1 else 0.0
        if not math.isfinite(batch_std):
            raise ValueError(f"rewards are too large to normalize: the batch std is {batch_std}")
        advantages = centered / (max(batch_std, std_floor) + eps)
    else:
        advantages = centered
    advantages = torch.where(constant | ~member, torch.zeros_like(advantages), advantages).float()  # [P, G] float32
    _check_normalizable(rewards, num_generations, ~torch.isfinite(advantages).all(dim=1, keepdim=True), "advantage")
    return advantages.reshape(-1)  # [N]


def _check_normalizable(rewards: Tensor, num_generations: int, overflow: Tensor, what: str) -> None:
    """Raise ValueError naming the first group (``overflow``: ``(P, 1)`` bool) whose ``what`` is not finite."""
    if bool(overflow.any()):
        group = int(overflow.reshape(-1).nonzero()[0])
        values = rewards[group * num_generations:(group + 1) * num_generations].tolist()
        raise ValueError(
            f"rewards of group {group} are too large to normalize: {values} (the {what} is not finite in "
            f"float64 / float32)"
        )


@dataclass
class ClipStats:
    """Which tokens the clipped objective clipped, as ``(N, T)`` bool masks (TRL's ``clip_ratio/*``).

    Attributes:
        low: ratio < 1 - epsilon_low with A < 0 (the clip is active and the gradient is zero).
        high: ratio > 1 + epsilon_high with A > 0.
        dual: the dual-clip bound ``clip_ratio_c`` was active (A < 0).
        ratio: ``(N, T)`` float ``pi / pi_old`` per token (after the +-20 log clamp), without grad.
    """

    low: Tensor
    high: Tensor
    dual: Tensor
    ratio: Optional[Tensor] = None

    @property
    def region(self) -> Tensor:
        return self.low | self.high


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    clip_ratio_c: Optional[float] = None,
    delta: Optional[float] = None,
) -> tuple[Tensor, ClipStats]:
    """Per-token clipped surrogate loss (PPO eq. 7; DAPO eq. 10 clip-higher; dual clip; INTELLECT-2 delta).

    ``ratio = exp(logp - old_logp)``;
    ``loss = max(-min(ratio, delta) * A, -clip(ratio, 1 - eps_low, 1 + eps_high) * A)``;
    with ``clip_ratio_c`` and A < 0: ``loss = min(loss, -clip_ratio_c * A)``.

    Args:
        logprobs: ``(N, T)`` float logprobs of the sampled tokens under the current policy (requires grad).
        old_logprobs: ``(N, T)`` float logprobs under the behaviour policy that sampled them (no grad).
        advantages: ``(N,)`` or ``(N, T)`` float advantages.
        epsilon_low, epsilon_high: clip range around 1.
        clip_ratio_c: dual-clip bound (> 1) or None.
        delta: cap on the unclipped ratio or None.

    Returns:
        ``(loss, stats)``: ``(N, T)`` float per-token loss (to be masked and aggregated by
        :func:`aggregate_loss`) and the :class:`ClipStats`.

    Example (golden): ratio 1.5, A=+1, eps_high 0.28 -> -1.28; ratio 0.5, A=-1, eps_low 0.2 -> 0.8;
    ratio 5, A=-1, c=3 -> 3.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)  # [N, 1]
    log_ratio = (logprobs - old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [N, T]
    ratio = torch.exp(log_ratio)  # [N, T]
    capped = ratio if delta is None else ratio.clamp(max=delta)
    unclipped = -capped * advantages  # [N, T]
    clipped = -ratio.clamp(1 - epsilon_low, 1 + epsilon_high) * advantages  # [N, T]
    loss = torch.maximum(unclipped, clipped)  # [N, T]
    negative = advantages < 0
    dual = torch.zeros_like(loss, dtype=torch.bool)
    if clip_ratio_c is not None:
        bound = -clip_ratio_c * advantages
        dual = negative & (loss > bound)
        loss = torch.where(negative, torch.minimum(loss, bound), loss)
    with torch.no_grad():
        stats = ClipStats(
            low=(ratio < 1 - epsilon_low) & negative,
            high=(ratio > 1 + epsilon_high) & (advantages > 0),
            dual=dual,
            ratio=ratio.detach(),
        )
    return loss, stats


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman 2020, "Approximating KL divergence").

    With ``x = ref_logp - logp`` (clamped to +-20 before any exp):
    k1 = -x; k2 = x**2 / 2; k3 = exp(x) - x - 1 (DeepSeekMath eq. 4, unbiased and >= 0).

    Args:
        logprobs: ``(N, T)`` float policy logprobs of the sampled tokens.
        ref_logprobs: ``(N, T)`` float reference-policy logprobs of the same tokens.
        estimator: "k1", "k2" or "k3".

    Returns:
        ``(N, T)`` float per-token KL estimates (finite, with finite gradient, for any finite input).

    Raises:
        ValueError: unknown estimator.

    Example (golden): logp=-1, ref=-2 -> k1 = 1, k2 = 0.5, k3 = exp(-1) = 0.3679.
    """
    x = (ref_logprobs - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)  # [N, T]
    if estimator == "k1":
        return -x
    if estimator == "k2":
        return 0.5 * x.square()
    if estimator == "k3":
        return torch.exp(x) - x - 1
    raise ValueError(f"kl estimator {estimator!r}: choose k1, k2 or k3")


def loss_normalizer(mask: Tensor, loss_type: str, max_new_tokens: Optional[int] = None) -> float:
    """The denominator that ``loss_type`` divides the summed loss by, for one batch.

    "grpo": number of sequences with at least one loss token (each contributes its token mean; DeepSeekMath
    eq. 3). A completion whose mask is all zero (a truncated completion under ``mask_truncated_completions``, or one
    no reward function could score) is left out of the mean; TRL keeps it in the denominator as a zero.
    "bnpo" / "token_mean" / "dapo" / "cispo": number of unmasked tokens (DAPO eq. 12; MiniMax-M1 eq. 4 for
    "cispo", whose policy term is computed by :mod:`lightning_grpo.algorithm.cispo`). Here they all normalize by the
    tokens of the whole optimizer step (every micro-batch and process), so they coincide; TRL's "bnpo" normalizes
    per local micro-batch instead.
    "dr_grpo": sequences * max_new_tokens, a constant (Dr. GRPO sec. 3.1); every sequence counts, masked or not.

    For an optimizer step split into micro-batches or over processes, sum this over every part and pass the
    total as ``normalizer`` to :func:`aggregate_loss`: the step's gradient then does not depend on the split.

    Raises:
        ValueError: unknown loss_type, or "dr_grpo" without ``max_new_tokens``.
    """
    if loss_type == "grpo":
        return float(mask.bool().any(dim=1).sum().item())
    if loss_type in ("bnpo", "token_mean", "dapo", "cispo"):
        return float(mask.sum().item())
    if loss_type == "dr_grpo":
        if max_new_tokens is None:
            raise ValueError("loss_type='dr_grpo' needs max_new_tokens")
        return float(mask.shape[0] * max_new_tokens)
    raise ValueError(f"loss_type={loss_type!r}: choose grpo, bnpo, token_mean, dapo, dr_grpo or cispo")


def aggregate_loss(
    values: Tensor,
    mask: Tensor,
    loss_type: str = "grpo",
    max_new_tokens: Optional[int] = None,
    normalizer: Optional[float] = None,
) -> Tensor:
    """Reduce per-token values ``(N, T)`` to a scalar as ``loss_type`` prescribes.

    "grpo": mean over each sequence's tokens, then mean over sequences (DeepSeekMath eq. 3).
    "bnpo" / "token_mean" / "dapo" / "cispo": sum over all tokens / number of tokens (DAPO eq. 12).
    "dr_grpo": sum over all tokens / (sequences * max_new_tokens) (Dr. GRPO sec. 3.1).

    Args:
        values: ``(N, T)`` float per-token values; masked entries are ignored even if NaN/inf.
        mask: ``(N, T)`` 0/1 or bool.
        loss_type: see above.
        max_new_tokens: needed for "dr_grpo".
        normalizer: the denominator to use instead of this batch's own (see :func:`loss_normalizer`).

    Returns:
        0-dim float tensor.

    Example (golden): x = [[2,2,2,2,2,6,5,3,2,4], [10,3,4,5,2,3,4,1,1,3]], mask = [[1]*5+[0]*5, [1]+[0]*9]:
    "token_mean" -> 20 / 6 = 3.333; "grpo" -> (2 + 10) / 2 = 6.0.
    """
    if values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} must have the same shape")
    mask = mask.bool()
    masked = torch.where(mask, values, torch.zeros_like(values))  # [N, T]
    denominator = normalizer if normalizer is not None else loss_normalizer(mask, loss_type, max_new_tokens)
    if loss_type == "grpo":
        per_sequence = masked.sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # [N]
        numerator = per_sequence.sum()
    else:
        numerator = masked.sum()
    return numerator / max(denominator, 1e-8)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` over ``mask`` (0 when the mask is empty); masked entries may be NaN."""
    mask = mask.bool()
    return torch.where(mask, values, torch.zeros_like(values)).sum() / mask.sum().clamp(min=1)


def token_logprobs(
    logits: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    *,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    banned_token_ids: Sequence[int] = (),
) -> tuple[Tensor, Optional[Tensor]]:
    """Log-probabilities of ``labels`` under the sampling distribution, chunked over tokens.

    The distribution is ``softmax(logits / temperature)`` renormalized over the tokens that min-p / top-k / top-p
    keep (:func:`sampling_logits`; with the defaults nothing is removed): the distribution the rollout engines
    sample from (docs/algorithm.md, "Behaviour policy"). The label itself is always kept, so its logprob is finite
    even when this model's own truncation would remove it (a policy that moved after the rollout, or the reference
    model); for a token sampled from these logits it changes nothing.

    At most ``chunk_size`` rows of the vocabulary are converted to float32 at a time, so the peak extra memory
    is ``chunk_size * V * 4`` bytes instead of ``N * T * V * 4``. With top-p the vocabulary is also sorted; chunks
    are then 8 times smaller (peak about ``chunk_size * V * 3.5`` bytes).

    Args:
        logits: ``(N, T, V)`` float (any float dtype) next-token logits aligned with ``labels``.
        labels: ``(N, T)`` long token ids.
        temperature: the sampling temperature (> 0); the sampler drew from softmax(logits / T).
        chunk_size: tokens per chunk.
        with_entropy: also return the per-token entropy (nats) of that distribution.
        entropy_grad: the entropy keeps its graph (for an entropy bonus in the loss); default: computed without
            grad (for logging only).
        top_k, top_p, min_p: the sampling truncation (see :func:`sampling_removed`); pass the rollout's values
            (``GRPOConfig.top_k``, ``top_p``, ``min_p``) for every logprob of the policy, old policy and reference.
        banned_token_ids: tokens the engines never sample (a vision-language model's image placeholders,
            :class:`~lightning_grpo.protocols.sampling.SamplingConfig`), removed first.

    Returns:
        ``(logprobs, entropy)``: ``(N, T)`` float32 logprobs (differentiable), and ``(N, T)`` float32 entropy of
        the (truncated) distribution (differentiable when ``entropy_grad``) or None.

    Raises:
        ValueError: on shape mismatch, temperature <= 0, top_k < 0, top_p not in (0, 1] or min_p not in [0, 1].
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    check_truncation(top_k, top_p, min_p)
    flat_logits = logits.reshape(-1, logits.shape[-1])  # [N*T, V]
    flat_labels = labels.reshape(-1)  # [N*T]
    if top_p < 1.0:
        chunk_size = max(1, chunk_size // 8)
    logprob_chunks, entropy_chunks = [], []
    for start in range(0, flat_labels.numel(), chunk_size):
        z = flat_logits[start : start + chunk_size].float() / temperature  # [C, V]
        chunk_labels = flat_labels[start : start + chunk_size, None]  # [C, 1]
        removed = sampling_removed(z, top_k, top_p, min_p, banned_token_ids)  # [C, V] bool or None
        if removed is not None:
            removed.scatter_(1, chunk_labels, False)  # the label stays in the support
            z = z.masked_fill(removed, float("-inf"))
        lse = torch.logsumexp(z, dim=-1)  # [C]
        picked = z.gather(1, chunk_labels).squeeze(1)  # [C]
        logprob_chunks.append(picked - lse)
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                finite = z if removed is None else z.masked_fill(removed, 0.0)  # p = 0 there: no 0 * -inf
                entropy_chunks.append(lse - (torch.softmax(z, dim=-1) * finite).sum(-1))
    logprobs = torch.cat(logprob_chunks).view(labels.shape) if logprob_chunks else flat_logits.new_zeros(labels.shape)
    entropy = None
    if with_entropy:
        entropy = torch.cat(entropy_chunks).view(labels.shape) if entropy_chunks else logprobs.detach().clone()
    return logprobs.float(), entropy
