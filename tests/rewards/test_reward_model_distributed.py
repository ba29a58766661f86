"""The reward model under DDP and FSDP2 (2 CPU processes, gloo): each process loads its own copy and scores its
own rollouts, with the scores of the model run by hand on those texts."""

from pathlib import Path

import pytest
from test_reward_model import _by_hand

from support.dist import load, run_worker

WORKER = Path(__file__).resolve().parents[1] / "support" / "reward_worker.py"


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "grpo_fsdp2"])
def test_each_process_scores_its_own_rollouts(tmp_path, tiny_llama_path, tiny_reward_model_path, strategy):
    run_worker({"model": tiny_llama_path, "reward_model": tiny_reward_model_path, "strategy": {"name": strategy}},
               tmp_path, timeout=600, worker=WORKER)
    ranks = load(tmp_path, f"reward_model_{strategy}", 2)
    assert ranks[0]["pid"] != ranks[1]["pid"] and all(r["loaded"] and r["device"] == "cpu" for r in ranks)
    assert [r["process_device"] for r in ranks] == ["cpu", "cpu"]  # GRPOModule.setup gave each rank its device
    texts = [[(p, c) for rollout in r["rollouts"] for p, c in zip(rollout["prompts"], rollout["completions"],
                                                                    strict=True)] for r in ranks]
    assert texts[0] != texts[1]  # the ranks' prompts differ: each scored its own
    for rank in ranks:
        assert len(rank["rollouts"]) == 2  # two steps, one rollout each
        for rollout in rank["rollouts"]:
            expected = _by_hand(tiny_reward_model_path, rollout["prompts"], rollout["completions"])
            assert rollout["per_function"][:, 0].tolist() == pytest.approx(expected, abs=1e-5)
