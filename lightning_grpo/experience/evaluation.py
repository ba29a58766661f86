"""The evaluation rollouts of a validation or test batch: greedy completions and, with ``eval.num_samples``, sampled
ones, scored by the evaluated dataset's answer check (what :class:`lightning_grpo.evaluation.evaluator.Evaluator`
turns into accuracy, pass@k, maj@k and mean@k)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from lightning_grpo.config import GRPOConfig
from lightning_grpo.data.source import EVAL_INDEX
from lightning_grpo.evaluation.evaluator import EvalBatch, answer_key, counted_rows
from lightning_grpo.experience.collected import reward_columns
from lightning_grpo.protocols.collectives import Collectives
from lightning_grpo.protocols.rollout import RolloutOutput
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.rollout.worker import RolloutWorker, prompt_rows


@torch.no_grad()
def evaluate_batch(worker: RolloutWorker, config: GRPOConfig, batch: dict[str, list], policy: nn.Module,
                   accuracy: Callable[..., list], collectives: Collectives,
                   replica: tuple[int, int] = (0, 1)) -> EvalBatch:
    """Greedy completions of a validation batch and, with ``eval.num_samples`` = n, n sampled ones per prompt
    (temperature ``eval.temperature``, torch's generator forked and seeded with ``shuffle_seed``, so every
    evaluation draws alike and training's random stream is untouched), scored by ``accuracy`` (a reward function:
    1 for a right answer). The engine gets the current weights first (a forced sync). Tensors on ``collectives``'
    device. With the batch's dataset positions (``EVAL_INDEX``), the rows this process counts, each prompt once over
    the processes (:func:`~lightning_grpo.evaluation.evaluator.counted_rows`; ``replica``: this process's distributed
    sampler ``(rank, num_replicas)``, whose padding repeats prompts)."""
    cfg, device = config, collectives.device
    columns = {k: v for k, v in batch.items() if k not in ("prompt", EVAL_INDEX)}
    rows = prompt_rows(batch)

    def score(prompts: list, out: RolloutOutput, repeat: int) -> Tensor:
        cols = {k: [x for x in v for _ in range(repeat)] for k, v in columns.items()}
        values = accuracy(prompts, out.completions, **reward_columns(cols, out))
        return torch.tensor([float("nan") if s is None else float(s) for s in values], device=device)

    max_new = cfg.eval.max_new_tokens or cfg.max_new_tokens
    with worker.awake(policy, force_sync=True, collectives=collectives):
        greedy = SamplingConfig(max_new_tokens=max_new, greedy=True)
        out = worker.sample_prompts(batch["prompt"], 1, greedy, rows, collectives)
        result = EvalBatch(score(batch["prompt"], out, 1), out.completion_mask.sum(dim=1).to(device))
        n = cfg.eval.num_samples
        if n:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(cfg.shuffle_seed)
                sampling = SamplingConfig(max_new_tokens=max_new, temperature=cfg.eval.temperature)
                sampled = worker.sample_prompts(batch["prompt"], n, sampling, rows, collectives)
            prompts = [p for p in batch["prompt"] for _ in range(n)]
            result.samples = score(prompts, sampled, n).view(-1, n)
            keys = [answer_key(c) for c in sampled.completions]
            result.answers = [keys[i:i + n] for i in range(0, len(keys), n)]
    if EVAL_INDEX in batch:
        result.counted = counted_rows(batch[EVAL_INDEX], replica[1], replica[0])
    return result
