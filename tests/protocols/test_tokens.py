"""Per-token fields (:mod:`lightning_grpo.protocols.tokens`): every declared field of a record goes through a cut, a
join, a trim, a move and a checkpoint the way its ids do, with its own padding value; a field some joined parts lack
is an error, never dropped. Golden layouts worked by hand."""

from dataclasses import dataclass, field, replace
from typing import Optional

import pytest
import torch
from torch import Tensor

from lightning_grpo.protocols.rollout import RolloutOutput
from lightning_grpo.protocols.tokens import (
    PAD_ID,
    ROW_META,
    Layout,
    cat_rows,
    check_aligned,
    pad_columns,
    select_rows,
    token_fields,
    token_meta,
    trim_columns,
)


@dataclass
class _Routed:
    """A record like a rollout with routed experts: ``(N, P, layers=2, top_k=1)`` and ``(N, T, 2, 1)``, padded -1."""

    prompt_ids: Tensor = field(metadata=token_meta(Layout.PROMPT, PAD_ID))
    completion_ids: Tensor = field(metadata=token_meta(Layout.COMPLETION, PAD_ID))
    prompt_experts: Optional[Tensor] = field(default=None, metadata=token_meta(Layout.PROMPT, -1))
    completion_experts: Optional[Tensor] = field(default=None, metadata=token_meta(Layout.COMPLETION, -1))
    reward: Optional[Tensor] = field(default=None, metadata=ROW_META)


def _routed(prompts: list[list[int]], completions: list[list[int]], pad: int = 0) -> _Routed:
    """Left-padded prompts, right-padded completions; a token's experts are ``[id, 10 * id]`` (so they can be read
    back from the id they belong to)."""
    p, t = max(map(len, prompts)), max(map(len, completions))
    prompt_ids = torch.tensor([[pad] * (p - len(x)) + x for x in prompts])
    completion_ids = torch.tensor([x + [pad] * (t - len(x)) for x in completions])

    def experts(ids: Tensor, real: Tensor) -> Tensor:
        values = torch.stack([ids, 10 * ids], dim=-1).unsqueeze(-1)  # [N, W, 2, 1]
        return torch.where(real[..., None, None], values, torch.full_like(values, -1))

    prompt_real = torch.tensor([[False] * (p - len(x)) + [True] * len(x) for x in prompts])
    completion_real = torch.tensor([[True] * len(x) + [False] * (t - len(x)) for x in completions])
    return _Routed(prompt_ids, completion_ids, experts(prompt_ids, prompt_real),
                   experts(completion_ids, completion_real), torch.arange(len(prompts), dtype=torch.float32))


def test_declared_fields_in_order():
    assert [name for name, _ in token_fields(_Routed)] == ["prompt_ids", "completion_ids", "prompt_experts",
                                                           "completion_experts"]
    assert [name for name, _ in token_fields(RolloutOutput)] == ["prompt_ids", "prompt_mask", "completion_ids",
                                                                 "completion_mask", "sampler_logprobs", "env_mask",
                                                                 "prompt_routed_experts", "completion_routed_experts",
                                                                 "completion_versions"]


def test_pad_columns_left_for_prompts_right_for_completions_with_trailing_dims():
    spec_prompt, spec_completion = token_fields(_Routed)[2][1], token_fields(_Routed)[3][1]
    x = torch.tensor([[[[5]], [[6]]]])  # [1, 2, 1, 1]
    assert pad_columns(x, 4, spec_prompt).flatten().tolist() == [-1, -1, 5, 6]
    assert pad_columns(x, 4, spec_completion).flatten().tolist() == [5, 6, -1, -1]
    assert pad_columns(torch.tensor([[3]]), 2, token_fields(_Routed)[0][1], pad_token_id=9).tolist() == [[9, 3]]
    with pytest.raises(ValueError, match="pass pad_token_id"):
        pad_columns(torch.tensor([[3]]), 2, token_fields(_Routed)[0][1])
    with pytest.raises(ValueError, match="it is wider"):
        pad_columns(x, 1, spec_prompt)


def test_a_join_keeps_every_value_on_its_token():
    a = _routed([[4, 5], [6]], [[7], [8, 9, 2]])
    b = _routed([[1, 2, 3]], [[3, 3]])
    joined = {name: cat_rows(name, [getattr(a, name), getattr(b, name)], spec, pad_token_id=0)
              for name, spec in token_fields(_Routed)}
    assert joined["prompt_ids"].tolist() == [[0, 4, 5], [0, 0, 6], [1, 2, 3]]
    assert joined["completion_ids"].tolist() == [[7, 0, 0], [8, 9, 2], [3, 3, 0]]
    # every expert entry is the id of its own token or the -1 sentinel at a pad: never expert 0 at a pad
    for ids, experts, real in ((joined["prompt_ids"], joined["prompt_experts"], [[0, 1, 1], [0, 0, 1], [1, 1, 1]]),
                               (joined["completion_ids"], joined["completion_experts"],
                                [[1, 0, 0], [1, 1, 1], [1, 1, 0]])):
        real_t = torch.tensor(real, dtype=torch.bool)
        assert torch.equal(experts[..., 0, 0][real_t], ids[real_t])
        assert torch.equal(experts[..., 1, 0][real_t], 10 * ids[real_t])
        assert (experts[~real_t] == -1).all()


