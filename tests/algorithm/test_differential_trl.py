"""Differential tests: our GRPO loss, advantages and importance weights against TRL 1.16's own code.

TRL's code is called, not re-implemented: the loss through ``GRPOTrainer.compute_loss`` (-> ``_compute_loss``), the
advantages and rollout importance ratios through ``GRPOTrainer._generate_and_score_completions`` (with TRL's own
``_calculate_rewards`` and reward functions), the high-entropy selection through ``get_high_entropy_mask``. The
trainer is a real ``GRPOTrainer`` built from a ``trl.GRPOConfig`` on a 1-layer random Llama, so every knob reaches
TRL's loss through TRL's own config handling (e.g. ``epsilon`` -> ``epsilon_low``). Only *inputs* are supplied:

* ``_get_per_token_logps_and_entropies`` (the model forward) returns our random logprobs / entropies;
* ``_generate`` (the generation backend) returns our token ids and sampler logprobs;
* ``current_gradient_accumulation_steps`` and ``model.train()``, which TRL's training loop sets before each step;
* ``use_vllm = True`` for the importance-sampling tests (building with ``use_vllm=True`` would start a vLLM
  engine; generation is supplied by ``_generate`` instead).

Where the definitions agree the tests assert equality (1e-6) of the loss and of its gradient; where they differ on
purpose (docs/algorithm.md, "Differences from TRL") they assert the documented relation. The rollout correction
(issue 33): the two-sided importance weight (TRL's ``vllm_importance_sampling_clip_min``/``_clip_max``, IcePop) and
DeepSeek-V3.2's off-policy sequence mask (``off_policy_mask_threshold``) are TRL's own; TRL has no geometric-mean or
KL-estimate mask and no bypass mode.
"""

import math

import pytest
import torch

trl = pytest.importorskip("trl", reason="trl is not installed: pip install -e '.[test]' (pins trl==1.16.0)")
if not trl.__version__.startswith("1.16."):
    pytest.skip(f"these tests pin TRL's 1.16 code; trl {trl.__version__} is installed", allow_module_level=True)

from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from tokenizers.models import WordLevel  # noqa: E402
from tokenizers.pre_tokenizers import Whitespace  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from trl import GRPOConfig as TRLConfig  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from lightning_grpo import functional as F  # noqa: E402
from lightning_grpo.algorithm import grpo_objective, high_entropy_mask, rollout_importance_weights  # noqa: E402
from lightning_grpo.config import GRPOConfig  # noqa: E402
from lightning_grpo.rewards.scoring import score_completions  # noqa: E402

G, T = 4, 6  # group size, completion tokens
N = 2 * G  # two prompts
PAD, EOS = 0, 1
ATOL = 1e-6


def reward_a(prompts, completions, r_a, **kwargs):
    return list(r_a)


