"""Multi-turn episodes under 2 processes (gloo) with the HF engine gathered by FSDP2 around every ``generate``: the
ranks' episodes need different numbers of turns, so the rank that is done joins the other's remaining turns (a
collective per ``generate``) instead of leaving it waiting; the logged ``turns/max`` is the max over both ranks."""

import pytest

from support.dist import load, run_worker
from support.episodes import save_talkative_llama

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


@pytest.mark.parametrize("strategy", ["grpo_fsdp2", "ddp"])
def test_ranks_with_episodes_of_different_lengths(strategy, tmp_path, smollm2_path):
    model = save_talkative_llama(tmp_path / "talkative", smollm2_path)
    out = tmp_path / "run"
    run_worker({"scenario": "episodes_run", "model": model, "strategy": {"name": strategy}}, out, timeout=900)
    ranks = load(out, "episodes_run", 2)
    assert [r["global_step"] for r in ranks] == [2, 2]
    assert all(t <= 2 for rollout in ranks[0]["turns"] for t in rollout)
    assert any(t > 2 for rollout in ranks[1]["turns"] for t in rollout)  # rank 1 needed more turns
    for step in range(2):
        longest = max(max(r["turns"][step]) for r in ranks)
        assert ranks[0]["turns_max"][step] == ranks[1]["turns_max"][step] == longest
