"""A copy of a checkpoint whose ``generation_config.json`` sets every logits-processing field transformers and vLLM
read, for tests that a checkpoint's generation settings never change a rollout; and the trainer's logprobs of a
rollout on a teacher-forced forward, to compare with an engine's sampler logprobs."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import GenerationConfig

from lightning_grpo import functional as F

#: Fields that change sampling only (do_sample=True): transformers' warpers and vLLM's default sampling params.
SAMPLING_FIELDS = dict(
    do_sample=True, temperature=0.3, top_k=5, top_p=0.5, min_p=0.2, typical_p=0.5, epsilon_cutoff=0.01,
    eta_cutoff=0.01, max_new_tokens=3,
)


def greedy_fields(tokens: list[int], eos: int) -> dict:
    """Fields that change greedy decoding too, aimed at ``tokens`` (a clean greedy completion of >= 12 tokens): each
    forbids, penalizes or forces one of its tokens."""
    return dict(
        repetition_penalty=1.3,  # the tests' prompt starts with tokens[0]: penalized at the first step
        no_repeat_ngram_size=1,
        bad_words_ids=[[tokens[2]]],
        suppress_tokens=[tokens[3]],
        begin_suppress_tokens=[tokens[0]],
        sequence_bias=[[[tokens[4]], -100.0]],
        forced_eos_token_id=eos,
        exponential_decay_length_penalty=(1, 50.0),
    )


def copy_with_generation_config(src: str, dest: Path, **fields) -> str:
    """Copy the checkpoint folder ``src`` to ``dest`` with ``fields`` set in its ``generation_config.json``."""
    shutil.copytree(src, dest)
    config = GenerationConfig.from_pretrained(src)
    config.update(**fields)
    config.save_pretrained(str(dest))
    return str(dest)


@torch.no_grad()
def trainer_logprobs(model, out, temperature: float, **truncation) -> torch.Tensor:
    """``(N, T)`` :func:`functional.token_logprobs` of ``out.completion_ids`` on a teacher-forced HF forward of
    each row (no padding), 0 where masked."""
    result = torch.zeros(out.completion_ids.shape, dtype=torch.float32)
    for row in range(out.completion_ids.shape[0]):
        prompt = out.prompt_ids[row][out.prompt_mask[row].bool()]
        length = int(out.completion_mask[row].sum())
        completion = out.completion_ids[row, :length]
        logits = model(torch.cat([prompt, completion])[None]).logits[:, len(prompt) - 1 : -1]
        result[row, :length] = F.token_logprobs(logits, completion[None], temperature, **truncation)[0][0]
    return result