def reward_b(prompts, completions, r_b, **kwargs):
    return list(r_b)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A saved 1-layer random Llama (vocabulary of 16 words) and its word-level tokenizer; its forward is never used."""
    vocab = {"<pad>": PAD, "<eos>": EOS, **{f"w{i}": i + 2 for i in range(14)}}
    backend = Tokenizer(WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, eos_token_id=EOS, pad_token_id=PAD)
    path = tmp_path_factory.mktemp("trl_tiny_llama")
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), tokenizer


@pytest.fixture
def make_trainer(tiny_model, tmp_path):
    """``make_trainer(gas=1, **trl_config_kwargs)``: a real TRL ``GRPOTrainer`` in its training-step state."""
    path, tokenizer = tiny_model

    def make(gas: int = 1, batch: int = N, **kwargs) -> GRPOTrainer:
        args = TRLConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to=[], save_strategy="no",
                         per_device_train_batch_size=batch, gradient_accumulation_steps=gas, num_generations=G,
                         max_completion_length=T, **kwargs)
        trainer = GRPOTrainer(model=path, reward_funcs=[reward_a, reward_b], args=args, processing_class=tokenizer,
                              train_dataset=Dataset.from_dict({"prompt": ["w1 w2"] * 2}))
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = gas  # set by Trainer's loop: micro-batches of this step
        return trainer

    return make


def _data(seed: int, empty_rows: tuple[int, ...] = ()) -> dict[str, torch.Tensor]:
    """Random float32 logprobs (current, old, ref, sampler), entropies, advantages, and a right-padded mask."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (N,), generator=g)
    lengths[:2] = T
    mask = (torch.arange(T) < lengths[:, None]).long()  # [N, T]
    for row in empty_rows:
        mask[row] = 0
    logps = -3.0 * torch.rand(N, T, generator=g) - 0.05
    old = logps + 0.5 * torch.randn(N, T, generator=g)
    advantages = torch.randn(N, generator=g)
    advantages[0], advantages[1] = advantages[0].abs(), -advantages[1].abs()  # rows 0 and 1 have T tokens
    old[0, 0] = logps[0, 0] - 1.0  # ratio e > 1 + epsilon_high with A > 0: clipped high
    old[1, 0] = logps[1, 0] - 1.0  # ratio e > delta with A < 0: the delta cap acts
    old[1, 1] = logps[1, 1] + 1.0  # ratio 1/e < 1 - epsilon_low with A < 0: clipped low
    return {
        "logps": logps,
        "old": old,
        "ref": logps + 0.5 * torch.randn(N, T, generator=g),
        "sampler": old + 0.4 * torch.randn(N, T, generator=g),
        "entropy": 2.0 * torch.rand(N, T, generator=g),
        "advantages": advantages,
        "mask": mask,
    }