def test_a_field_only_some_parts_have_is_an_error():
    a, b = _routed([[4]], [[7]]), _routed([[4]], [[7]])
    b = replace(b, completion_experts=None)
    with pytest.raises(ValueError, match="completion_experts: some of the rollouts joined have it"):
        cat_rows("completion_experts", [a.completion_experts, b.completion_experts], token_fields(_Routed)[3][1])
    assert cat_rows("x", [None, None], token_fields(_Routed)[3][1]) is None


def test_select_and_trim_apply_to_every_declared_field():
    record = _routed([[4, 5], [6]], [[7], [8, 9, 2]])
    picked = replace(record, **select_rows(record, torch.tensor([1])))
    assert picked.prompt_ids.tolist() == [[0, 6]] and picked.reward.tolist() == [1.0]
    assert picked.prompt_experts[..., 0, 0].tolist() == [[-1, 6]]
    trimmed = replace(picked, **trim_columns(picked, 1, 2))  # drop the prompt's pad column and the last one
    assert trimmed.prompt_ids.tolist() == [[6]] and trimmed.prompt_experts.shape == (1, 1, 2, 1)
    assert trimmed.completion_ids.tolist() == [[8, 9]] and trimmed.completion_experts[..., 1, 0].tolist() == [[80, 90]]
    check_aligned(trimmed)
    with pytest.raises(ValueError, match=r"_Routed.completion_experts has shape \(1, 3, 2, 1\)"):
        check_aligned(replace(trimmed, completion_experts=record.completion_experts[:1]), "_Routed")


def _rollout(prompts, completions, logprob, texts, version=None):
    p, t = max(map(len, prompts)), max(map(len, completions))
    return RolloutOutput(
        prompt_ids=torch.tensor([[0] * (p - len(x)) + x for x in prompts]),
        prompt_mask=torch.tensor([[0] * (p - len(x)) + [1] * len(x) for x in prompts]),
        completion_ids=torch.tensor([x + [0] * (t - len(x)) for x in completions]),
        completion_mask=torch.tensor([[1] * len(x) + [0] * (t - len(x)) for x in completions]),
        truncated=torch.tensor([False] * len(prompts)), completions=texts,
        sampler_logprobs=torch.tensor([[logprob] * len(x) + [0.0] * (t - len(x)) for x in completions]),
        weight_version=version, columns={"answer": texts})


def test_rollout_cat_select_and_checkpoint_state():
    a = _rollout([[4, 5], [6]], [[7], [8, 9]], -0.5, ["a0", "a1"], version=3)
    b = _rollout([[1, 2, 3]], [[3, 3, 3]], -0.25, ["b0"], version=3)
    joined = RolloutOutput.cat([a, b], pad_token_id=0)
    assert joined.prompt_ids.tolist() == [[0, 4, 5], [0, 0, 6], [1, 2, 3]]
    assert joined.prompt_mask.tolist() == [[0, 1, 1], [0, 0, 1], [1, 1, 1]]
    assert joined.sampler_logprobs.tolist() == [[-0.5, 0, 0], [-0.5, -0.5, 0], [-0.25, -0.25, -0.25]]
    assert joined.completions == ["a0", "a1", "b0"] and joined.columns == {"answer": ["a0", "a1", "b0"]}
    assert joined.weight_version == 3 and len(joined) == 3
    picked = joined.select(torch.tensor([2, 0]))
    assert picked.completions == ["b0", "a0"] and picked.completion_ids.tolist() == [[3, 3, 3], [7, 0, 0]]
    restored = RolloutOutput.from_state(picked.state())
    for name, _ in token_fields(RolloutOutput):
        value = getattr(picked, name)
        assert (value is None and getattr(restored, name) is None) or torch.equal(value, getattr(restored, name))
    with pytest.raises(ValueError, match="different weight versions"):
        RolloutOutput.cat([a, replace(b, weight_version=4)], pad_token_id=0)
    with pytest.raises(ValueError, match="sampler_logprobs: some of the rollouts joined have it"):
        RolloutOutput.cat([a, replace(b, sampler_logprobs=None)], pad_token_id=0)


def test_per_token_versions_are_carried_with_their_tokens():
    """``completion_versions`` (pad -1: version 0 is a real version) through a join, a selection, a checkpoint state
    and into the training record, each value on its token."""
    from lightning_grpo.loop.resume import experience_from_state, experience_state
    from lightning_grpo.training.experience import Experience

    a = replace(_rollout([[4, 5], [6]], [[7], [8, 9]], -0.5, ["a0", "a1"]),
                completion_versions=torch.tensor([[0, -1], [0, 1]]))
    b = replace(_rollout([[1]], [[3, 3, 3]], -0.25, ["b0"]), completion_versions=torch.tensor([[2, 2, 3]]))
    joined = RolloutOutput.cat([a, b], pad_token_id=0)
    assert joined.completion_versions.tolist() == [[0, -1, -1], [0, 1, -1], [2, 2, 3]]
    picked = RolloutOutput.from_state(joined.select(torch.tensor([2, 1])).state())
    assert picked.completion_versions.tolist() == [[2, 2, 3], [0, 1, -1]]
    experience = Experience.of(picked, torch.device("cpu"))
    assert experience.completion_versions.tolist() == [[2, 2, 3], [0, 1, -1]]
    assert experience.select(torch.tensor([1])).completion_versions.tolist() == [[0, 1]]  # trimmed with the ids
    restored = experience_from_state(experience_state(experience), torch.device("cpu"))
    assert torch.equal(restored.completion_versions, experience.completion_versions)
    with pytest.raises(ValueError, match="completion_versions: some of the rollouts joined have it"):
        RolloutOutput.cat([a, replace(b, completion_versions=None)], pad_token_id=0)
