"""Completions as plain token-id rows and back: the pieces the colocated vLLM engine
(:mod:`lightning_grpo.rollout.engines.vllm.colocated`), the rollout server (:mod:`lightning_grpo.rollout.server.app`)
and its client (:mod:`lightning_grpo.rollout.server.remote`) share, so that a rollout is checked, seeded and
assembled the same way whether it was sampled in this process or on a server.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from lightning_grpo.protocols.rollout import RolloutOutput, completion_mask_from_eos, finish_rollout, left_pad
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.protocols.vision import RowImages
from lightning_grpo.rollout.engines.routed_rows import with_routed_experts


def check_prompts(prompt_ids: Sequence[Sequence[int]], num_generations: int, sampling: SamplingConfig,
                  max_model_len: int) -> list[list[int]]:
    """The prompts as lists of ints, checked: at least one, each non-empty and leaving room for
    ``sampling.max_new_tokens`` within ``max_model_len``; ``num_generations >= 1``.

    Raises:
        ValueError: naming the offending prompt index or argument.
    """
    if num_generations < 1:
        raise ValueError(f"num_generations must be >= 1, got {num_generations}")
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty: nothing to generate from")
    prompts = [[int(t) for t in p] for p in prompt_ids]
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt_ids[{i}] is empty")
        if len(p) + sampling.max_new_tokens > max_model_len:
            raise ValueError(
                f"prompt_ids[{i}] has {len(p)} tokens; with max_new_tokens={sampling.max_new_tokens} "
                f"that exceeds max_model_len={max_model_len}"
            )
    return prompts


def request_seeds(sampling: SamplingConfig, num_prompts: int, num_generations: int) -> Optional[list[int]]:
    """Per-request seeds ``sampling.seed + i * num_generations`` for prompts ``i < num_prompts``: vLLM seeds the
    ``j``-th completion of a request with ``seed + j``, so every completion of the batch gets its own seed
    ``sampling.seed + i * G + j``. None without a seed or for greedy decoding."""
    if sampling.seed is None or sampling.greedy:
        return None
    return [sampling.seed + i * num_generations for i in range(num_prompts)]


def rollout_from_rows(prompts: Sequence[Sequence[int]], rows: Sequence[Sequence[Any]],
                      num_generations: int, pad_token_id: int, eos_token_ids: Sequence[int], tokenizer: Any,
                      weight_version: Optional[int] = None, images: Sequence[RowImages] = ()) -> RolloutOutput:
    """A :class:`RolloutOutput` from ``B`` prompts and their ``B * G`` completions given as ``(ids, sampler
    logprobs)`` rows (prompt-major): prompts left-padded and repeated G times, completions right-padded with
    ``pad_token_id``, the mask up to and including the first EOS (:func:`completion_mask_from_eos`), logprobs 0
    where masked, texts decoded with ``tokenizer`` (special tokens skipped), each prompt's ``images`` (default none)
    with its G rows. Tensors on CPU. A row may carry a third element, its per-token fields by name: the routed experts
    (routing replay "R3", :func:`~lightning_grpo.rollout.engines.routed_rows.with_routed_experts`), on every row.

    Raises:
        ValueError: ``len(rows) != B * G`` or a row whose ids and logprobs differ in length.
    """
    if len(rows) != len(prompts) * num_generations:
        raise ValueError(f"{len(rows)} completions for {len(prompts)} prompts x {num_generations} generations")
    n, t = len(rows), max(1, max(len(row[0]) for row in rows))
    completion_ids = torch.full((n, t), pad_token_id, dtype=torch.long)
    sampler_logprobs = torch.zeros((n, t), dtype=torch.float32)
    for row, (ids, logprobs, *_) in enumerate(rows):
        if len(ids) != len(logprobs):
            raise ValueError(f"completion {row} has {len(ids)} token ids but {len(logprobs)} logprobs")
        completion_ids[row, : len(ids)] = torch.as_tensor(list(ids), dtype=torch.long)
        sampler_logprobs[row, : len(ids)] = torch.as_tensor(list(logprobs), dtype=torch.float32)
    completion_mask, truncated = completion_mask_from_eos(completion_ids, eos_token_ids)
    sampler_logprobs = sampler_logprobs * completion_mask
    ids_, mask = left_pad(prompts, pad_token_id, torch.device("cpu"))
    output = finish_rollout(ids_, mask, num_generations, completion_ids, completion_mask, truncated, sampler_logprobs,
                            tokenizer, pad_token_id, weight_version, images=images)
    fields = [row[2] for row in rows if len(row) > 2]
    if not fields:
        return output
    if len(fields) != n:
        raise ValueError(f"{len(fields)} of {n} completions carry per-token fields: all or none must")
    return with_routed_experts(output, fields)

