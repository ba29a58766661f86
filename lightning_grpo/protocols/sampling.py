"""The sampling distribution of a rollout: :class:`SamplingConfig` (what a rollout asks an engine for) and the
distribution as logits (temperature, then min-p, top-k and top-p truncation, vLLM's order), the behaviour policy that
both engines sample from and the trainer scores (docs/algorithm.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor


def sampling_errors(temperature: Optional[float], top_p: float, top_k: int,
                    min_p: float) -> list[tuple[str, float, str]]:
    """The sampling settings out of range, as ``(name, value, requirement)``: the one place that says which values
    the sampling distribution takes (``GRPOConfig``, :class:`SamplingConfig` and the
    logprob functions format the error). ``temperature`` None: not checked (greedy decoding)."""
    errors = []
    if temperature is not None and not temperature > 0:
        errors.append(("temperature", temperature, "must be > 0 (use greedy evaluation for argmax decoding)"))
    if not 0 < top_p <= 1:
        errors.append(("top_p", top_p, "must be in (0, 1]"))
    if top_k < 0:
        errors.append(("top_k", top_k, "must be >= 0 (0 disables top-k)"))
    if not 0 <= min_p <= 1:
        errors.append(("min_p", min_p, "must be in [0, 1] (0 disables min-p)"))
    return errors


def check_truncation(top_k: int, top_p: float, min_p: float) -> None:
    """Raise ValueError naming the first truncation setting out of range (:func:`sampling_errors`)."""
    for name, value, requirement in sampling_errors(None, top_p, top_k, min_p):
        raise ValueError(f"{name}={value!r} is invalid: {requirement}")


def sampling_removed(logits: Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
                     banned_token_ids: Sequence[int] = ()) -> Optional[Tensor]:
    """Which tokens the rollout engines' truncation removes, given tempered logits (``logits / temperature``).

    Applied in vLLM's order (``vllm/v1/sample/sampler.py``: banned tokens (its "bad words", before temperature), then
    temperature, then min-p, then top-k, then top-p, each on what the previous one kept; transformers' warpers define
    each step the same way, ties at the k-th logit kept):

    * banned tokens (a vision-language model's image placeholders, :class:`SamplingConfig`): always removed;

    * min-p (Nguyen et al. 2024, arXiv:2407.01082): remove ``p_i < min_p * max_j p_j``;
    * top-k: remove ``z_i <`` the k-th largest logit;
    * top-p (Holtzman et al. 2020, nucleus sampling): sort the kept probabilities ascending, remove the tokens whose
      cumulative probability is ``<= 1 - top_p``; the most likely token is always kept.

    Args:
        logits: ``(..., V)`` float tempered logits (no gradient is taken through the mask).
        top_k: keep the k most likely tokens; 0 (or >= V) disables it.
        top_p: nucleus mass in (0, 1]; 1 disables it.
        min_p: in [0, 1]; 0 disables it.
        banned_token_ids: token ids always removed (in ``[0, V)``).

    Returns:
        ``(..., V)`` bool, True where the token is removed; None when nothing truncates (every setting disabled).

    Raises:
        ValueError: a banned id outside the vocabulary.
    """
    vocab = logits.shape[-1]
    if not (0 < top_k < vocab or top_p < 1.0 or min_p > 0.0 or banned_token_ids):
        return None
    with torch.no_grad():
        z = logits.detach().float()
        removed = torch.zeros_like(z, dtype=torch.bool)
        if banned_token_ids:
            banned = torch.as_tensor(list(banned_token_ids), dtype=torch.long, device=z.device)
            if int(banned.min()) < 0 or int(banned.max()) >= vocab:
                raise ValueError(f"banned_token_ids {sorted(banned_token_ids)} must lie in the vocabulary [0, {vocab})")
            removed[..., banned] = True
        if min_p > 0.0:
            probs = torch.softmax(z.masked_fill(removed, float("-inf")), dim=-1)
            removed |= probs < probs.amax(dim=-1, keepdim=True) * min_p
        if 0 < top_k < vocab:
            masked = z.masked_fill(removed, float("-inf"))
            removed |= masked < masked.topk(top_k, dim=-1).values[..., -1:]
        if top_p < 1.0:
            ascending, order = z.masked_fill(removed, float("-inf")).sort(dim=-1)
            drop = torch.softmax(ascending, dim=-1).cumsum(dim=-1) <= 1.0 - top_p
            drop[..., -1] = False  # the most likely token always stays
            removed |= torch.zeros_like(removed).scatter(-1, order, drop)
    return removed


def sampling_logits(
    logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
    banned_token_ids: Sequence[int] = (),
) -> Tensor:
    """The logits of the distribution the rollout engines sample from: ``logits / temperature`` in float32 with the
    tokens that min-p / top-k / top-p remove (:func:`sampling_removed`) set to ``-inf``; ``softmax`` of the result is
    that distribution, renormalized over the kept tokens. The HF engine samples from exactly this.

    Args:
        logits: ``(..., V)`` float logits (any float dtype).
        temperature: > 0.
        top_k, top_p, min_p, banned_token_ids: see :func:`sampling_removed`.

    Returns:
        ``(..., V)`` float32.

    Raises:
        ValueError: temperature <= 0, top_k < 0, top_p not in (0, 1] or min_p not in [0, 1].
    """
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    check_truncation(top_k, top_p, min_p)
    z = logits.float() / temperature
    removed = sampling_removed(z, top_k, top_p, min_p, banned_token_ids)
    return z if removed is None else z.masked_fill(removed, float("-inf"))


@dataclass(frozen=True)
class SamplingConfig:
    """How completions are sampled: the *only* settings that shape the sampled distribution. A checkpoint's
    ``generation_config.json`` (repetition penalty, no-repeat n-grams, bad words, its own temperature / top-k /
    top-p / min-p, ...) never changes a rollout; repetition, frequency and presence penalties are not supported.

    Unless ``greedy``, every engine samples from :func:`sampling_logits` of the policy's
    logits: ``logits / temperature``, then min-p, top-k and top-p (vLLM's order), renormalized over the kept
    tokens. The trainer's logprobs (:func:`lightning_grpo.functional.token_logprobs` with the same four values)
    score exactly that distribution.

    Attributes:
        max_new_tokens: most tokens generated per completion (>= 1).
        temperature: softmax temperature (> 0); ignored when ``greedy``.
        top_p: nucleus mass in (0, 1]; 1.0 disables it.
        top_k: keep the k most likely tokens (>= 0); 0 disables it.
        min_p: keep the tokens whose probability is at least ``min_p`` times the largest one, in [0, 1]; 0
            disables it.
        greedy: argmax decoding (evaluation); sampler logprobs are then those of ``log_softmax(logits)`` (over the
            tokens not banned).
        seed: base of per-request seeds (completion ``j`` of prompt ``i`` gets ``seed + i * G + j``, G completions
            per prompt) for engines whose sampling can be seeded per request (vLLM, colocated or on a rollout
            server, GPU and CPU), so a resumed run regenerates the same rollouts; None = the engine's own
            generator. The HF engine, which samples from torch's global generator, ignores it.
        banned_token_ids: tokens never sampled, greedy included: removed from the distribution before temperature
            and truncation (vLLM's bad words; a vision-language model's image placeholders, whose sampling breaks
            the image/feature alignment, verl PR #7038). The trainer removes them too, so the ratio stays exact.

    Raises:
        ValueError: a field out of range (named in the message).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    greedy: bool = False
    seed: Optional[int] = None
    banned_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens={self.max_new_tokens!r} is invalid: must be >= 1")
        temperature = None if self.greedy else self.temperature
        for name, value, requirement in sampling_errors(temperature, self.top_p, self.top_k, self.min_p):
            raise ValueError(f"sampling.{name}={value!r} is invalid: {requirement}")
        if any(int(t) < 0 for t in self.banned_token_ids):
            raise ValueError(f"sampling.banned_token_ids={self.banned_token_ids!r} is invalid: token ids are >= 0")