def _trl_loss(trainer, logps, mask, advantages, *, old=None, ref=None, entropy=None, is_ratio=None, num_items=None,
              sampling=None):
    """TRL's ``compute_loss`` on supplied per-token logprobs (and entropies) of a micro-batch."""
    n, t = logps.shape
    entropies = torch.zeros_like(logps) if entropy is None else entropy

    def supplied_forward(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        assert logits_to_keep == t and input_ids.shape == (n, 1 + t)
        return logps, entropies, None

    trainer._get_per_token_logps_and_entropies = supplied_forward
    inputs = {
        "prompt_ids": torch.full((n, 1), 2), "prompt_mask": torch.ones(n, 1, dtype=torch.long),
        "completion_ids": torch.full((n, t), 3), "completion_mask": mask.long(), "advantages": advantages,
        "num_items_in_batch": mask.sum() if num_items is None else num_items,
    }
    for key, value in (("old_per_token_logps", old), ("ref_per_token_logps", ref),
                       ("importance_sampling_ratio", is_ratio), ("sampling_per_token_logps", sampling)):
        if value is not None:
            inputs[key] = value
    return trainer.compute_loss(trainer.model, inputs)


def _value_and_grads(loss_fn, *leaves: torch.Tensor):
    """``loss_fn(*leaves)`` and its gradient with respect to each leaf (fresh copies that require grad)."""
    leaves = tuple(x.detach().clone().requires_grad_(True) for x in leaves)
    loss = loss_fn(*leaves)
    return loss.detach(), torch.autograd.grad(loss, leaves)


def _assert_same(ours, theirs):
    (ours_loss, ours_grads), (trl_loss, trl_grads) = ours, theirs
    torch.testing.assert_close(ours_loss, trl_loss, atol=ATOL, rtol=0)
    for mine, reference in zip(ours_grads, trl_grads, strict=True):
        torch.testing.assert_close(mine, reference, atol=ATOL, rtol=0)


# case: (our GRPOConfig knobs, the TRL GRPOConfig knobs, off-policy old logprobs). TRL's use_bias_correction_kl
# (default True) is switched off here; its own test is below.
CASES = {
    "on_policy": ({}, {}, False),
    "off_policy": ({}, {}, True),
    "clip_higher": ({"epsilon_high": 0.28}, {"epsilon_high": 0.28}, True),
    "two_sided_delta": ({"epsilon_high": 0.28, "delta": 1.5}, {"epsilon_high": 0.28, "delta": 1.5}, True),
    "eps_0.1_beta": ({"epsilon_low": 0.1, "epsilon_high": 0.1, "beta": 0.04},
                     {"epsilon": 0.1, "beta": 0.04, "use_bias_correction_kl": False}, True),
    "all": ({"epsilon_high": 0.28, "delta": 1.6, "beta": 0.1},
            {"epsilon_high": 0.28, "delta": 1.6, "beta": 0.1, "use_bias_correction_kl": False}, True),
}


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("case", list(CASES))
def test_loss_and_gradient_match_trl(make_trainer, loss_type, case):
    ours_kwargs, trl_kwargs, off_policy = CASES[case]
    d = _data(seed=len(case) * 7 + len(loss_type))
    old = d["old"] if off_policy else None
    with_ref = "beta" in ours_kwargs
    config = GRPOConfig(loss_type=loss_type, max_new_tokens=T, **ours_kwargs)
    trainer = make_trainer(loss_type=loss_type, **trl_kwargs)
    ref = d["ref"] if with_ref else None

    ours = _value_and_grads(lambda lp: grpo_objective(lp, d["mask"], d["advantages"], config, old_logprobs=old,
                                                      ref_logprobs=ref).loss, d["logps"])
    theirs = _value_and_grads(lambda lp: _trl_loss(trainer, lp, d["mask"], d["advantages"], old=old, ref=ref),
                              d["logps"])
    _assert_same(ours, theirs)
    assert ours[0].abs() > 1e-3 and ours[1][0].abs().sum() > 1e-3  # a real loss with a real gradient
    if off_policy:  # the clipped regions and the delta cap are exercised, not only the unclipped ratio
        out = grpo_objective(d["logps"], d["mask"], d["advantages"], config, old_logprobs=old)
        assert (out.clip.low & out.mask).any() and (out.clip.high & out.mask).any()
        if config.delta is not None:
            capped = (out.clip.ratio > config.delta) & (d["advantages"] < 0).unsqueeze(1) & out.mask
            assert capped.any()


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
@pytest.mark.parametrize("off_policy", [True, False])
def test_kl_bias_correction_is_trl_default(make_trainer, loss_type, off_policy):
    """TRL 1.16's default ``use_bias_correction_kl=True`` multiplies the per-token k3 KL by the policy ratio
    ``pi / pi_old`` (DeepSeek-V3.2); ours does not (DeepSeekMath eq. 3/4). Documented relation: TRL's loss is ours
    with ``beta * k3`` replaced by ``beta * k3 * ratio``, built from our own functional pieces; on-policy the values
    agree and only the gradients differ (the ratio is 1 with gradient 1)."""
    d = _data(seed=11)
    beta, mask, adv = 0.1, d["mask"], d["advantages"]
    config = GRPOConfig(loss_type=loss_type, max_new_tokens=T, beta=beta)
    trainer = make_trainer(loss_type=loss_type, beta=beta)
    assert trainer.args.use_bias_correction_kl

    def ours_with_ratio_weighted_kl(lp, old):
        old = lp.detach() if old is None else old
        policy, _ = F.policy_loss(lp, old, adv, config.epsilon_low, config.epsilon_high)
        ratio = torch.exp(lp - old)
        return F.aggregate_loss(policy + beta * F.kl_penalty(lp, d["ref"]) * ratio, mask, loss_type, T)

    old = d["old"] if off_policy else None
    theirs = _value_and_grads(lambda lp: _trl_loss(trainer, lp, mask, adv, old=old, ref=d["ref"]), d["logps"])
    _assert_same(_value_and_grads(lambda lp: ours_with_ratio_weighted_kl(lp, old), d["logps"]), theirs)
    ours = _value_and_grads(lambda lp: grpo_objective(lp, mask, adv, config, old_logprobs=old,
                                                      ref_logprobs=d["ref"]).loss, d["logps"])
    assert (ours[1][0] - theirs[1][0]).abs().max() > 1e-4  # the KL gradients differ
    if not off_policy:
        torch.testing.assert_close(ours[0], theirs[0], atol=ATOL, rtol=0)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_completion_without_loss_tokens(make_trainer, loss_type):
    """A completion with an all-zero mask (truncated under mask_truncated_completions, or unscored): "grpo" leaves it
    out of the mean over sequences, TRL keeps it as a zero, so ours == TRL * N / (N - empty); the other loss types
    agree (token counts, or the constant N * max_completion_length of "dr_grpo")."""
    empty = (2, 5)
    d = _data(seed=3, empty_rows=empty)
    config = GRPOConfig(loss_type=loss_type, max_new_tokens=T)
    trainer = make_trainer(loss_type=loss_type)
    ours = grpo_objective(d["logps"], d["mask"], d["advantages"], config, old_logprobs=d["old"]).loss
    theirs = _trl_loss(trainer, d["logps"], d["mask"], d["advantages"], old=d["old"])
    factor = N / (N - len(empty)) if loss_type == "grpo" else 1.0
    torch.testing.assert_close(ours, theirs * factor, atol=ATOL, rtol=0)
    assert ours.abs() > 1e-3


def test_accumulated_step_matches_trl(make_trainer):
    """One optimizer step of two micro-batches (TRL: gradient_accumulation_steps = steps_per_generation = 2). Ours
    divides every micro-batch by the step's denominator (``loss_normalizer`` summed over the micro-batches); TRL's
    "grpo"/"dr_grpo" divide by the micro-batch's and by the accumulation steps, its "dapo" by the step's tokens.
    Equal-sized micro-batches: "grpo", "dr_grpo" and "dapo" agree; our "bnpo" is TRL's "dapo", and TRL's "bnpo" (a
    token mean per micro-batch) relates to ours by micro-batch factor ``2 * tokens_mb / tokens_step``."""
    d = _data(seed=5)
    halves = (slice(0, G), slice(G, N))
    step_tokens = d["mask"].sum()
    assert d["mask"][halves[0]].sum() != d["mask"][halves[1]].sum()  # else "bnpo" could not tell the two apart

    def ours_step(loss_type):
        config = GRPOConfig(loss_type=loss_type, max_new_tokens=T)
        normalizer = sum(F.loss_normalizer(d["mask"][h], loss_type, T) for h in halves)
        return [grpo_objective(d["logps"][h], d["mask"][h], d["advantages"][h], config, old_logprobs=d["old"][h],
                               normalizer=normalizer).loss for h in halves]

    def trl_step(loss_type):
        trainer = make_trainer(gas=2, batch=G, loss_type=loss_type)
        assert trainer.args.steps_per_generation == 2
        return [_trl_loss(trainer, d["logps"][h], d["mask"][h], d["advantages"][h], old=d["old"][h],
                          num_items=step_tokens) for h in halves]

    for loss_type in ("grpo", "dr_grpo", "dapo"):
        torch.testing.assert_close(sum(ours_step(loss_type)), sum(trl_step(loss_type)), atol=ATOL, rtol=0)
    ours_bnpo, trl_bnpo = ours_step("bnpo"), trl_step("bnpo")
    torch.testing.assert_close(sum(ours_bnpo), sum(trl_step("dapo")), atol=ATOL, rtol=0)
    for h, mine, theirs in zip(halves, ours_bnpo, trl_bnpo, strict=True):
        torch.testing.assert_close(mine, theirs * 2 * d["mask"][h].sum() / step_tokens, atol=ATOL, rtol=0)
    assert abs(sum(ours_bnpo) - sum(trl_bnpo)) > 1e-4


@pytest.mark.parametrize("quantile", [0.2, 0.5])
def test_high_entropy_selection_matches_trl(make_trainer, quantile):
    d = _data(seed=7)
    trainer = make_trainer(loss_type="grpo", top_entropy_quantile=quantile)
    selected = high_entropy_mask(d["entropy"], d["mask"], quantile)
    assert torch.equal(selected, trainer.get_high_entropy_mask(d["entropy"], d["mask"], 1 - quantile))
    assert 0 < selected.sum() < d["mask"].sum()
    config = GRPOConfig(loss_type="grpo", max_new_tokens=T, top_entropy_quantile=quantile)
    ours = _value_and_grads(lambda lp: grpo_objective(lp, d["mask"], d["advantages"], config, old_logprobs=d["old"],
                                                      entropy=d["entropy"]).loss, d["logps"])
    theirs = _value_and_grads(lambda lp: _trl_loss(trainer, lp, d["mask"], d["advantages"], old=d["old"],
                                                   entropy=d["entropy"]), d["logps"])
    _assert_same(ours, theirs)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo"])
@pytest.mark.parametrize("quantile", [1.0, 0.5])
def test_entropy_bonus_versus_trl(make_trainer, loss_type, quantile):
    """Entropy bonus ``- entropy_coef * H``. Ours aggregates H per token like the loss (``loss_type``) over every
    loss token; TRL 1.16 subtracts ``coef * token_mean(H)`` over the tokens that get the policy loss (the
    high-entropy ones when ``top_entropy_quantile < 1``). Equal for the token-mean loss types with every token kept;
    otherwise ours - TRL == coef * (TRL's entropy mean - our aggregated entropy)."""
    coef = 0.05
    d = _data(seed=9)
    mask, entropy = d["mask"], d["entropy"]
    config = GRPOConfig(loss_type=loss_type, max_new_tokens=T, entropy_coef=coef, top_entropy_quantile=quantile)
    trainer = make_trainer(loss_type=loss_type, entropy_coef=coef, top_entropy_quantile=quantile)
    ours = _value_and_grads(lambda lp, h: grpo_objective(lp, mask, d["advantages"], config, old_logprobs=d["old"],
                                                         entropy=h).loss, d["logps"], entropy)
    theirs = _value_and_grads(lambda lp, h: _trl_loss(trainer, lp, mask, d["advantages"], old=d["old"], entropy=h),
                              d["logps"], entropy)
    torch.testing.assert_close(ours[1][0], theirs[1][0], atol=ATOL, rtol=0)  # the policy-loss gradient agrees
    selected = high_entropy_mask(entropy, mask, quantile)
    trl_entropy = F.masked_mean(entropy, selected)
    our_entropy = F.aggregate_loss(entropy, mask, loss_type, T)
    if quantile == 1.0 and loss_type != "grpo":
        _assert_same(ours, theirs)
    else:
        assert abs(trl_entropy - our_entropy) > 1e-3
        torch.testing.assert_close(ours[0] - theirs[0], coef * (trl_entropy - our_entropy), atol=ATOL, rtol=0)


def _rollout(seed: int, constant_group: bool = False):
    """N completions (token ids ending in EOS, lengths 1..T), two reward columns with None entries (row 6 has no
    reward at all: unscored), and vLLM-style sampler logprobs."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (N,), generator=g).tolist()
    completion_ids = [torch.randint(2, 16, (n - 1,), generator=g).tolist() + [EOS] for n in lengths]
    r_a = torch.randint(0, 2, (N,), generator=g).float().tolist()
    r_b = (torch.rand(N, generator=g) - 0.5).tolist()
    r_b[1] = None  # scored by reward_a only
    r_a[6], r_b[6] = None, None  # unscored
    if constant_group:
        r_a[:G], r_b[:G] = [1.0] * G, [0.1] * G
    sampler = [(-3.0 * torch.rand(n, generator=g) - 0.05).tolist() for n in lengths]
    mask = (torch.arange(T) < torch.tensor(lengths)[:, None]).long()
    old = torch.tensor([s + [0.0] * (T - len(s)) for s in sampler]) + 0.4 * torch.randn(N, T, generator=g) * mask
    return completion_ids, r_a, r_b, sampler, mask, old


def _trl_score(trainer, completion_ids, r_a, r_b, sampler, old):
    """TRL's ``_generate_and_score_completions`` on supplied completions, rewards and logprobs."""
    prompt_ids = [[2, 3]] * N

    def supplied_generation(prompts):
        assert len(prompts) == N
        return prompt_ids, completion_ids, None, ["c"] * N, sampler, {}, None, []

    def supplied_forward(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        return old, None, None

    trainer._generate = supplied_generation
    trainer._get_per_token_logps_and_entropies = supplied_forward
    inputs = [{"prompt": "w1 w2", "r_a": a, "r_b": b} for a, b in zip(r_a, r_b, strict=True)]
    return trainer._generate_and_score_completions(inputs)


def _our_advantages(r_a, r_b, weights, scale_rewards):
    scores = score_completions([reward_a, reward_b], ["w1 w2"] * N, ["c"] * N, {"r_a": r_a, "r_b": r_b}, weights)
    scored = ~torch.isnan(scores.rewards)
    return F.group_advantages(scores.rewards, G, scale_rewards, 1e-4, valid=scored)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_advantages_match_trl(make_trainer, scale_rewards):
    """TRL's advantage path (``_calculate_rewards``, weighted ``nansum``, group ``nanmean``/``nanstd``, eps 1e-4,
    unscored completions at 0) against ours (``score_completions`` + ``group_advantages``)."""
    weights = [1.0, 0.5]
    completion_ids, r_a, r_b, sampler, _, old = _rollout(seed=1)
    trainer = make_trainer(scale_rewards=scale_rewards, reward_weights=weights)
    trl_advantages = _trl_score(trainer, completion_ids, r_a, r_b, sampler, old)["advantages"]
    ours = _our_advantages(r_a, r_b, weights, scale_rewards)
    torch.testing.assert_close(ours, trl_advantages, atol=ATOL, rtol=0)
    assert ours[6] == 0 and (ours != 0).sum() >= N - 2


def test_constant_group_matches_trl(make_trainer):
    """A group whose rewards are all equal gets exactly 0 in both (ours special-cases it, functional.
    group_advantages; TRL divides ``r - mean``, exactly 0 here, by ``0 + 1e-4``); the other group agrees."""
    completion_ids, r_a, r_b, sampler, _, old = _rollout(seed=2, constant_group=True)
    trainer = make_trainer(scale_rewards="group", reward_weights=[1.0, 0.3])
    trl_advantages = _trl_score(trainer, completion_ids, r_a, r_b, sampler, old)["advantages"]
    ours = _our_advantages(r_a, r_b, [1.0, 0.3], "group")
    assert torch.equal(ours[:G], torch.zeros(G)) and torch.equal(trl_advantages[:G], torch.zeros(G))
    torch.testing.assert_close(ours[G:], trl_advantages[G:], atol=ATOL, rtol=0)
    assert (ours[G:] != 0).sum() >= G - 1


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_importance_sampling_matches_trl(make_trainer, level, mode):
    """Our TIS weights (``importance_sampling_level/mode/cap``) against TRL's ``vllm_importance_sampling_mode=
    f"{level}_{mode}"`` with ``vllm_importance_sampling_clip_max = cap``, and the loss weighted by them."""
    cap = 2.0
    completion_ids, r_a, r_b, sampler, mask, old = _rollout(seed=4)
    trainer = make_trainer(loss_type="dapo", vllm_importance_sampling_mode=f"{level}_{mode}",
                           vllm_importance_sampling_clip_max=cap)
    trainer.use_vllm = True
    batch = _trl_score(trainer, completion_ids, r_a, r_b, sampler, old)
    assert torch.equal(batch["completion_mask"], mask)
    sampler_logps = batch["sampling_per_token_logps"]
    ours = rollout_importance_weights(old, sampler_logps, mask, cap, level, mode)
    theirs = batch["importance_sampling_ratio"].expand(N, T)
    torch.testing.assert_close(ours[mask.bool()], theirs[mask.bool()], atol=ATOL, rtol=1e-6)
    changed = (ours != 0) if mode == "mask" else (ours != cap)
    assert not changed[mask.bool()].all()  # the cap is reached somewhere

    config = GRPOConfig(loss_type="dapo", max_new_tokens=T, importance_sampling_cap=cap,
                        rollout_importance_sampling_level=level, importance_sampling_mode=mode)
    logps = old + 0.3 * torch.randn(N, T, generator=torch.Generator().manual_seed(0))
    adv = batch["advantages"]
    ours_loss = _value_and_grads(lambda lp: grpo_objective(lp, mask, adv, config, old_logprobs=old,
                                                           sampler_logprobs=sampler_logps).loss, logps)
    theirs_loss = _value_and_grads(lambda lp: _trl_loss(trainer, lp, mask, adv, old=old,
                                                        is_ratio=batch["importance_sampling_ratio"]), logps)
    _assert_same(ours_loss, theirs_loss)


def test_log_ratio_clamp_is_ours_only(make_trainer):
    """Ours clamps every log-ratio to +-20 before exp (functional.LOG_RATIO_CLAMP); TRL does not. A token with
    log(pi / pi_old) = 25 and A = -1: TRL's loss is exp(25), ours exp(20). Inside the clamp they agree."""
    mask = torch.ones(1, 2, dtype=torch.long)
    logps, old = torch.tensor([[-1.0, -1.0]]), torch.tensor([[-26.0, -1.5]])
    adv = torch.tensor([-1.0])
    ours = F.policy_loss(logps, old, adv.unsqueeze(1).expand(1, 2))[0]
    trainer = make_trainer(loss_type="dapo")
    theirs_first = _trl_loss(trainer, logps[:, :1], mask[:, :1], adv, old=old[:, :1])
    theirs_second = _trl_loss(trainer, logps[:, 1:], mask[:, 1:], adv, old=old[:, 1:])
    torch.testing.assert_close(ours[0, 0], theirs_first * math.exp(-5), rtol=1e-6, atol=0)
    torch.testing.assert_close(ours[0, 1], theirs_second, atol=ATOL, rtol=0)
    assert theirs_first > 1e10


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_gspo_sequence_ratio_matches_trl(make_trainer, loss_type):
    """GSPO (``importance_sampling_level="sequence"``, arXiv:2507.18071 eq. 5-7) against TRL 1.16's own sequence-level
    ratio, off-policy with GSPO's tight clip range (3e-4 / 4e-4), so some sequences are clipped: loss and gradient
    equal to 1e-6 (TRL puts the sequence's loss on each of its tokens and aggregates by ``loss_type``, as ours)."""
    d = _data(seed=29)
    eps_low, eps_high = 3e-4, 4e-4
    old = d["logps"].detach() + 1e-3 * torch.randn(d["logps"].shape, generator=torch.Generator().manual_seed(5))
    config = GRPOConfig(loss_type=loss_type, max_new_tokens=T, importance_sampling_level="sequence",
                        epsilon_low=eps_low, epsilon_high=eps_high)
    trainer = make_trainer(loss_type=loss_type, importance_sampling_level="sequence", epsilon=eps_low,
                           epsilon_high=eps_high)
    ours = _value_and_grads(lambda lp: grpo_objective(lp, d["mask"], d["advantages"], config,
                                                      old_logprobs=old).loss, d["logps"])
    theirs = _value_and_grads(lambda lp: _trl_loss(trainer, lp, d["mask"], d["advantages"], old=old), d["logps"])
    _assert_same(ours, theirs)
    out = grpo_objective(d["logps"], d["mask"], d["advantages"], config, old_logprobs=old)
    clipped = (out.clip.low | out.clip.high) & out.mask
    assert clipped.any() and not clipped.all()  # some sequences clipped, some not


# ------------------------------------------------------------------------------- rollout correction (issue 33)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_two_sided_importance_sampling_matches_trl(make_trainer, level, mode):
    """The two-sided weight (``importance_sampling_min`` and ``importance_sampling_cap``; with "mask" at the token
    level this is IcePop) against TRL's ``vllm_importance_sampling_clip_min`` / ``_clip_max``: weights, loss and
    gradient. Bounds [0.8, 1.25] so that both bounds act on this rollout."""
    low, cap = 0.8, 1.25
    completion_ids, r_a, r_b, sampler, mask, old = _rollout(seed=4)
    trainer = make_trainer(loss_type="dapo", vllm_importance_sampling_mode=f"{level}_{mode}",
                           vllm_importance_sampling_clip_min=low, vllm_importance_sampling_clip_max=cap)
    trainer.use_vllm = True
    batch = _trl_score(trainer, completion_ids, r_a, r_b, sampler, old)
    sampler_logps = batch["sampling_per_token_logps"]
    ours = rollout_importance_weights(old, sampler_logps, mask, cap, level, mode, low=low)
    theirs = batch["importance_sampling_ratio"].expand(N, T)
    torch.testing.assert_close(ours[mask.bool()], theirs[mask.bool()], atol=ATOL, rtol=1e-6)
    raw = rollout_importance_weights(old, sampler_logps, mask, 1e9, level, "truncate", low=1e-9)[mask.bool()]
    assert (raw < low).any() and (raw > cap).any()  # both bounds act

    config = GRPOConfig(loss_type="dapo", max_new_tokens=T, importance_sampling_cap=cap, importance_sampling_min=low,
                        rollout_importance_sampling_level=level, importance_sampling_mode=mode)
    logps = old + 0.3 * torch.randn(N, T, generator=torch.Generator().manual_seed(0))
    adv = batch["advantages"]
    ours_loss = _value_and_grads(lambda lp: grpo_objective(lp, mask, adv, config, old_logprobs=old,
                                                           sampler_logprobs=sampler_logps).loss, logps)
    theirs_loss = _value_and_grads(lambda lp: _trl_loss(trainer, lp, mask, adv, old=old,
                                                        is_ratio=batch["importance_sampling_ratio"]), logps)
    _assert_same(ours_loss, theirs_loss)


@pytest.mark.filterwarnings("ignore:importance_sampling_level='sequence' with loss_type")
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("with_sampler", [True, False])
def test_off_policy_sequence_mask_matches_trl(make_trainer, level, loss_type, with_sampler):
    """DeepSeek-V3.2's off-policy sequence mask (``correction.off_policy_mask_threshold`` = TRL's
    ``off_policy_mask_threshold``): loss and gradient equal TRL's ``compute_loss`` (which reads the sampler's logprobs,
    or the old policy's without them), off-policy, at the token and the sequence (GSPO) level. Some negative-advantage
    sequences are masked, not all."""
    from lightning_grpo.config.correction import CorrectionConfig

    d = _data(seed=31 + len(loss_type))
    threshold = 0.05
    sampler = d["sampler"] if with_sampler else None
    eps = {} if level == "token" else {"epsilon_low": 3e-3, "epsilon_high": 4e-3}
    config = GRPOConfig(loss_type=loss_type, max_new_tokens=T, importance_sampling_level=level, **eps,
                        correction=CorrectionConfig(off_policy_mask_threshold=threshold))
    trl_eps = {} if level == "token" else {"epsilon": 3e-3, "epsilon_high": 4e-3}
    trainer = make_trainer(loss_type=loss_type, importance_sampling_level=level, off_policy_mask_threshold=threshold,
                           **trl_eps)

    def theirs_fn(lp):
        return _trl_loss(trainer, lp, d["mask"], d["advantages"], old=d["old"], sampling=sampler)

    ours = _value_and_grads(lambda lp: grpo_objective(lp, d["mask"], d["advantages"], config, old_logprobs=d["old"],
                                                      sampler_logprobs=sampler).loss, d["logps"])
    _assert_same(ours, _value_and_grads(theirs_fn, d["logps"]))
    out = grpo_objective(d["logps"], d["mask"], d["advantages"], config, old_logprobs=d["old"],
                         sampler_logprobs=sampler)
    rejected = ~out.correction.keep["off_policy"].all(dim=1)
    assert rejected.any() and not rejected[d["advantages"] < 0].all()
