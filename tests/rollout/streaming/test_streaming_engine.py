"""The streaming engine seen as a rollout engine (``StreamingRolloutEngine``: validation and ``GRPOModule.generate``
in streaming mode), on the scripted streaming engine: prompt-major rows, the colocated engines' seeds, negative keys
(never a stream group's), each token's version."""

from __future__ import annotations

import torch
from transformers import AutoTokenizer

from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.rollout.streaming.streaming_engine import StreamingRolloutEngine
from support.streaming import ScriptedStreamingEngine

EOS = 2


def script(key: int, j: int) -> list[int]:
    return [100 - key, 200 + j, EOS] if key == -2 else [100 - key, 300 + j, 400, 500]


def test_a_one_off_rollout_samples_each_prompts_group_under_a_negative_key_with_the_engines_seeds(tiny_llama_path):
    engine = ScriptedStreamingEngine(script, EOS)
    engine.version = 3
    adapter = StreamingRolloutEngine(engine, AutoTokenizer.from_pretrained(tiny_llama_path), pad_token_id=0)
    try:
        out = adapter.generate([[5, 6], [7]], 2, SamplingConfig(max_new_tokens=3, seed=10))
    finally:
        adapter.close()
    assert engine.requests == [(-1, 1, 10), (-2, 1, 12)]  # keys -1 - i, seeds seed + i * G
    assert out.completion_ids.tolist() == [[101, 300, 400], [101, 301, 400], [102, 200, EOS], [102, 201, EOS]]
    assert out.completion_mask.tolist() == [[1, 1, 1]] * 4
    assert out.truncated.tolist() == [True, True, False, False]
    assert out.prompt_ids.tolist() == [[5, 6]] * 2 + [[0, 7]] * 2 and out.prompt_mask.tolist() == [[1, 1]] * 2 + [
        [0, 1]] * 2
    assert torch.equal(out.completion_versions, torch.full((4, 3), 3)) and adapter.version == 3
    assert engine.closed
