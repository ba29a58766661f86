"""Rollouts with transformers' ``generate`` on the policy itself (sampling, left padding, KV cache)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase, StoppingCriteria

from lightning_grpo.rollout.base import (
    RolloutInterrupted,
    RolloutOutput,
    SamplingConfig,
    StopFlag,
    completion_mask_from_eos,
    eos_token_ids_from,
)


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every id that ends a completion: the model's ``generation_config.eos_token_id`` (an int or a list) and the
    tokenizer's ``eos_token_id``."""
    return eos_token_ids_from(getattr(model, "generation_config", None), tokenizer)


def left_pad(sequences: Sequence[Sequence[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token-id lists into ``(B, L)`` long ids and a ``(B, L)`` long attention mask."""
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if len(seq):
            ids[row, length - len(seq) :] = torch.as_tensor(list(seq), dtype=torch.long)
            mask[row, length - len(seq) :] = 1
    return ids.to(device), mask.to(device)


class HFRolloutEngine:
    """Generates with the policy module itself, so it always uses the current weights (``sync_weights`` is a
    no-op). The model is put in eval mode for the rollout and restored afterwards; no gradients are kept.

    Sampling draws from ``softmax(logits / temperature)`` with top-p/top-k as configured and no other logits
    processing (repetition penalties etc. of the model's own generation_config are not applied), so the trainer's
    logprobs describe exactly the sampled distribution when top_p == 1 and top_k == 0.
    """

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                 stop: Optional[StopFlag] = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.stop = stop if stop is not None else StopFlag()  # polled at every generated token
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        self.pad_token_id = int(pad)

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Nothing to do: generation runs on the trained module."""

    def wake_up(self) -> None:
        """Nothing to do: the engine is the policy itself."""

    def sleep(self, level: int = 1) -> None:
        """Nothing to do: the engine holds no memory of its own between rollouts."""

    def close(self) -> None:
        """Nothing to release."""

    @torch.no_grad()
    def generate(
        self, prompt_ids: Sequence[Sequence[int]], num_generations: int, sampling: SamplingConfig
    ) -> RolloutOutput:
        """See :class:`lightning_grpo.rollout.base.RolloutEngine`.

        Raises:
            RolloutInterrupted: :attr:`stop` was set before or during generation (polled at every token).
        """
        self.stop.check()
        device = next(self.model.parameters()).device
        ids, mask = left_pad(prompt_ids, self.pad_token_id, device)
        config = GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            do_sample=not sampling.greedy,
            temperature=None if sampling.greedy else sampling.temperature,
            top_p=None if sampling.greedy else sampling.top_p,
            top_k=None if sampling.greedy else sampling.top_k,
            num_return_sequences=1 if sampling.greedy else num_generations,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            use_cache=True,
        )
        was_training = self.model.training
        self.model.eval()
        stop = _StopCriterion(self.stop)
        try:
            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                                      stopping_criteria=[stop])
        finally:
            self.model.train(was_training)
        if stop.fired:
            raise RolloutInterrupted("the HF rollout was stopped by a stop request (e.g. SIGTERM) before it finished")
        if sampling.greedy:  # every greedy completion of a prompt is the same: decode once, repeat
            out = out.repeat_interleave(num_generations, dim=0)
        completion_ids = out[:, ids.shape[1] :]  # [N, T]
        if completion_ids.shape[1] == 0:
            completion_ids = torch.full((out.shape[0], 1), self.pad_token_id, dtype=torch.long, device=device)
        completion_mask, truncated = completion_mask_from_eos(completion_ids, self.eos_token_ids)
        texts = self.tokenizer.batch_decode(
            (completion_ids * completion_mask + self.pad_token_id * (1 - completion_mask)).tolist(),
            skip_special_tokens=True,
        )
        return RolloutOutput(
            prompt_ids=ids.repeat_interleave(num_generations, dim=0),
            prompt_mask=mask.repeat_interleave(num_generations, dim=0),
            completion_ids=completion_ids,
            completion_mask=completion_mask,
            truncated=truncated,
            completions=texts,
        )


class _StopCriterion(StoppingCriteria):
    """Ends ``generate`` for every row once ``flag`` is set (checked at every token). It stops rather than raises,
    so that with ``synced_gpus`` (FSDP1) this rank keeps taking part in the other ranks' forward passes until they
    stop too; :meth:`HFRolloutEngine.generate` then raises."""

    def __init__(self, flag: StopFlag) -> None:
        self.flag = flag
        self.fired = False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
        self.fired = self.fired or self.flag.is_set()
        return torch.full((input_ids.shape[0],), self.fired, dtype=torch.bool, device=input_ids.device)
