"""Padding-free packing and token-budget micro-batches: golden layouts, packed == padded logprobs and gradients on
a tiny random Llama, and the partition's invariants."""

import random

import pytest
import torch

from lightning_grpo import GRPOConfig, GRPOModule
from lightning_grpo.training.experience import Experience, micro_batches
from lightning_grpo.training.packing import (
    arrange,
    merge_rows,
    pack_sequences,
    sequence_token_counts,
    shared_prefix_rows,
    token_budget_partition,
)


def test_pack_sequences_golden_layout():
    # row 0: prompt [7, 8] (one left pad), completion [1, 2, 3]; row 1: no loss tokens (left out);
    # row 2: prompt [9, 5, 6], completion [4] (two right pads)
    prompt_ids = torch.tensor([[0, 7, 8], [3, 3, 3], [9, 5, 6]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [1, 1, 1]])
    completion_ids = torch.tensor([[1, 2, 3], [4, 4, 4], [4, 0, 0]])
    completion_mask = torch.tensor([[1, 1, 1], [0, 0, 0], [1, 0, 0]])
    packed = pack_sequences(prompt_ids, prompt_mask, completion_ids, completion_mask)
    assert packed.input_ids.tolist() == [[7, 8, 1, 2, 3, 9, 5, 6, 4]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    # the logit at packed position i predicts the token at i + 1
    assert packed.logit_index.tolist() == [1, 2, 3, 7]
    assert packed.target_ids.tolist() == [[1, 2, 3, 4]]
    unpacked = packed.unpack(torch.tensor([[0.1, 0.2, 0.3, 0.4]]), (3, 3))
    torch.testing.assert_close(unpacked, torch.tensor([[0.1, 0.2, 0.3], [0, 0, 0], [0.4, 0, 0]]))
    assert sequence_token_counts(prompt_mask, completion_mask).tolist() == [5, 3, 4]
    # each packed position's place in the padded [prompt | completion] layout (width 3 + 3): row * 6 + column
    assert packed.source.tolist() == [[1, 2, 3, 4, 5, 12, 13, 14, 15]]
    assert torch.equal(arrange(prompt_ids, completion_ids, packed.source), packed.input_ids)


def test_shared_prefix_rows_golden_layout():
    # rows 0 and 2 share the prompt [7, 8]; row 1 has its own prompt [9]
    prompt_ids = torch.tensor([[0, 7, 8], [0, 0, 9], [0, 7, 8]])
    prompt_mask = torch.tensor([[0, 1, 1], [0, 0, 1], [0, 1, 1]])
    completion_ids = torch.tensor([[1, 2], [3, 0], [4, 5]])
    completion_mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    first, second = shared_prefix_rows(prompt_ids, prompt_mask, completion_ids, completion_mask, torch.float32)
    assert first.input_ids.tolist() == [[7, 8, 1, 2, 4, 5]]
    assert first.position_ids.tolist() == [[0, 1, 2, 3, 2, 3]]
    assert first.logit_index.tolist() == [1, 2, 1, 4]  # the last prompt position predicts both first tokens
    assert first.target_ids.tolist() == [[1, 2, 4, 5]]
    assert first.rows.tolist() == [0, 0, 2, 2] and first.cols.tolist() == [0, 1, 0, 1]
    attends = (first.attention_mask[0, 0] == 0).int().tolist()
    assert attends == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],  # the second completion sees the prompt and itself, not the first completion
        [1, 1, 0, 0, 1, 1],
    ]
    assert second.input_ids.tolist() == [[9, 3]] and second.logit_index.tolist() == [0]
    # the shared prompt maps to the first member's prompt (row 0, columns 1, 2), each completion to its own row
    assert first.source.tolist() == [[1, 2, 3, 4, 13, 14]] and second.source.tolist() == [[7, 8]]
    merged = merge_rows([first, second])
    assert torch.equal(arrange(prompt_ids, completion_ids, merged.source), merged.input_ids)


def test_pack_sequences_rejects_a_non_prefix_mask():
    with pytest.raises(ValueError, match=r"completion_mask rows \[0\] are not prefix masks"):
        pack_sequences(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long),
                       torch.ones(1, 3, dtype=torch.long), torch.tensor([[1, 0, 1]]))


