"""VLLMRolloutEngine against Hugging Face transformers on the same weights (real vLLM, CPU build in CI).

Equalities between two real paths:
* the engine's sampler logprobs of the tokens it sampled == a teacher-forced HF forward of prompt + completion,
  ``log_softmax(processed(logits / T))`` gathered at the sampled ids, where ``processed`` is transformers'
  ``TopPLogitsWarper`` when ``top_p < 1`` (vLLM returns the logprobs of the distribution it sampled from, which
  top-p renormalizes over the nucleus; both libraries keep the tokens whose ascending cumulative probability
  exceeds ``1 - top_p``);
* after an AdamW step on the HF model and ``sync_weights``, the engine's greedy completions == the HF rollout
  engine's greedy completions on the new weights (tied embeddings included: a stale lm_head fails this);
* with temperature != 1, top-k, top-p and min-p, the sampler logprobs == the trainer's
  ``functional.token_logprobs`` with the same settings (the truncated, renormalized distribution on both sides),
  so the truncated-importance-sampling ratio through ``GRPOModule.completion_logprobs`` (padded, packed and
  shared-prefix paths) is 1 within 1e-3 with top_p=0.9, where the untruncated trainer logprobs give the kept mass,
  ~0.9, on every token;
* an engine on a checkpoint whose ``generation_config.json`` sets a repetition penalty and its own temperature /
  top-k / top-p / min-p samples the same completions and logprobs as the clean one (same weights, same seed).

vLLM engines live in this process (several at once work); one per model, the session's pooled engine
(``vllm_engine``: handed out holding the folder's weights), shared by the module. Each engine is paired with the HF
model that holds the same weights, so test order does not matter.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, TopPLogitsWarper  # noqa: E402

from lightning_grpo import GRPOConfig, GRPOModule  # noqa: E402
from lightning_grpo.algorithm.importance import rollout_importance_weights  # noqa: E402
from lightning_grpo.models.hf_weights import checkpoint_name, hf_weights  # noqa: E402
from lightning_grpo.protocols.sampling import SamplingConfig  # noqa: E402
from lightning_grpo.rollout.engines.hf import HFRolloutEngine  # noqa: E402
from lightning_grpo.rollout.engines.vllm.colocated import VLLMRolloutEngine  # noqa: E402
from lightning_grpo.strategies.module_weights import ModuleWeights  # noqa: E402
from lightning_grpo.training.experience import Experience  # noqa: E402
from support.checkpoint_generation import SAMPLING_FIELDS, copy_with_generation_config, trainer_logprobs  # noqa: E402
from support.engines import WithoutTensor  # noqa: E402

ATOL = 1e-4  # float32 engine vs float32 HF; observed differences are ~1e-6


pytestmark = pytest.mark.engine


class Pair:
    """A vLLM engine (the pooled one, holding the folder's weights) and an HF model holding the same weights."""

    def __init__(self, path: str, engine: VLLMRolloutEngine) -> None:
        self.engine = engine
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.tokenizer = self.engine.tokenizer


@pytest.fixture(scope="module")
def untied(tiny_llama_path, vllm_engine):
    return Pair(tiny_llama_path, vllm_engine(tiny_llama_path))


@pytest.fixture(scope="module")
def tied(tiny_tied_llama_path, vllm_engine):
    return Pair(tiny_tied_llama_path, vllm_engine(tiny_tied_llama_path))


@pytest.fixture(scope="module")
def smollm2(smollm2_path, vllm_engine):
    return Pair(smollm2_path, vllm_engine(smollm2_path))


def _chat_prompts(tokenizer, questions: list[str]) -> list[list[int]]:
    return [
        list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           return_dict=False))
        for q in questions
    ]


