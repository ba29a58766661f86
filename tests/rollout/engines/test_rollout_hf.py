"""HFRolloutEngine samples from exactly the distribution GRPOConfig describes, whatever the checkpoint says.

* A checkpoint whose ``generation_config.json`` sets repetition penalty, no-repeat n-grams, bad words, suppressed
  tokens, a sequence bias, a forced EOS, a length penalty and its own temperature / top-k / top-p / min-p /
  typical-p (each one checked to change ``model.generate``'s output on the tiny model) gives the same completions
  as the clean checkpoint, greedy and sampled with the same seed.
* The distribution ``generate`` samples from (the log-softmax after every logits processor, recorded by the
  engine) equals the trainer's :func:`lightning_grpo.functional.token_logprobs` on a teacher-forced forward with
  the same temperature / top-k / top-p / min-p, token by token, on the polluted checkpoint; with top-k every
  sampled token is among the k most likely.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.rollout.engines.hf import HFRolloutEngine
from support.checkpoint_generation import SAMPLING_FIELDS, copy_with_generation_config, greedy_fields, trainer_logprobs

ATOL = 1e-4  # float32 KV-cached generate vs a float32 full forward; observed ~2e-6


def _load(path: str):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def tiny_llama_path(tiny_llama_full_vocab_path):
    """SmolLM2's whole vocabulary here: a truncation (top-k, top-p, min-p) of a random model's near-uniform
    distribution over 49,152 tokens removes enough mass that every kept logprob rises by more than 1e-2."""
    return tiny_llama_full_vocab_path


@pytest.fixture(scope="module")
def clean(tiny_llama_path):
    return _load(tiny_llama_path)


@pytest.fixture(scope="module")
def case(clean, tiny_llama_path, tmp_path_factory):
    """The prompt (the clean model's first greedy token, then a chat prompt: a repetition penalty bites at once), the
    clean greedy completion of 12 tokens, and the model loaded from a copy whose generation config sets everything."""
    model, tokenizer = clean
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is 7 times 6?"}],
                                         add_generation_prompt=True, return_dict=False)
    first = HFRolloutEngine(model, tokenizer).generate([chat], 1, SamplingConfig(1, greedy=True)).completion_ids
    prompt = [int(first[0, 0])] + list(chat)
    completion = HFRolloutEngine(model, tokenizer).generate([prompt], 1, SamplingConfig(12, greedy=True))
    tokens = completion.completion_ids[0].tolist()
    assert len(tokens) == 12 and not set(tokens) & set(HFRolloutEngine(model, tokenizer).eos_token_ids)
    fields = {**greedy_fields(tokens, tokenizer.eos_token_id), **SAMPLING_FIELDS}
    path = copy_with_generation_config(tiny_llama_path, tmp_path_factory.mktemp("polluted") / "model", **fields)
    polluted, _ = _load(path)
    assert polluted.generation_config.repetition_penalty == 1.3 and polluted.generation_config.top_k == 5
    return prompt, tokens, polluted


def _generate_with(model, prompt: list[int], seed: int = 0, **fields) -> list[int]:
    """``model.generate`` (12 new tokens) with ``fields`` set on its own generation config, as a checkpoint does."""
    saved = model.generation_config
    model.generation_config = saved.__class__.from_dict({**saved.to_dict(), **fields})
    try:
        torch.manual_seed(seed)
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12)
    finally:
        model.generation_config = saved
    return out[0, len(prompt):].tolist()


def test_every_polluting_field_changes_plain_generate(clean, case):
    model, tokenizer = clean
    prompt, tokens, _ = case
    assert _generate_with(model, prompt, do_sample=False) == tokens
    for name, value in greedy_fields(tokens, tokenizer.eos_token_id).items():
        assert _generate_with(model, prompt, do_sample=False, **{name: value}) != tokens, name
    plain = _generate_with(model, prompt, do_sample=True, temperature=1.0, top_k=0)
    assert _generate_with(model, prompt, **{**SAMPLING_FIELDS, "max_new_tokens": 12}) != plain


def test_checkpoint_generation_config_never_changes_a_rollout(clean, case):
    model, tokenizer = clean
    prompt, tokens, polluted = case
    checkpoint_config = polluted.generation_config
    prompts = [prompt, prompt[3:]]  # the shorter prompt exercises the left padding
    for sampling in (SamplingConfig(12, greedy=True), SamplingConfig(12, temperature=0.9),
                     SamplingConfig(12, temperature=1.2, top_k=40, top_p=0.95, min_p=0.1)):
        outputs = []
        for m in (model, polluted):
            torch.manual_seed(7)
            outputs.append(HFRolloutEngine(m, tokenizer).generate(prompts, 3, sampling))
        reference, out = outputs
        assert torch.equal(out.completion_ids, reference.completion_ids), sampling
        assert out.completions == reference.completions
        if sampling.greedy:
            assert out.completion_ids[0].tolist() == tokens
        else:  # sampling really happened: the G completions of a prompt differ
            assert not torch.equal(out.completion_ids[0], out.completion_ids[1])
    assert polluted.generation_config is checkpoint_config  # restored after every call


SETTINGS = [
    SamplingConfig(8, greedy=True),
    SamplingConfig(8, temperature=0.7),
    SamplingConfig(8, temperature=0.7, top_p=0.9),
    SamplingConfig(8, temperature=1.0, top_k=5),
    SamplingConfig(8, temperature=1.3, min_p=0.5),
    SamplingConfig(8, temperature=0.8, top_k=50, top_p=0.95, min_p=0.3),
]


@pytest.mark.parametrize("sampling", SETTINGS, ids=lambda s: "greedy" if s.greedy else
                         f"T{s.temperature}-k{s.top_k}-p{s.top_p}-minp{s.min_p}")
def test_sampled_distribution_is_the_one_the_trainer_scores(case, sampling):
    prompt, _, polluted = case
    tokenizer = AutoTokenizer.from_pretrained(polluted.name_or_path)
    torch.manual_seed(3)
    out = HFRolloutEngine(polluted, tokenizer, report_logprobs=True).generate([prompt, prompt[5:]], 3, sampling)
    mask = out.completion_mask.bool()
    assert out.sampler_logprobs is not None and out.sampler_logprobs.shape == out.completion_ids.shape
    assert (out.sampler_logprobs[~mask] == 0).all()
    truncation = {} if sampling.greedy else dict(top_k=sampling.top_k, top_p=sampling.top_p, min_p=sampling.min_p)
    temperature = 1.0 if sampling.greedy else sampling.temperature
    expected = trainer_logprobs(polluted, out, temperature, **truncation)
    torch.testing.assert_close(out.sampler_logprobs, expected, atol=ATOL, rtol=0)
    plain = trainer_logprobs(polluted, out, temperature)  # today's trainer: no truncation
    if sampling.greedy or not (sampling.top_k or sampling.top_p < 1 or sampling.min_p):
        torch.testing.assert_close(plain, expected, atol=0, rtol=0)
    else:  # the truncation is real: renormalizing over the kept tokens raises every logprob
        assert (expected - plain)[mask].min() > 1e-2
    if sampling.top_k:
        for row in range(out.completion_ids.shape[0]):
            length = int(mask[row].sum())
            p = out.prompt_ids[row][out.prompt_mask[row].bool()]
            logits = polluted(torch.cat([p, out.completion_ids[row, :length]])[None]).logits[0, len(p) - 1 : -1]
            top = logits.topk(sampling.top_k, dim=-1).indices
            assert (top == out.completion_ids[row, :length, None]).any(-1).all()
