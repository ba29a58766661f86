"""The ``/generate`` wire format and the server engine's segment bookkeeping, without vLLM: numbers worked by hand.

* an answer carries ids, logprobs and versions per completion, and other per-token fields by name (``extra``), read
  back into ``SampledCompletion`` records with their finish reason; RolloutOutput's prompt fields (the routed experts
  of the prompt) are aligned with the prompt; malformed rows are errors naming the completion;
* a resumed segment's seed is fresh and reproducible (the first segment keeps the request's own seed);
* vLLM's weight-version spans become per-token versions, and spans that do not cover the tokens are errors.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.protocols.streaming import GroupRequest
from lightning_grpo.rollout.server.async_engine import segment_seed, versions_from_spans
from lightning_grpo.rollout.server.server_pool import group_work
from lightning_grpo.rollout.server.wire import PROMPT_FIELDS, completion_answer, sampled_completions, sampling_fields


def test_an_answer_carries_versions_and_extra_fields_per_token():
    rows = [([5, 6, 2], [-0.5, -1.0, -0.25], {"versions": [3, 3, 4], "experts": [[0, 1], [1, 2], [0, 2]]}),
            ([7, 8], [-2.0, -0.125], {"versions": [4, 4], "experts": [[1, 1], [2, 0]]})]
    answer = completion_answer(rows, version=4)
    assert answer == {"token_ids": [[5, 6, 2], [7, 8]], "logprobs": [[-0.5, -1.0, -0.25], [-2.0, -0.125]],
                      "versions": [[3, 3, 4], [4, 4]], "version": 3,  # the oldest token's version
                      "extra": {"experts": [[[0, 1], [1, 2], [0, 2]], [[1, 1], [2, 0]]]}}
    first, second = sampled_completions(answer, eos_token_ids=[2])
    assert (first.token_ids, first.versions, first.finish_reason) == ([5, 6, 2], [3, 3, 4], "stop")
    assert first.extra == {"experts": [[0, 1], [1, 2], [0, 2]]} and first.logprobs == [-0.5, -1.0, -0.25]
    assert (second.finish_reason, second.extra) == ("length", {"experts": [[1, 1], [2, 0]]})


def test_rows_without_fields_carry_the_servers_version():
    answer = completion_answer([([1, 2], [-1.0, -2.0]), ([], [])], version=7)
    assert answer["versions"] == [[7, 7], []] and answer["extra"] == {} and answer["version"] == 7
    assert completion_answer([([], [])], version=2)["version"] == 2  # no token at all: the server's version


def test_prompt_fields_are_aligned_with_the_prompt_and_the_others_with_the_ids():
    """``prompt_routed_experts`` is one of RolloutOutput's prompt fields: one value per prompt token (3 and 2 here),
    ``completion_routed_experts`` one per token id; both are carried by name, per completion."""
    rows = [([5, 6], [-0.5, -1.0], {"versions": [1, 1], "prompt_routed_experts": [[[0]], [[1]], [[2]]],
                                    "completion_routed_experts": [[[3]], [[-1]]]}),
            ([7], [-2.0], {"versions": [1], "prompt_routed_experts": [[[4]], [[5]]],
                           "completion_routed_experts": [[[-1]]]})]
    answer = completion_answer(rows, version=1, prompt_lengths=[3, 2])
    assert answer["extra"] == {"prompt_routed_experts": [[[[0]], [[1]], [[2]]], [[[4]], [[5]]]],
                               "completion_routed_experts": [[[[3]], [[-1]]], [[[-1]]]]}
    first, second = sampled_completions(answer, eos_token_ids=[2])
    assert first.extra["prompt_routed_experts"] == [[[0]], [[1]], [[2]]] and second.extra["prompt_routed_experts"] \
        == [[[4]], [[5]]]
    assert "prompt_routed_experts" in PROMPT_FIELDS and "completion_routed_experts" not in PROMPT_FIELDS
    with pytest.raises(ValueError, match="completion 1: 2 prompt_routed_experts for a prompt of 3 token ids"):
        completion_answer(rows, version=1, prompt_lengths=[3, 3])
    with pytest.raises(ValueError, match="completion 0 carries prompt_routed_experts, aligned with its prompt: give "
                                         "the prompt_lengths"):
        completion_answer(rows, version=1)
    with pytest.raises(ValueError, match="1 prompt lengths for 2 completions"):
        completion_answer(rows, version=1, prompt_lengths=[3])


@pytest.mark.parametrize("rows, message", [
    ([([1, 2], [-1.0, -2.0], {"versions": [0]})], "completion 0: 1 versions for 2 token ids"),
    ([([1], [-1.0], {"versions": [0], "a": [1]}), ([1], [-1.0], {"versions": [0]})],
     r"completion 1 has per-token fields \['versions'\], the first \['a', 'versions'\]"),
    ([([1], [-1.0], {"a": [1]})], r"completion 0 has per-token fields \['a'\], the first \['a'\]: every completion "
                                  "carries the same fields, 'versions' among them"),
])
def test_malformed_rows_are_errors_naming_the_completion(rows, message):
    with pytest.raises(ValueError, match=message):
        completion_answer(rows, version=0)


def test_an_answer_with_misaligned_lists_is_refused():
    answer = {"token_ids": [[1], [2]], "logprobs": [[-1.0]], "versions": [[0], [0]], "extra": {}}
    with pytest.raises(ValueError, match="the answer has 1 logprobs lists for 2 completions"):
        sampled_completions(answer, eos_token_ids=[2])
    answer = {"token_ids": [[1, 2]], "logprobs": [[-1.0, -1.0]], "versions": [[1, 0]], "extra": {}}
    with pytest.raises(ValueError, match=r"versions decrease: \[1, 0\]"):
        sampled_completions(answer, eos_token_ids=[2])


def test_sampling_fields_and_group_work():
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.7, top_k=5, seed=3)
    assert sampling_fields(sampling) == {"max_new_tokens": 8, "temperature": 0.7, "top_p": 1.0, "top_k": 5,
                                         "min_p": 0.0, "greedy": False}
    assert sampling_fields(SamplingConfig(max_new_tokens=2, banned_token_ids=(4,)))["banned_token_ids"] == [4]
    assert group_work(GroupRequest(key=0, prompt_ids=(1, 2, 3), num_generations=4, sampling=sampling)) == 4 * (3 + 8)


def test_a_resumed_segment_gets_a_fresh_reproducible_seed():
    assert segment_seed(100, 0) == 100 and segment_seed(None, 5) is None
    # BLAKE2b-56 of "100:5", by hand: hashlib.blake2b(b"100:5", digest_size=7).hexdigest()
    assert segment_seed(100, 5) == int("6aba49ee99c2cb", 16) == segment_seed(100, 5)
    seeds = {segment_seed(s, n) for s in range(100, 108) for n in range(1, 50)}
    assert len(seeds) == 8 * 49 and all(0 <= s < 2**56 for s in seeds)  # no two segments share a noise stream


@dataclass
class Span:
    version: str
    start: int
    end: int


def test_weight_version_spans_become_per_token_versions():
    assert versions_from_spans([Span("1", 0, 2), Span("2", 2, 5)], 5, "r") == [1, 1, 2, 2, 2]
    assert versions_from_spans([], 0, "r") == [] and versions_from_spans(None, 0, "r") == []
    with pytest.raises(RuntimeError, match=r"r: vLLM labelled 2 of its 3 tokens with a weight version"):
        versions_from_spans([Span("1", 0, 2)], 3, "r")
    with pytest.raises(RuntimeError, match="r: vLLM's weight-version spans .* do not label its tokens in order"):
        versions_from_spans([Span("default", 0, 2)], 2, "r")
    with pytest.raises(RuntimeError, match="do not label its tokens in order"):
        versions_from_spans([Span("1", 1, 2)], 2, "r")