def _random_experience(vocab_size, rows=5, prompt_len=7, completion_len=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompt_mask = torch.ones(rows, prompt_len, dtype=torch.long)
    completion_mask = torch.zeros(rows, completion_len, dtype=torch.long)
    for i in range(rows):
        prompt_mask[i, : int(torch.randint(0, prompt_len - 1, (1,), generator=g))] = 0
        completion_mask[i, : int(torch.randint(1, completion_len + 1, (1,), generator=g))] = 1
    completion_mask[2] = 0  # a row without loss tokens (masked / unscored)
    return Experience(
        prompt_ids=torch.randint(0, vocab_size, (rows, prompt_len), generator=g) * prompt_mask,
        prompt_mask=prompt_mask,
        completion_ids=torch.randint(0, vocab_size, (rows, completion_len), generator=g),
        completion_mask=completion_mask,
        advantages=torch.zeros(rows),
    )


@pytest.mark.parametrize(
    "shared_prefix, packed_row_tokens",
    # prompt once per group (one group per pass, all groups in one pass); one sequence per row; one row; a few rows
    [(True, None), (True, 10**6), (False, None), (False, 10**6), (False, 20)],
)
def test_packed_logprobs_and_gradients_equal_the_padded_ones(tiny_llama_path, shared_prefix, packed_row_tokens):
    config = GRPOConfig(temperature=0.7, packed_row_tokens=packed_row_tokens, shared_prefix=shared_prefix)
    module = GRPOModule(tiny_llama_path, reward_funcs=["gsm8k_accuracy"], config=config)
    module.policy.eval()
    batch = _random_experience(module.policy.config.vocab_size, rows=6)
    # two groups sharing a prompt (rows 0, 1, 3 and rows 4, 5; row 2 has no loss tokens), as in a GRPO rollout
    for group in ([0, 1, 3], [4, 5]):
        batch.prompt_ids[group] = batch.prompt_ids[group[0]].clone()
        batch.prompt_mask[group] = batch.prompt_mask[group[0]].clone()
    weights = torch.randn(batch.completion_mask.shape, generator=torch.Generator().manual_seed(1))
    results = {}
    for padding_free in (False, True):
        module.config.padding_free = padding_free
        module.policy.zero_grad(set_to_none=True)
        logprobs, entropy = module.completion_logprobs(module.policy, batch, with_entropy=True, entropy_grad=True)
        mask = batch.completion_mask.bool()
        ((logprobs * weights)[mask].sum() + entropy[mask].sum()).backward()
        grads = {n: p.grad.clone() for n, p in module.policy.named_parameters()}
        results[padding_free] = (logprobs.detach(), entropy.detach(), grads)
    (lp_pad, ent_pad, g_pad), (lp_pack, ent_pack, g_pack) = results[False], results[True]
    mask = batch.completion_mask.bool()
    assert lp_pack.shape == lp_pad.shape
    torch.testing.assert_close(lp_pack[mask], lp_pad[mask], atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_pack[mask], ent_pad[mask], atol=1e-5, rtol=0)
    assert (lp_pack[~mask] == 0).all()  # rows and positions without loss tokens are not computed
    assert lp_pad[mask].abs().min() > 0  # real values, not an all-zero agreement
    for name, grad in g_pad.items():
        torch.testing.assert_close(g_pack[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    assert sum(float(g.abs().sum()) for g in g_pad.values()) > 0


def test_token_budget_partition_golden_balanced_split():
    # FFD needs 3 micro-batches of <= 6 tokens; the balanced (LPT) split gives each exactly 6
    assert token_budget_partition([5, 4, 3, 3, 2, 1], 6) == [[0, 5], [1, 4], [2, 3]]
    # a sequence over the budget gets a micro-batch of its own
    assert token_budget_partition([10, 2, 2], 4) == [[0], [1, 2]]
    assert token_budget_partition([], 4) == []
    with pytest.raises(ValueError, match="max_tokens_per_microbatch=0"):
        token_budget_partition([1], 0)


@pytest.mark.parametrize("seed", range(20))
def test_token_budget_partition_never_drops_duplicates_or_overfills(seed):
    rng = random.Random(seed)
    counts = [rng.randint(1, 50) for _ in range(rng.randint(1, 40))]
    budget = rng.randint(10, 120)
    parts = token_budget_partition(counts, budget)
    flat = sorted(i for part in parts for i in part)
    assert flat == list(range(len(counts)))
    for part in parts:
        assert sum(counts[i] for i in part) <= budget or len(part) == 1
    # never more micro-batches than one per sequence, never fewer than the budget allows
    assert -(-sum(min(c, budget) for c in counts) // budget) <= len(parts) <= len(counts)


def test_micro_batches_by_token_budget_cover_each_sequence_once_per_pass():
    batch = _random_experience(100, rows=8, seed=3)
    batch.advantages = torch.arange(8, dtype=torch.float32)
    counts = sequence_token_counts(batch.prompt_mask, batch.completion_mask)
    budget = int(counts.max()) + 3
    micro = list(micro_batches(batch, mini_batch_size=4, accumulate_grad_batches=1, num_iterations=2,
                               loss_type="grpo", max_new_tokens=6, generator=torch.Generator().manual_seed(0),
                               max_tokens_per_microbatch=budget))
    steps, current = [], []
    for m in micro:
        assert int(sequence_token_counts(m.prompt_mask, m.completion_mask).sum()) <= budget or len(m) == 1
        assert m.step_start == (not current)
        current.append(m)
        if m.step_end:
            steps.append(current)
            current = []
    assert not current and len(steps) == 4  # 2 mini-batches x 2 passes
    for step in steps:
        assert len({m.loss_normalizer for m in step}) == 1  # the mini-batch's normalizer on every micro-batch
    for first, second in (steps[:2], steps[2:]):
        seen = sorted(int(a) for m in first + second for a in m.advantages)
        assert seen == list(range(8))
    with pytest.raises(ValueError, match=r"accumulate_grad_batches=1\), not 2"):
        next(micro_batches(batch, mini_batch_size=4, accumulate_grad_batches=2, num_iterations=1, loss_type="grpo",
                           max_new_tokens=6, max_tokens_per_microbatch=budget))
