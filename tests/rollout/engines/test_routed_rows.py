"""A completion's routed experts as per-row fields and back (:mod:`lightning_grpo.rollout.engines.routed_rows`): split
by sequence position into the prompt's and the completion's, laid out like the rollout's ids (prompts left-padded,
completions right-padded, -1 at every pad and at a completion's last token), through a server answer's JSON."""

import json

import numpy as np
import pytest
import torch

from lightning_grpo.rollout.engines.routed_rows import (
    routing_extra,
    routing_fields,
    routing_from_extra,
    with_routed_experts,
)
from lightning_grpo.rollout.engines.rows import rollout_from_rows

EOS = 2


class _Tokenizer:
    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(map(str, r)) for r in rows]


def _sequence(length, layers=2, k=2, offset=0):
    """Position p, layer l, slot j routes to expert 100 * offset + 10 * p + 2 * l + j (each value names its place)."""
    p = np.arange(length)[:, None, None]
    return (100 * offset + 10 * p + 2 * np.arange(layers)[None, :, None] + np.arange(k)[None, None, :]).astype(np.int16)


def test_a_sequences_routing_splits_into_the_prompts_and_the_completions():
    fields = routing_fields(_sequence(3 + 4 - 1), prompt_length=3, completion_length=4)
    assert fields["prompt_routed_experts"].shape == (3, 2, 2)
    assert fields["prompt_routed_experts"][2, 1].tolist() == [22, 23]
    completion = fields["completion_routed_experts"]
    assert completion.shape == (4, 2, 2) and completion.dtype == np.int16
    assert completion[0, 0].tolist() == [30, 31] and completion[2, 1].tolist() == [52, 53]
    assert (completion[3] == -1).all()  # the last token was never fed to the model
    with pytest.raises(ValueError, match="covers 2 positions for a prompt of 3 tokens"):
        routing_fields(_sequence(2), 3, 4)
    with pytest.raises(ValueError, match="covers 8 positions"):
        routing_fields(_sequence(8), 3, 4)


def test_rows_with_routing_become_a_rollout_whose_routing_sits_on_its_ids():
    """Two prompts (2 and 4 tokens) x 2 completions: one truncated at 4 tokens, three ending at their EOS (2, 1 and 3
    tokens; pads are the EOS id): each routed value lands on the position it was recorded for, -1 on every pad and on
    each completion's last token."""
    prompts = [[5, 6], [7, 8, 9, 10]]
    completions = [[11, 12, 13, 14], [14, EOS], [EOS], [18, 19, EOS]]
    rows = []
    for i, ids in enumerate(completions):
        prompt = prompts[i // 2]
        fields = routing_fields(_sequence(len(prompt) + len(ids) - 1, offset=i), len(prompt), len(ids))
        rows.append((ids, [-0.5] * len(ids), fields))
    out = rollout_from_rows(prompts, rows, 2, pad_token_id=EOS, eos_token_ids=[EOS], tokenizer=_Tokenizer())
    pr, cr = out.prompt_routed_experts, out.completion_routed_experts
    assert pr.shape == (4, 4, 2, 2) and cr.shape == (4, 4, 2, 2) and pr.dtype == torch.int16
    assert (pr[0, :2] == -1).all() and pr[0, 2, 0].tolist() == [0, 1] and pr[1, 3, 1].tolist() == [112, 113]
    assert pr[2, 0, 0].tolist() == [200, 201] and pr[3, 3, 0].tolist() == [330, 331]
    assert cr[0, :, 0, 0].tolist() == [20, 30, 40, -1]  # position 2 + t; the last token: -1
    assert cr[1, :, 0, 0].tolist() == [120, -1, -1, -1]  # its EOS never fed; the pads: -1
    assert cr[2, :, 0, 0].tolist() == [-1, -1, -1, -1]  # one token: never fed
    assert cr[3, :, 0, 1].tolist() == [341, 351, -1, -1]


def test_the_routing_survives_a_servers_json_answer():
    prompts = [[5, 6, 7]]
    completions = [[11, EOS], [13, 14, 15]]
    fields = [routing_fields(_sequence(3 + len(c) - 1, offset=i), 3, len(c)) for i, c in enumerate(completions)]
    extra = json.loads(json.dumps(routing_extra(fields)))
    assert sorted(extra) == ["completion_routed_experts", "prompt_routed_experts"]
    assert len(extra["prompt_routed_experts"][1]) == 3 and len(extra["completion_routed_experts"][1]) == 3
    kwargs = dict(pad_token_id=EOS, eos_token_ids=[EOS], tokenizer=_Tokenizer())
    def rollout(routing):
        rows = [(c, [0.0] * len(c), f) for c, f in zip(completions, routing, strict=True)]
        return rollout_from_rows(prompts, rows, 2, **kwargs)

    direct, wired = rollout(fields), rollout(routing_from_extra(extra, 2))
    assert torch.equal(direct.prompt_routed_experts, wired.prompt_routed_experts)
    assert torch.equal(direct.completion_routed_experts, wired.completion_routed_experts)
    with pytest.raises(ValueError, match="extra.prompt_routed_experts has 2 entries for 3 completions"):
        routing_from_extra(extra, 3)


def test_routing_on_some_rows_or_misaligned_is_an_error():
    prompts = [[5, 6]]
    kwargs = dict(pad_token_id=0, eos_token_ids=[EOS], tokenizer=_Tokenizer())
    good = routing_fields(_sequence(3), 2, 2)
    with pytest.raises(ValueError, match="1 of 2 completions carry per-token fields"):
        rollout_from_rows(prompts, [([3, 4], [0.0, 0.0], good), ([3, 4], [0.0, 0.0])], 2, **kwargs)
    bad = dict(good, prompt_routed_experts=_sequence(3))
    out = rollout_from_rows(prompts, [([3, 4], [0.0, 0.0])], 1, **kwargs)
    with pytest.raises(ValueError, match=r"row 0: prompt_routed_experts has shape \(3, 2, 2\), expected \(2, "):
        with_routed_experts(out, [bad])
