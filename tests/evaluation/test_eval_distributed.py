"""Distributed evaluation counts every prompt once (2 gloo processes, ``tests/support/dist_worker.py``).

3 prompts on 2 processes: Lightning's ``DistributedSampler`` gives rank 0 prompts 0 and 2 and rank 1 prompt 1 and
prompt 0 again (padding). Only prompt 0 is correct (a reward that reads the gold, not the completion), so every
accuracy-like metric is 1/3; counting the padding would give 2/4 = 1/2.
"""

from __future__ import annotations

import pytest
import torch

from lightning_grpo.evaluation.evaluator import counted_rows
from support.dist import load, run_worker

pytestmark = pytest.mark.distributed


def test_counted_rows_follow_the_distributed_sampler_layout():
    from torch.utils.data.distributed import DistributedSampler

    for size, world in [(3, 2), (5, 4), (1, 3), (7, 3), (6, 3)]:
        seen: list[int] = []
        for rank in range(world):
            indices = list(DistributedSampler(range(size), num_replicas=world, rank=rank, shuffle=False))
            seen += [i for i, keep in zip(indices, counted_rows(indices, world, rank).tolist(), strict=True) if keep]
        assert sorted(seen) == list(range(size)), (size, world)  # each prompt exactly once
    assert counted_rows([0, 2], 2, 0).tolist() == [True, True] and counted_rows([1, 0], 2, 1).tolist() == [True, False]


def test_validation_on_two_processes_counts_the_padding_once(tiny_llama_path, tmp_path):
    run_worker({"scenario": "eval_padding", "model": tiny_llama_path}, tmp_path, timeout=400)
    ranks = load(tmp_path, "eval_padding", 2)
    for metrics in ranks:
        for key in ("val/accuracy", "val/pass@1", "val/pass@2", "val/mean@2"):
            assert metrics[key] == pytest.approx(1 / 3, abs=1e-6), (key, metrics)
        assert 0.0 <= metrics["val/maj@2"] <= 1 / 3 + 1e-6
    assert ranks[0] == ranks[1]
    assert torch.isfinite(torch.tensor(ranks[0]["val/mean_length"]))
