"""Image observations in multi-turn episodes (lightning_grpo.episodes.turn_loop with a vision-language policy):

* an environment that shows a picture: its observation's image part becomes the model's placeholder run in the
  environment tokens, and the picture joins the row's images after the prompt's;
* the trained ids are the sampled ids and the observation's ids (never decoded and encoded again), and the sampler's
  logprobs of every model turn are the trainer's on the whole episode with all its images, in every layout (each
  turn's ``generate`` saw the same pixels as the trainer);
* the episode's record keeps the messages without the pictures (plain data), and a text policy is refused an image
  observation.
"""

from __future__ import annotations

import pytest
import torch

from lightning_grpo import GRPOConfig
from lightning_grpo.config import EpisodeConfig
from lightning_grpo.episodes import BaseEnvironment, EnvStep
from lightning_grpo.episodes.build import rollout_path
from lightning_grpo.protocols.rollout import StopFlag
from lightning_grpo.protocols.sampler import EncodedPrompts
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.rollout.engines.hf import HFRolloutEngine
from lightning_grpo.rollout.image_prompts import ImagePrompts
from lightning_grpo.training.experience import Experience
from lightning_grpo.training.logprobs import CompletionLogprobs
from support.vision import Loaded, image_prompt, picture


class Glance(BaseEnvironment):
    """Shows a blue square after the first model turn, then ends the episode."""

    def __init__(self) -> None:
        self.turns = 0

    def step(self, turn: str) -> EnvStep:
        self.turns += 1
        if self.turns > 1:
            return EnvStep.finish(reward=1.0)
        return EnvStep([{"role": "user", "content": [{"type": "image", "image": picture("blue", (50, 70))},
                                                      {"type": "text", "text": "And this one?"}]}])


@pytest.fixture(scope="module")
def qwen(tiny_qwen_vl_path):
    """The tiny Qwen2.5-VL with its EOS made likely, so that model turns end within a few tokens."""
    loaded = Loaded(tiny_qwen_vl_path)
    norm = loaded.policy.model.language_model.norm.weight
    with torch.no_grad():
        loaded.policy.lm_head.weight[loaded.tokenizer.eos_token_id] += 2.0 * norm
    return loaded


def _episodes(qwen):
    config = GRPOConfig(max_new_tokens=6, episode=EpisodeConfig(max_turns=3, max_tokens=40))
    path = rollout_path(config, qwen.tokenizer, qwen.policy, [], Glance, None, StopFlag(), processor=qwen.processor)
    prompts, sampler = path.prompts, path.sampler
    assert isinstance(prompts, ImagePrompts) and sampler.images is prompts and path.images is prompts
    encoded = prompts.encode_image_prompts([image_prompt("Colour?", picture("red")),
                                            image_prompt("Colour?", picture("green", (40, 90)))], 4096)
    engine = HFRolloutEngine(qwen.policy, qwen.tokenizer, report_logprobs=True, vision=qwen.spec)
    sampling = SamplingConfig(max_new_tokens=6, temperature=1.0, banned_token_ids=qwen.spec.banned_token_ids)
    torch.manual_seed(0)
    return encoded, sampler.sample(engine, encoded, 2, sampling)


def test_an_observed_picture_becomes_the_rows_next_image(qwen):
    encoded, out = _episodes(qwen)
    pad = qwen.spec.placeholder_id
    observed = [r for r in range(4) if out.images[r] is not None and len(out.images[r]) == 2]
    assert observed  # some episodes got the picture
    for r in range(4):
        images = out.images[r]
        assert images[0] is encoded.images[r // 2][0]  # the prompt's image first
        env = out.completion_ids[r][out.env_mask[r].bool()]
        model = out.completion_ids[r][out.completion_mask[r].bool()]
        assert not torch.isin(model, torch.tensor(qwen.spec.banned_token_ids)).any()
        assert int((env == pad).sum()) == sum(im.num_tokens for im in images[1:])
        for turn in out.episodes[r].turns:  # the records are plain data: no picture kept
            for message in turn.messages:
                content = message["content"]
                assert isinstance(content, str) or all("image" not in part for part in content)


@pytest.mark.parametrize("layout", [dict(padding_free=False), dict(shared_prefix=False), dict()],
                         ids=["padded", "packed", "shared_prefix"])
def test_every_model_turn_is_scored_with_the_pixels_it_saw(qwen, layout):
    _, out = _episodes(qwen)
    batch = Experience(prompt_ids=out.prompt_ids, prompt_mask=out.prompt_mask, completion_ids=out.completion_ids,
                       completion_mask=out.completion_mask, env_mask=out.env_mask,
                       advantages=torch.zeros(len(out.completions)), images=out.images)
    with torch.no_grad():
        ours, _ = CompletionLogprobs(GRPOConfig(**layout), vision=qwen.spec)(qwen.policy, batch)
    mask = out.completion_mask.bool()
    torch.testing.assert_close(ours[mask], out.sampler_logprobs[mask], atol=2e-5, rtol=0)


def test_a_text_policy_is_refused_an_image_observation(tiny_llama_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path)
    config = GRPOConfig(max_new_tokens=4, episode=EpisodeConfig(max_turns=2, max_tokens=30))
    path = rollout_path(config, tokenizer, model, [], Glance, None, StopFlag())
    prompts, sampler = path.prompts, path.sampler
    assert path.images is None
    ids, _ = prompts.encode_prompts([[{"role": "user", "content": "hi"}]], 64)
    engine = HFRolloutEngine(model, tokenizer)
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] += 100.0 * model.model.norm.weight  # every turn ends at once
    with pytest.raises(ValueError, match="observation has images, but the policy is not a vision-language model"):
        sampler.sample(engine, EncodedPrompts.of(ids), 1, SamplingConfig(max_new_tokens=4))