@torch.no_grad()
def hf_logprobs(model, out, temperature: float, top_p: float) -> torch.Tensor:
    """Teacher-forced ``(N, T)`` logprobs of ``out.completion_ids`` under processed(logits / T), 0 where masked."""
    result = torch.zeros(out.completion_ids.shape, dtype=torch.float32)
    warper = TopPLogitsWarper(top_p) if top_p < 1.0 else None
    for row in range(out.completion_ids.shape[0]):
        prompt = out.prompt_ids[row][out.prompt_mask[row].bool()]
        length = int(out.completion_mask[row].sum())
        completion = out.completion_ids[row, :length]
        logits = model(torch.cat([prompt, completion])[None]).logits[0, len(prompt) - 1 : -1] / temperature
        if warper is not None:
            logits = warper(None, logits)
        result[row, :length] = logits.log_softmax(-1).gather(-1, completion[:, None])[:, 0]
    return result


def _token_prompts(seed: int, count: int, length: int, vocab: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=generator).tolist() for _ in range(count)]


@pytest.mark.parametrize("which", ["untied", "tied", "smollm2"])
@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampler_logprobs_match_hf_recomputed(request, which, temperature, top_p):
    pair = request.getfixturevalue(which)
    prompt = _chat_prompts(pair.tokenizer, ["What is 7 times 6?"])[0]
    prompts = [prompt, prompt[:5]]  # the shorter prompt exercises the left padding
    sampling = SamplingConfig(max_new_tokens=6, temperature=temperature, top_p=top_p)
    out = pair.engine.generate(prompts, num_generations=2, sampling=sampling)

    n, t = out.completion_ids.shape
    assert n == 4 and t <= 6 and out.sampler_logprobs.dtype == torch.float32
    # prompt-major order: rows 2i, 2i+1 carry prompt i, left-padded
    for row in range(n):
        assert out.prompt_ids[row][out.prompt_mask[row].bool()].tolist() == prompts[row // 2]
    assert out.prompt_mask[2:, : len(prompt) - 5].sum() == 0

    expected = hf_logprobs(pair.model, out, temperature, top_p)
    mask = out.completion_mask.bool()
    torch.testing.assert_close(out.sampler_logprobs, expected, atol=ATOL, rtol=0)
    assert (out.sampler_logprobs[~mask] == 0).all()
    assert (out.sampler_logprobs[mask] <= 0).all()
    if top_p < 1.0:
        # the renormalization over the nucleus is real: plain log_softmax(logits / T) is lower somewhere
        plain = hf_logprobs(pair.model, out, temperature, 1.0)
        assert (out.sampler_logprobs - plain)[mask].max() > 1e-2


def test_greedy_matches_hf_engine_and_stops_at_eos(smollm2):
    prompts = _chat_prompts(smollm2.tokenizer, ["What is 2+2?", "Say hello."])
    sampling = SamplingConfig(max_new_tokens=16, greedy=True)
    out = smollm2.engine.generate(prompts, num_generations=2, sampling=sampling)
    reference = HFRolloutEngine(smollm2.model, smollm2.tokenizer).generate(prompts, 1, sampling)

    # the G greedy completions of a prompt are copies of the single HF greedy completion
    assert out.completions == [text for text in reference.completions for _ in range(2)]
    length = out.completion_mask.sum(1)
    assert torch.equal(length, reference.completion_mask.sum(1).repeat_interleave(2))
    for row in range(4):
        k = int(length[row])
        assert out.completion_ids[row, :k].tolist() == reference.completion_ids[row // 2, :k].tolist()
    assert torch.equal(out.truncated, reference.truncated.repeat_interleave(2))
    # "What is 2+2?" is answered within 16 tokens: the row ends with EOS, included in the mask
    assert not out.truncated[0]
    assert out.completion_ids[0, int(length[0]) - 1].item() in smollm2.engine.eos_token_ids
    assert "4" in out.completions[0]
    # greedy logprobs are those of log_softmax(logits) (temperature 1)
    torch.testing.assert_close(out.sampler_logprobs, hf_logprobs(smollm2.model, out, 1.0, 1.0), atol=ATOL, rtol=0)


def _optimizer_step(model, batch: torch.Tensor) -> None:
    """One AdamW step (lr 1e-2) on the language-modelling loss of ``batch``."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model.eval()


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_sync_weights_after_optimizer_step(request, which):
    pair = request.getfixturevalue(which)
    vocab = pair.model.config.vocab_size
    # 150 tokens: more than one 128-token KV block, so the prefix cache holds this prompt between calls
    prompts = _token_prompts(seed=1, count=2, length=150, vocab=vocab)
    sampling = SamplingConfig(max_new_tokens=12, greedy=True)
    hf_engine = HFRolloutEngine(pair.model, pair.tokenizer)

    before = pair.engine.generate(prompts, num_generations=1, sampling=sampling)
    assert torch.equal(before.completion_ids, hf_engine.generate(prompts, 1, sampling).completion_ids)

    _optimizer_step(pair.model, torch.tensor(_token_prompts(seed=2, count=4, length=32, vocab=vocab)))
    reference = hf_engine.generate(prompts, 1, sampling)
    assert not torch.equal(reference.completion_ids, before.completion_ids), "the step must change greedy outputs"

    pair.engine.sync_weights(ModuleWeights(pair.model))
    after = pair.engine.generate(prompts, num_generations=1, sampling=sampling)
    assert torch.equal(after.completion_ids, reference.completion_ids)
    torch.testing.assert_close(after.sampler_logprobs, hf_logprobs(pair.model, after, 1.0, 1.0), atol=ATOL, rtol=0)


def test_hf_weights_sends_lm_head_for_tied_embeddings(tied):
    names = [name for name, _ in hf_weights(tied.model, tie_word_embeddings=True)]
    assert names.count("lm_head.weight") == 1 and names.count("model.embed_tokens.weight") == 1
    weights = dict(hf_weights(tied.model, tie_word_embeddings=True))
    assert weights["lm_head.weight"] is weights["model.embed_tokens.weight"]


def test_checkpoint_name_strips_wrappers():
    wrapped = "module._orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight"
    assert checkpoint_name(wrapped) == "model.layers.0.mlp.up_proj.weight"
    assert checkpoint_name("lm_head.weight") == "lm_head.weight"


def test_seeded_global_generator_reproduces_samples_and_sleep_is_noop_on_cpu(untied):
    prompts = _token_prompts(seed=3, count=2, length=10, vocab=untied.model.config.vocab_size)
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0)
    torch.manual_seed(123)
    first = untied.engine.generate(prompts, 4, sampling)
    untied.engine.sleep()
    untied.engine.wake_up()
    torch.manual_seed(123)
    second = untied.engine.generate(prompts, 4, sampling)
    third = untied.engine.generate(prompts, 4, sampling)
    assert torch.equal(first.completion_ids, second.completion_ids)
    assert not torch.equal(second.completion_ids, third.completion_ids)


def test_per_request_seeds_are_honoured_on_cpu(untied):
    """With ``SamplingConfig.seed`` every completion has its own seed (seed + i * G + j): the same seed samples the
    same completions whatever torch's global generator holds and whatever else is in the batch (prompt 1 alone with
    the base shifted by G == prompt 1 in the batch), the global generator is left untouched, and the chunked-prefill
    error of seeded requests on CPU does not occur (3 x 200 prompt tokens > one 512-token step)."""
    vocab = untied.model.config.vocab_size
    prompts = _token_prompts(seed=7, count=3, length=200, vocab=vocab)
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, seed=500)
    torch.manual_seed(1)
    state = torch.get_rng_state()
    first = untied.engine.generate(prompts, 2, sampling)
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(2)
    again = untied.engine.generate(prompts, 2, sampling)
    assert torch.equal(first.completion_ids, again.completion_ids)
    alone = untied.engine.generate(prompts[1:2], 2, SamplingConfig(max_new_tokens=6, temperature=1.0, seed=502))
    assert torch.equal(alone.completion_ids, first.completion_ids[2:4])
    assert len({tuple(row) for row in first.completion_ids.tolist()}) == 6  # every completion its own seed
    other = untied.engine.generate(prompts, 2, SamplingConfig(max_new_tokens=6, temperature=1.0, seed=900))
    assert not torch.equal(other.completion_ids, first.completion_ids)


def test_bad_inputs_name_the_field(untied, tmp_path):
    with pytest.raises(ValueError, match="model_path"):
        VLLMRolloutEngine(tmp_path)
    with pytest.raises(ValueError, match="num_generations"):
        untied.engine.generate([[5, 6]], 0, SamplingConfig(max_new_tokens=2))
    with pytest.raises(ValueError, match=r"prompt_ids\[1\] is empty"):
        untied.engine.generate([[5, 6], []], 1, SamplingConfig(max_new_tokens=2))
    with pytest.raises(ValueError, match="max_model_len=512"):
        untied.engine.generate([[5] * 510], 1, SamplingConfig(max_new_tokens=8))
    with pytest.raises(ValueError, match="temperature"):
        untied.engine.generate([[5, 6]], 1, SamplingConfig(max_new_tokens=2, temperature=0.0))
    with pytest.raises(ValueError, match="top_p"):
        untied.engine.generate([[5, 6]], 1, SamplingConfig(max_new_tokens=2, top_p=1.5))


TRUNCATIONS = [
    dict(temperature=0.6),
    dict(temperature=1.0, top_p=0.9),
    dict(temperature=0.7, top_p=0.8),
    dict(temperature=1.0, top_k=20),
    dict(temperature=1.3, min_p=0.5),
    dict(temperature=0.8, top_k=50, top_p=0.95, min_p=0.3),
]


@pytest.mark.parametrize("which", ["untied", "smollm2"])
@pytest.mark.parametrize("settings", TRUNCATIONS, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_sampler_logprobs_equal_trainer_token_logprobs(request, which, settings):
    pair = request.getfixturevalue(which)
    prompt = _chat_prompts(pair.tokenizer, ["What is 7 times 6?"])[0]
    sampling = SamplingConfig(max_new_tokens=6, **settings)
    out = pair.engine.generate([prompt, prompt[:5]], num_generations=2, sampling=sampling)
    truncation = {k: v for k, v in settings.items() if k != "temperature"}
    expected = trainer_logprobs(pair.model, out, sampling.temperature, **truncation)
    mask = out.completion_mask.bool()
    torch.testing.assert_close(out.sampler_logprobs, expected, atol=ATOL, rtol=0)
    if truncation:  # the untruncated logprobs (today's trainer) are lower on every token that had a removed rival
        plain = trainer_logprobs(pair.model, out, sampling.temperature)
        assert (out.sampler_logprobs - plain)[mask].max() > 1e-2
        assert (out.sampler_logprobs - plain)[mask].min() >= -ATOL


def _experience(out) -> Experience:
    return Experience(prompt_ids=out.prompt_ids, prompt_mask=out.prompt_mask, completion_ids=out.completion_ids,
                      completion_mask=out.completion_mask, advantages=torch.zeros(out.completion_ids.shape[0]))


@pytest.mark.parametrize("layout", [dict(padding_free=False), dict(shared_prefix=False), dict(shared_prefix=True)],
                         ids=["padded", "packed", "shared_prefix"])
def test_importance_ratio_is_one_under_top_p(untied, layout):
    # The case: engine.name="vllm", temperature=1.0, top_p=0.9, no optimizer step between rollout and
    # scoring. The weight pi_old / pi_sampler must be 1 (same weights), not the kept mass 0.9.
    vocab = untied.model.config.vocab_size
    prompts = _token_prompts(seed=4, count=2, length=12, vocab=vocab)
    sampling = SamplingConfig(max_new_tokens=8, temperature=1.0, top_p=0.9)
    out = untied.engine.generate(prompts, num_generations=3, sampling=sampling)
    mask = out.completion_mask
    ratios = {}
    for top_p in (0.9, 1.0):  # 1.0: the trainer scores the untruncated distribution (the bug)
        config = GRPOConfig(num_generations=3, temperature=1.0, top_p=top_p, importance_sampling_cap=2.0, **layout)
        module = GRPOModule(untied.model, tokenizer=untied.tokenizer, config=config)
        with torch.no_grad():
            old, _ = module.completion_logprobs(untied.model, _experience(out))
        weights = rollout_importance_weights(old, out.sampler_logprobs, mask, cap=2.0)
        ratios[top_p] = weights[mask.bool()]
    torch.testing.assert_close(ratios[0.9], torch.ones_like(ratios[0.9]), atol=1e-3, rtol=0)
    assert ((ratios[1.0] > 0.89) & (ratios[1.0] < 0.93)).all()  # the kept mass of a flat distribution, ~0.9


@pytest.fixture(scope="module")
def polluted(tiny_llama_path, tmp_path_factory):
    """An engine on a copy of the tiny Llama whose generation_config.json sets a repetition penalty and its own
    sampling defaults (temperature 0.3, top-k 5, top-p 0.5, min-p 0.2, max_new_tokens 3)."""
    path = copy_with_generation_config(tiny_llama_path, tmp_path_factory.mktemp("polluted") / "model",
                                       repetition_penalty=1.3, **SAMPLING_FIELDS)
    engine = VLLMRolloutEngine(path, kv_cache_space_gib=0.25, max_model_len=512, dtype="float32", seed=0)
    yield engine
    engine.close()


def test_checkpoint_generation_config_never_changes_vllm_rollouts(untied, polluted):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # vLLM reads the polluted file, but the engine's defaults stay vLLM's neutral ones (generation_config="vllm")
    read = polluted.llm.llm_engine.model_config.try_get_generation_config()
    assert read["repetition_penalty"] == 1.3 and read["top_k"] == 5
    defaults = polluted.llm.get_default_sampling_params()
    assert (defaults.repetition_penalty, defaults.temperature, defaults.top_p, defaults.min_p) == (1.0, 1.0, 1.0, 0.0)
    assert defaults.top_k in (0, -1) and defaults.max_tokens in (None, 16)

    polluted.sync_weights(ModuleWeights(untied.model))  # the clean engine's weights, whichever test ran before
    chat = _chat_prompts(untied.tokenizer, ["What is 7 times 6?"])[0]
    greedy = SamplingConfig(max_new_tokens=12, greedy=True)
    first = untied.engine.generate([chat], 1, greedy).completion_ids[0, 0].item()
    prompt = [first] + chat  # the first greedy token is already in the prompt: a repetition penalty bites
    clean = untied.engine.generate([prompt], 1, greedy)
    result = untied.engine.llm.generate([TokensPrompt(prompt_token_ids=prompt)],
                                        SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3),
                                        use_tqdm=False)
    penalized = list(result[0].outputs[0].token_ids)
    assert penalized != clean.completion_ids[0].tolist(), "a repetition penalty of 1.3 changes this greedy output"
    out = polluted.generate([prompt], 1, greedy)
    assert torch.equal(out.completion_ids, clean.completion_ids)

    sampling = SamplingConfig(max_new_tokens=8, temperature=0.9)
    runs = []
    for engine in (untied.engine, polluted):
        torch.manual_seed(11)
        runs.append(engine.generate([prompt, chat], 3, sampling))
    assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)
    assert runs[1].completion_ids.shape[1] == 8  # not the checkpoint's max_new_tokens=3
    torch.testing.assert_close(runs[1].sampler_logprobs, runs[0].sampler_logprobs, atol=ATOL, rtol=0)
    torch.testing.assert_close(runs[1].sampler_logprobs, trainer_logprobs(untied.model, runs[1], 0.9), atol=ATOL,
                               rtol=0)


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_sync_weights_of_a_lora_policy_sends_merged_weights(request, which):
    """A PEFT LoRA policy (random B, so the adapters matter; ``modules_to_save`` on the untied head) is synced merged
    (W0 + scaling * B A from the tensors): the engine's greedy completions are the adapted model's, and its sampler
    logprobs are the adapted model's to 1e-4. The trained module is not changed by the sync (its base weights stay
    bitwise W0)."""
    import copy

    from peft import LoraConfig, get_peft_model

    pair = request.getfixturevalue(which)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"],
                      modules_to_save=None if which == "tied" else ["lm_head"])
    policy = get_peft_model(copy.deepcopy(pair.model), lora).eval()
    with torch.no_grad():
        generator = torch.Generator().manual_seed(5)
        for name, param in policy.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.5)
    base = {n: p.detach().clone() for n, p in policy.named_parameters() if "base_layer" in n}
    prompts = _token_prompts(seed=6, count=2, length=20, vocab=pair.model.config.vocab_size)
    sampling = SamplingConfig(max_new_tokens=8, greedy=True)
    try:
        pair.engine.sync_weights(ModuleWeights(policy))
        out = pair.engine.generate(prompts, num_generations=1, sampling=sampling)
        reference = HFRolloutEngine(policy.get_base_model(), pair.tokenizer).generate(prompts, 1, sampling)
        assert torch.equal(out.completion_ids, reference.completion_ids)
        before = HFRolloutEngine(pair.model, pair.tokenizer).generate(prompts, 1, sampling)
        assert not torch.equal(before.completion_ids, reference.completion_ids), "the adapters must change outputs"
        torch.testing.assert_close(out.sampler_logprobs, hf_logprobs(policy, out, 1.0, 1.0), atol=ATOL, rtol=0)
        sampled = pair.engine.generate(prompts, num_generations=2, sampling=SamplingConfig(8, temperature=0.8))
        expected = trainer_logprobs(policy, sampled, 0.8)
        torch.testing.assert_close(sampled.sampler_logprobs, expected, atol=ATOL, rtol=0)
        for name, param in policy.named_parameters():
            if "base_layer" in name:
                assert torch.equal(param, base[name])
    finally:
        pair.engine.sync_weights(ModuleWeights(pair.model))  # the engine holds its pair's weights again


def _tied_lora(path: str, **extra):
    """The tied tiny Llama with LoRA on q_proj and a trained ``lm_head`` copy (``modules_to_save``), the copy moved
    off the embedding by +0.05 (as training it would)."""
    from peft import LoraConfig, get_peft_model

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    policy = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"],
                                              task_type="CAUSAL_LM", **extra))
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "modules_to_save" in name:
                param.add_(0.05)
    return policy


def test_a_separately_trained_head_of_a_tied_model_is_refused_or_synced_exactly(tied, tiny_tied_llama_path):
    """LoRA ``modules_to_save=["lm_head"]`` on a tied checkpoint trains a head the engine's one tied matrix cannot
    hold: the sync refuses before sending anything (the engine keeps its weights), and at setup ``check_tied_head``
    refuses any engine with its own weights. With ``ensure_weight_tying=True`` embedding and head stay one trained
    matrix, which syncs exactly (the post-sync check at 1e-4 passes)."""
    from lightning_grpo.models.hf_weights import TIED_HEAD_ERROR
    from lightning_grpo.models.lora import check_tied_head

    engine = tied.engine
    engine.sync_weights(ModuleWeights(tied.model))
    before = engine.check_weights(ModuleWeights(tied.model))
    separate = _tied_lora(tiny_tied_llama_path)
    with pytest.raises(ValueError, match="ties lm_head to the input embedding .* trains a separate lm_head"):
        engine.sync_weights(ModuleWeights(separate))
    assert engine.check_weights(ModuleWeights(tied.model)) == before  # nothing was loaded
    with pytest.raises(ValueError, match="ensure_weight_tying=True"):
        check_tied_head(separate, separate.get_base_model(), engine)
    assert TIED_HEAD_ERROR.startswith("the engine's model ties lm_head")
    # the HF engine samples from the policy
    check_tied_head(separate, separate.get_base_model(), HFRolloutEngine(separate, tied.tokenizer))
    shared = _tied_lora(tiny_tied_llama_path, ensure_weight_tying=True)
    check_tied_head(shared, shared.get_base_model(), engine)
    engine.weight_sync_check = ATOL
    try:
        engine.sync_weights(ModuleWeights(shared))  # runs the check
    finally:
        engine.weight_sync_check = None
    assert engine.check_weights(ModuleWeights(shared)) < ATOL  # the shared head moved:
    assert engine.check_weights(ModuleWeights(tied.model)) > 1e-2
    engine.sync_weights(ModuleWeights(tied.model))


def test_the_post_sync_check_catches_a_stale_tied_head_on_the_colocated_engine(tied, tiny_tied_llama_path):
    """The class of bug the check is for: a sync that leaves the engine's copy of the tied head stale (vLLM's CPU
    backend keeps a packed lm_head, rebuilt only when ``lm_head.weight`` is loaded)."""
    from lightning_grpo.rollout.engines.probe import WeightSyncCheckError

    model = AutoModelForCausalLM.from_pretrained(tiny_tied_llama_path, dtype=torch.float32)
    _optimizer_step(model, torch.tensor(_token_prompts(seed=7, count=4, length=32, vocab=model.config.vocab_size)))
    engine = tied.engine
    engine.weight_sync_check = ATOL
    try:
        with pytest.raises(WeightSyncCheckError, match=r"differ from the policy's by up to .* > "
                                                       r"engine.weight_sync_check=0.0001"):
            engine.sync_weights(WithoutTensor(ModuleWeights(model), "lm_head.weight"))
        engine.sync_weights(ModuleWeights(model))
    finally:
        engine.weight_sync_check = None
        engine.sync_weights(ModuleWeights(tied.model))


def test_a_folder_without_a_tokenizer_is_named(tmp_path, tiny_llama_path):
    import shutil

    folder = tmp_path / "no_tokenizer"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(tiny_llama_path) / name, folder / name)
    with pytest.raises(ValueError, match=rf"model_path='{folder}' holds no tokenizer that transformers can load"):
        VLLMRolloutEngine(folder)


def test_the_known_harmless_rotary_reload_warning_is_filtered_and_other_warnings_show(untied):
    """vLLM's in-place reload warns ``"RotaryEmbedding: Failed to load weights"`` at every weight sync (the rotary
    cache is no checkpoint tensor: harmless; the post-sync check is the evidence): the installed vLLM's reload logs
    exactly that format on that logger, a real sync of the colocated engine logs it and it is filtered out. The same
    warning for another layer (one that really loaded nothing), another warning and the rotary message at another
    level still show. The logger is made to emit WARNING for the test (:func:`support.logs.emitting`): in the suite an
    earlier file in the same worker left vLLM's loggers above WARNING, and nothing was logged at all."""
    import inspect
    import logging

    from vllm.model_executor.model_loader.reload import layerwise

    from lightning_grpo.rollout.engines.vllm.runtime import RELOAD_LOGGER, RELOAD_WARNING
    from support.logs import emitting

    assert layerwise.logger.name == RELOAD_LOGGER
    assert f'logger.warning("{RELOAD_WARNING}", layer.__class__.__name__)' in inspect.getsource(layerwise)

    logged, shown = [], []

    class Logged(logging.Filter):  # first in the logger's chain: every record of the reload
        def filter(self, record):
            logged.append(record.getMessage())
            return True

    class Shown(logging.Handler):
        def emit(self, record):
            shown.append(record.getMessage())

    first, handler = Logged(), Shown(logging.DEBUG)
    with emitting(RELOAD_LOGGER, logging.WARNING) as logger:
        logger.filters.insert(0, first)
        logger.addHandler(handler)
        try:
            untied.engine.sync_weights(ModuleWeights(untied.model))
            logger.warning(RELOAD_WARNING, "QKVParallelLinear")
            logger.warning("%s: another message", "RotaryEmbedding")
            logger.error(RELOAD_WARNING, "RotaryEmbedding")
        finally:
            logger.removeFilter(first)
            logger.removeHandler(handler)
    assert "RotaryEmbedding: Failed to load weights" in logged[:-3]  # the real sync's, from vLLM
    assert shown == ["QKVParallelLinear: Failed to load weights", "RotaryEmbedding: another message",
                     "RotaryEmbedding: Failed to load weights"]  # the last one at ERROR
