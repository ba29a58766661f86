"""Environment tokens are context only: no loss, no gradient, not in any ``loss_type``'s normalizer; the forward
layouts attend to them; hand-computed losses of a two-turn episode.

The episode of row 0 (``M`` model, ``E`` environment token)::

    prompt | M M | E E E | M        (two model turns: 3 model tokens, 3 environment tokens)

row 1 is a one-turn completion of 2 model tokens. Advantages +1 and -1; the current logprobs differ from the old ones
by small offsets so the ratios are not 1 (and nothing is clipped).
"""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightning_grpo.algorithm import grpo_objective
from lightning_grpo.config import GRPOConfig
from lightning_grpo.functional import loss_normalizer
from lightning_grpo.training.experience import Experience, micro_batches
from lightning_grpo.training.logprobs import CompletionLogprobs

LOSS_TYPES = ["grpo", "bnpo", "token_mean", "dapo", "dr_grpo", "cispo"]
MODEL = torch.tensor([[1, 1, 0, 0, 0, 1], [1, 1, 0, 0, 0, 0]])  # completion_mask: the loss tokens
ENV = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0]])
DELTA = torch.tensor([[0.1, -0.1, 0.0, 0.0, 0.0, 0.05], [0.0, 0.1, 0.0, 0.0, 0.0, 0.0]])  # current - old
ADVANTAGES = torch.tensor([1.0, -1.0])
MAX_NEW = 10


def _objective(loss_type, logprobs, old, mask, **kwargs):
    config = GRPOConfig(num_generations=2, loss_type=loss_type, max_new_tokens=MAX_NEW,
                        **({"epsilon_low": 1.0, "epsilon_high": 0.2} if loss_type == "cispo" else {}), **kwargs)
    return grpo_objective(logprobs, mask, ADVANTAGES, config, old_logprobs=old,
                          normalizer=loss_normalizer(mask, loss_type, MAX_NEW))


def _hand(loss_type):
    """The loss worked by hand: per model token ``-A * r`` (PPO, unclipped) or ``-A * r * logprob`` (CISPO, weight
    r within [0, 1.2]), r = exp(delta)."""
    current = -1.0 + DELTA  # the current logprobs of the test
    rows = []
    for i, a in enumerate(ADVANTAGES.tolist()):
        terms = [-a * math.exp(DELTA[i, t]) * (float(current[i, t]) if loss_type == "cispo" else 1.0)
                 for t in range(6) if MODEL[i, t]]
        rows.append(terms)
    everything = [x for r in rows for x in r]
    if loss_type == "grpo":
        return sum(sum(r) / len(r) for r in rows) / 2
    if loss_type == "dr_grpo":
        return sum(everything) / (2 * MAX_NEW)
    return sum(everything) / 5  # bnpo, token_mean, dapo, cispo: the 5 model tokens


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_two_turn_loss_by_hand_and_no_gradient_on_environment_tokens(loss_type):
    current = (-1.0 + DELTA).requires_grad_()
    old = (current.detach() - DELTA)
    out = _objective(loss_type, current, old, MODEL)
    assert out.loss.item() == pytest.approx(_hand(loss_type), abs=1e-6)
    (grad,) = torch.autograd.grad(out.loss, current)
    assert (grad[ENV.bool()] == 0).all() and (grad[MODEL.bool()] != 0).all()
    # the normalizers count model tokens only (5 tokens, 2 sequences)
    assert loss_normalizer(MODEL, loss_type, MAX_NEW) == {"grpo": 2.0, "dr_grpo": 2.0 * MAX_NEW}.get(loss_type, 5.0)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_environment_positions_change_nothing(loss_type):
    """Garbage (NaN, inf, huge) current/old/ref/sampler logprobs at the environment positions, with KL and TIS on, give
    the same loss and gradient as the episode with its environment columns removed."""
    torch.manual_seed(0)
    current = (-1.0 + DELTA + 0.01 * torch.randn(2, 6))
    old = current - DELTA
    ref = current - 0.05
    sampler = current + 0.02
    env = ENV.bool()
    garbage = torch.tensor([float("nan"), float("inf"), -1e9])
    dirty = [t.clone() for t in (current, old, ref, sampler)]
    for t in dirty:
        t[0, 2:5] = garbage
    keep = [0, 1, 5]  # row 0's model tokens; row 1 has no tokens there but its masks are 0 at 2..5 too
    kwargs = dict(beta=0.1, importance_sampling_cap=2.0)

    def run(tensors, mask):
        lp = tensors[0].clone().requires_grad_()
        config = GRPOConfig(num_generations=2, loss_type=loss_type, max_new_tokens=MAX_NEW, **kwargs,
                            **({"epsilon_low": 1.0, "epsilon_high": 0.2} if loss_type == "cispo" else {}))
        out = grpo_objective(lp, mask, ADVANTAGES, config, old_logprobs=tensors[1], ref_logprobs=tensors[2],
                             sampler_logprobs=tensors[3], normalizer=loss_normalizer(mask, loss_type, MAX_NEW))
        (grad,) = torch.autograd.grad(out.loss, lp)
        return out.loss, grad

    loss, grad = run(dirty, MODEL)
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and (grad[env] == 0).all()
    compact_loss, compact_grad = run([t[:, keep] for t in (current, old, ref, sampler)], MODEL[:, keep])
    torch.testing.assert_close(loss, compact_loss, atol=1e-7, rtol=0)
    torch.testing.assert_close(grad[:, keep], compact_grad, atol=1e-7, rtol=0)


