"""The training forward of vision-language policies (lightning_grpo.training.vision_layouts) against transformers' own:

* Qwen-VL's 3-D positions (``mrope_positions``) are transformers' ``get_rope_index`` for prompts with several
  images of different sizes, for Qwen2.5-VL and Qwen3-VL;
* every layout (padded, packed, shared prefix) gives the logprobs of the model's own forward on each row alone (its
  processor inputs, its ``mm_token_type_ids``), for Qwen2.5-VL, Qwen3-VL and LLaVA, also when two prompts have the
  same text and other images (they must not share a prefix), and the same gradients;
* a row whose ids hold other image tokens than its images (a prompt cut through an image, a sampled placeholder,
  another row's images) is an error naming the row before any forward pass;
* the placeholder tokens are out of the scored distribution (the engines never sample them): the logprobs are the
  renormalized ones without them.
"""

from __future__ import annotations

import pytest
import torch

from lightning_grpo import GRPOConfig
from lightning_grpo import functional as F
from lightning_grpo.protocols.vision import image_batch
from lightning_grpo.training.logprobs import CompletionLogprobs
from lightning_grpo.training.vision_layouts import mrope_positions
from support.vision import Loaded, image_experience, image_prompt, picture

LAYOUTS = {"padded": dict(padding_free=False), "packed": dict(shared_prefix=False), "shared_prefix": dict()}


@pytest.fixture(scope="module")
def models(tiny_qwen_vl_path, tiny_qwen3_vl_path, tiny_llava_path):
    return {"qwen2_5_vl": Loaded(tiny_qwen_vl_path), "qwen3_vl": Loaded(tiny_qwen3_vl_path),
            "llava": Loaded(tiny_llava_path)}


def _prompts():
    return [image_prompt("What colour is it?", picture("red", (64, 48)), picture("blue", (40, 90))),
            image_prompt("What colour is it?", picture("green", (90, 60))),
            image_prompt("No image here.")]


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl"])
def test_mrope_positions_are_transformers_get_rope_index(models, name):
    loaded = models[name]
    encoded = loaded.prompts.encode_image_prompts(_prompts()[:1], 4096)
    ids, images = torch.tensor(encoded.ids[0]), encoded.images[0]
    assert [im.grid for im in images] == [(1, 4, 4), (1, 6, 2)] if name == "qwen2_5_vl" else True
    completion = torch.tensor([5, 6, 7])
    full = torch.cat([ids, completion])
    grid = image_batch(images)["image_grid_thw"]
    expected, _ = loaded.policy.model.get_rope_index(full[None], (full == loaded.spec.placeholder_id).int()[None],
                                                     image_grid_thw=grid)
    ours = mrope_positions(full, images, loaded.spec)
    assert torch.equal(ours, expected[:, 0])
    assert int(ours[0, -1]) < full.numel() - 1  # the images compress positions: not the 1-D ones


