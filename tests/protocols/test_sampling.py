"""The sampling distribution both engines sample and the trainer scores (lightning_grpo.protocols.sampling):
``sampling_logits`` against transformers' own warpers and in vLLM's order (min-p before top-p), and
``SamplingConfig``'s checks naming the bad field."""

import math

import pytest
import torch

from lightning_grpo import GRPOConfig
from lightning_grpo.functional import token_logprobs
from lightning_grpo.protocols.sampling import SamplingConfig, sampling_logits


def _hf_warped(logits, temperature, top_k=0, top_p=1.0, min_p=0.0):
    """transformers' own warpers (an independent implementation), in its order: temperature, top-k, top-p, min-p."""
    from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p:
        scores = MinPLogitsWarper(min_p)(None, scores)
    return scores


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 5, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (1.3, 0, 1.0, 0.1), (0.8, 20, 0.8, 0.0), (1.0, 64, 1.0, 0.0),
])
def test_sampling_logits_equal_transformers_warpers(temperature, top_k, top_p, min_p):
    torch.manual_seed(4)
    logits = torch.randn(6, 64) * 3
    ours = sampling_logits(logits, temperature, top_k, top_p, min_p)
    expected = _hf_warped(logits, temperature, top_k, top_p, min_p)
    assert torch.equal(torch.isinf(ours), torch.isinf(expected))
    kept = ~torch.isinf(ours)
    torch.testing.assert_close(ours[kept], expected[kept])
    removed = (~kept).sum().item()
    assert removed == 0 if (top_k in (0, 64) and top_p == 1 and min_p == 0) else removed > 0


def test_min_p_comes_before_top_p_as_in_vllm():
    # p = [0.5, 0.3, 0.12, 0.08], min_p 0.2 removes 0.08 (< 0.1); renormalized [0.5435, 0.3261, 0.1304]; top_p 0.85
    # then removes 0.1304 (<= 0.15): {0, 1} stay. transformers' order (top-p first) would keep {0, 1, 2}.
    logits = torch.tensor([[0.5, 0.3, 0.12, 0.08]]).log()
    kept = ~torch.isinf(sampling_logits(logits, 1.0, top_p=0.85, min_p=0.2))
    assert kept.tolist() == [[True, True, False, False]]
    assert (~torch.isinf(_hf_warped(logits, 1.0, top_p=0.85, min_p=0.2))).tolist() == [[True, True, True, False]]
    labels = torch.tensor([[0, 1]])
    lp, _ = token_logprobs(logits.expand(1, 2, 4), labels, top_p=0.85, min_p=0.2)
    torch.testing.assert_close(lp, torch.tensor([[math.log(0.5 / 0.8), math.log(0.3 / 0.8)]]))


def test_sampling_config_names_the_bad_field():
    for kwargs, field in [({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": 0.0}, "temperature"),
                          ({"top_p": 0.0}, "top_p"), ({"top_k": -1}, "top_k"), ({"min_p": 1.5}, "min_p")]:
        with pytest.raises(ValueError, match=f"sampling.{field}"):
            SamplingConfig(**{"max_new_tokens": 4, **kwargs})
    assert SamplingConfig(4, temperature=0.0, greedy=True).greedy
    with pytest.raises(ValueError, match=r"GRPOConfig.min_p=1.5 is invalid: must be in \[0, 1\]"):
        GRPOConfig(min_p=1.5)
