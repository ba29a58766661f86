"""The HF engine records the experts a mixture-of-experts policy routed each token to
(:mod:`lightning_grpo.rollout.engines.generate_routing`), laid out exactly like the token ids: left-padded prompts
of different lengths and right-padded completions, -1 at every pad and at the last generated token (never fed to
the model), never expert 0 (the failure of google/tunix PR #2046). Checked against a teacher-forced forward of each
row's real tokens alone, position by position."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_grpo.models.moe import MoeRouters
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.rollout.engines.generate_routing import generation_routing
from lightning_grpo.rollout.engines.hf import HFRolloutEngine


def test_generation_routing_lays_out_prefill_and_decode_steps():
    """Two rows, prompt width 2, three generated tokens: the prefill is the prompt; decode steps 1 and 2 fed
    completion tokens 0 and 1; token 2 was never fed (-1); a third decode call (``synced_gpus``) is ignored."""
    prefill = torch.arange(4 * 2).view(4, 1, 2).to(torch.int16)  # rows * width = 4 positions, 1 layer, top-2
    steps = [torch.full((2, 1, 2), 10 * s, dtype=torch.int16) + torch.tensor([[[0, 1]], [[2, 3]]]) for s in (1, 2, 3)]
    prompt, completion = generation_routing([prefill, *steps], 2, 2, 3, 1, 2)
    assert prompt.tolist() == [[[[0, 1]], [[2, 3]]], [[[4, 5]], [[6, 7]]]]
    assert completion.tolist() == [[[[10, 11]], [[20, 21]], [[-1, -1]]], [[[12, 13]], [[22, 23]], [[-1, -1]]]]
    assert prompt.dtype == completion.dtype == torch.int16
    with pytest.raises(ValueError, match=r"the prefill's routing has shape \(4, 1, 2\), expected \(6, 1, 2\)"):
        generation_routing([prefill], 2, 3, 1, 1, 2)
    with pytest.raises(ValueError, match="decode step 1's routing has shape"):
        generation_routing([prefill, torch.zeros(3, 1, 2, dtype=torch.int16)], 2, 2, 3, 1, 2)
    with pytest.raises(ValueError, match="made no forward call"):
        generation_routing([], 2, 2, 3, 1, 2)


@pytest.fixture(scope="module")
def policy(tiny_qwen3_moe_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3_moe_path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_qwen3_moe_path), MoeRouters(model)


@pytest.mark.parametrize("greedy", [False, True])
def test_recorded_routing_is_each_tokens_own_at_its_position(policy, greedy):
    model, tokenizer, routers = policy
    engine = HFRolloutEngine(model, tokenizer, routing=routers)
    assert engine.capabilities.returns_routed_experts
    assert not HFRolloutEngine(model, tokenizer).capabilities.returns_routed_experts
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15, 16, 17, 18, 19]]  # left-padded to 7
    torch.manual_seed(0)
    out = engine.generate(prompts, 2, SamplingConfig(6, temperature=1.0, greedy=greedy))
    prompt_routed, completion_routed = out.prompt_routed_experts, out.completion_routed_experts
    n, p, t = len(out), out.prompt_ids.shape[1], out.completion_ids.shape[1]
    assert prompt_routed.shape == (n, p, 2, 2) and completion_routed.shape == (n, t, 2, 2)
    assert prompt_routed.dtype == torch.int16
    # every pad is the sentinel, never an expert
    assert (prompt_routed[~out.prompt_mask.bool()] == -1).all()
    assert (completion_routed[~out.completion_mask.bool()] == -1).all()
    assert (completion_routed[:, t - 1] == -1).all()  # the last generated token is never fed to the model
    checked = 0
    for row in range(n):
        prompt = out.prompt_ids[row][out.prompt_mask[row].bool()]
        real = int(out.completion_mask[row].sum())
        ids = torch.cat([prompt, out.completion_ids[row, :real]])
        with torch.no_grad(), routers.record() as calls:
            model(ids[None])
        own = calls[0].sort(dim=-1).values  # [len, layers, k] the row's tokens routed alone, unpadded
        assert torch.equal(prompt_routed[row, p - len(prompt):].sort(dim=-1).values, own[: len(prompt)])
        for j in range(real):
            recorded = completion_routed[row, j]
            if j < t - 1:
                assert torch.equal(recorded.sort(dim=-1).values, own[len(prompt) + j]), (row, j)
                checked += 1
            else:
                assert (recorded == -1).all()
    assert checked >= n  # every row had tokens fed after its prompt