def _reference(loaded, batch):
    """Each row's completion logprobs from the model's own forward on it alone (transformers' positions from
    ``mm_token_type_ids``), with the placeholders removed from the distribution."""
    rows = []
    for i in range(len(batch)):
        prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()]
        n = int(batch.completion_mask[i].sum())
        ids = torch.cat([prompt, batch.completion_ids[i, :n]])[None]
        kwargs = image_batch(list(batch.images[i])) if batch.images[i] else {}
        if loaded.spec.mrope:
            kwargs["mm_token_type_ids"] = (ids == loaded.spec.placeholder_id).int()
        logits = loaded.policy(input_ids=ids, **kwargs).logits[0, prompt.numel() - 1:-1]
        logprobs, _ = F.token_logprobs(logits[None], batch.completion_ids[i, :n][None],
                                       banned_token_ids=loaded.spec.banned_token_ids)
        row = torch.zeros(batch.completion_ids.shape[1])
        row[:n] = logprobs[0]
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("name", ["qwen2_5_vl", "qwen3_vl", "llava"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_layout_scores_what_the_model_scores_alone(models, name, layout):
    loaded = models[name]
    completions = [[11, 12, 13, 14], [21, 22], [31, 32, 33], [41], [51, 52, 53, 54, 55], [61, 62]]
    batch = image_experience(loaded, _prompts(), completions, num_generations=2)
    logprobs_of = CompletionLogprobs(GRPOConfig(**LAYOUTS[layout]), vision=loaded.spec)
    with torch.no_grad():
        ours, _ = logprobs_of(loaded.policy, batch)
        expected = _reference(loaded, batch)
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(ours[mask], expected[mask], atol=2e-5, rtol=0)


@pytest.mark.parametrize("name", ["qwen2_5_vl", "llava"])
def test_layouts_give_the_same_gradient(models, name):
    loaded = models[name]
    completions = [[11, 12, 13, 14], [21, 22], [31, 32, 33], [41, 42], [51, 52, 53], [61, 62]]
    batch = image_experience(loaded, _prompts(), completions, num_generations=2)
    grads = {}
    model = loaded.policy
    for layout, knobs in LAYOUTS.items():
        model.zero_grad(set_to_none=True)
        logprobs, _ = CompletionLogprobs(GRPOConfig(**knobs), vision=loaded.spec)(model, batch)
        (logprobs * batch.advantages[:, None] * batch.completion_mask).sum().backward()
        grads[layout] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    vision_grads = [n for n in grads["padded"] if "visual" in n or "vision_tower" in n]
    assert vision_grads and all(grads["padded"][n].abs().max() > 0 for n in vision_grads[:3])
    for layout in ("packed", "shared_prefix"):
        for key, value in grads["padded"].items():
            torch.testing.assert_close(grads[layout][key], value, atol=1e-5, rtol=1e-4, msg=f"{layout}: {key}")
    model.zero_grad(set_to_none=True)


def test_same_text_other_images_is_another_prompt(models):
    """Two prompts whose ids are equal (same text, images of the same size) but whose images differ: the
    shared-prefix layout keeps them apart (each scored with its own pixels)."""
    loaded = models["qwen2_5_vl"]
    prompts = [image_prompt("Which colour?", picture("red")), image_prompt("Which colour?", picture("blue"))]
    batch = image_experience(loaded, prompts, [[11, 12], [11, 12]], num_generations=1)
    assert torch.equal(batch.prompt_ids[0], batch.prompt_ids[1])
    with torch.no_grad():
        shared, _ = CompletionLogprobs(GRPOConfig(), vision=loaded.spec)(loaded.policy, batch)
        expected = _reference(loaded, batch)
    torch.testing.assert_close(shared, expected, atol=2e-5, rtol=0)
    assert (shared[0] - shared[1]).abs().max() > 1e-4  # the pixels matter


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("fault", ["cut_image", "sampled_placeholder", "other_images"])
def test_a_row_whose_image_tokens_are_not_its_images_is_named(models, layout, fault):
    loaded = models["qwen2_5_vl"]
    batch = image_experience(loaded, _prompts(), [[11, 12, 13]] * 6, num_generations=2)
    placeholder = loaded.spec.placeholder_id
    if fault == "cut_image":  # the prompt of row 2 lost one of its image tokens (left-truncated through it)
        first = int((batch.prompt_ids[2] == placeholder).nonzero()[0])
        batch.prompt_mask[2, : first + 1] = 0
    elif fault == "sampled_placeholder":  # the policy sampled an image placeholder (verl PR #7038)
        batch.completion_ids[2, 1] = placeholder
    else:  # row 2 got the images of prompt 1 (pixel_values of one sample attributed to another)
        batch.images[2] = batch.images[0]
    with pytest.raises(ValueError, match=r"row 2 .*image features and image tokens do not match"):
        CompletionLogprobs(GRPOConfig(**LAYOUTS[layout]), vision=loaded.spec)(loaded.policy, batch)


def test_placeholders_are_out_of_the_scored_distribution(models):
    loaded = models["qwen2_5_vl"]
    batch = image_experience(loaded, _prompts()[1:2], [[11, 12, 13]], num_generations=1)
    banned = torch.tensor(loaded.spec.banned_token_ids)
    with torch.no_grad():
        ours, _ = CompletionLogprobs(GRPOConfig(), vision=loaded.spec)(loaded.policy, batch)
        prompt = batch.prompt_ids[0]
        ids = torch.cat([prompt, batch.completion_ids[0]])[None]
        kwargs = {**image_batch(list(batch.images[0])), "mm_token_type_ids": (ids == banned[2]).int()}
        logits = loaded.policy(input_ids=ids, **kwargs).logits[0, prompt.numel() - 1:-1].float()
    kept = logits.index_fill(-1, banned, float("-inf")).log_softmax(-1)
    full = logits.log_softmax(-1)
    picked = batch.completion_ids[0][:, None]
    torch.testing.assert_close(ours[0], kept.gather(1, picked)[:, 0], atol=1e-5, rtol=0)
    assert (ours[0] - full.gather(1, picked)[:, 0]).min() > 0  # renormalized over fewer tokens: higher