def test_step_normalizer_of_micro_batches_counts_model_tokens_only():
    """The normalizer the micro-batches carry is the mini-batch's model-token count, whatever the env tokens."""
    n = 4
    ones = torch.ones(n, 2, dtype=torch.long)
    experience = Experience(prompt_ids=ones, prompt_mask=ones,
                            completion_ids=torch.ones(n, 6, dtype=torch.long), completion_mask=MODEL.repeat(2, 1),
                            advantages=torch.ones(n), env_mask=ENV.repeat(2, 1))
    batches = list(micro_batches(experience, mini_batch_size=4, accumulate_grad_batches=2, num_iterations=1,
                                 loss_type="dapo", max_new_tokens=MAX_NEW))
    assert [b.loss_normalizer for b in batches] == [10.0, 10.0]
    assert all(b.env_mask.shape == b.completion_mask.shape for b in batches)


@pytest.fixture(scope="module")
def tiny(tiny_llama_path):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_llama_path, torch_dtype=torch.float32)


def _episode_batch():
    """Row 0: prompt (3, left-padded to 4) + model 2 + env 3 + model 1; row 1: prompt 4 + model 2; row 2: the same
    prompt as row 0 (a group) + model 1 + env 2 + model 2 + pad."""
    g = torch.Generator().manual_seed(3)
    prompt_ids = torch.randint(3, 500, (3, 4), generator=g)
    prompt_mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1], [0, 1, 1, 1]])
    prompt_ids[2] = prompt_ids[0]
    completion_ids = torch.randint(3, 500, (3, 6), generator=g)
    completion_mask = torch.tensor([[1, 1, 0, 0, 0, 1], [1, 1, 0, 0, 0, 0], [1, 0, 0, 1, 1, 0]])
    env_mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0], [0, 1, 1, 0, 0, 0]])
    return Experience(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                      completion_mask=completion_mask, advantages=torch.tensor([1.0, -1.0, 0.5]), env_mask=env_mask)


@pytest.mark.parametrize("layout", [dict(padding_free=False), dict(shared_prefix=False), dict()])
def test_layouts_attend_to_environment_tokens(tiny, layout):
    """Every layout gives, at each model token, the logprob of a plain forward over the whole sequence (the
    environment tokens in its context)."""
    batch = _episode_batch()
    ours, _ = CompletionLogprobs(GRPOConfig(num_generations=2, **layout))(tiny, batch)
    attended = batch.completion_attention_mask
    for i in range(3):
        ids = torch.cat([batch.prompt_ids[i][batch.prompt_mask[i].bool()],
                         batch.completion_ids[i][attended[i].bool()]])[None]
        with torch.no_grad():
            logits = tiny(input_ids=ids).logits[0]
        p = int(batch.prompt_mask[i].sum())
        expected = torch.log_softmax(logits[p - 1: -1].float(), dim=-1).gather(1, ids[0, p:, None]).squeeze(1)
        n = int(attended[i].sum())
        model = batch.completion_mask[i, :n].bool()
        torch.testing.assert_close(ours[i, :n][model], expected[model], atol=1e-5, rtol=0)
    # the environment tokens are context: changing one changes the later model token's logprob
    changed = _episode_batch()
    changed.completion_ids[0, 3] = (changed.completion_ids[0, 3] + 1) % 500
    again, _ = CompletionLogprobs(GRPOConfig(num_generations=2, **layout))(tiny, changed)
    assert (again[0, 5] - ours[0, 5]).abs() > 1e-6
    torch.testing.assert_close(again[0, :2], ours[0, :2], atol=1e-6, rtol=0)
