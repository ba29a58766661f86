"""Prompts with images (lightning_grpo.rollout.image_prompts, lightning_grpo.protocols.vision):

* the ids and pixels are the model's processor's: LLaVA's ``LlavaProcessor`` gives the same ids and
  ``pixel_values``; a Qwen-VL image becomes ``t*h*w/4`` tokens of the processor's own grid and its pixels;
* several images per prompt keep their order (each run is its image's, sizes differ);
* a prompt longer than ``max_prompt_length`` loses only text before its first image (counted); one whose cut would
  reach an image is refused, naming it; a chat template that does not write image parts is refused;
* vLLM gets each run collapsed to one placeholder and its expansion is checked; banned tokens become vLLM bad
  words only when they tokenize back to themselves;
* pictures in checkpoints (prefetched rollouts) come back pixel for pixel through ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from lightning_grpo.protocols.vision import PromptImage, collapse_runs, row_images_from_state, row_images_state
from lightning_grpo.rollout.engines.multimodal import bad_words, check_expansion, vllm_prompt
from lightning_grpo.rollout.image_prompts import pictures_from_state, pictures_state
from support.vision import Loaded, image_prompt, picture


@pytest.fixture(scope="module")
def qwen(tiny_qwen_vl_path):
    return Loaded(tiny_qwen_vl_path)


@pytest.fixture(scope="module")
def llava(tiny_llava_path):
    return Loaded(tiny_llava_path)


def test_llava_ids_and_pixels_are_its_processors(llava, tiny_llava_path):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_llava_path)
    images = [picture("red", (80, 50)), picture("blue", (30, 70), shape="rectangle")]
    prompt = image_prompt("Are they the same colour?", *images)
    encoded = llava.prompts.encode_image_prompts([prompt], 4096)
    text = llava.tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                                {"type": "text", "text": "Are they the same colour?"}]}],
                                               add_generation_prompt=True, tokenize=False)
    expected = processor(images=images, text=[text], return_tensors="pt")
    assert encoded.ids[0] == expected["input_ids"][0].tolist()
    ours = torch.cat([im.tensors["pixel_values"] for im in encoded.images[0]])
    assert torch.equal(ours, expected["pixel_values"])
    assert [im.num_tokens for im in encoded.images[0]] == [16, 16]


def test_qwen_images_are_the_processors_grid_and_pixels_in_order(qwen):
    sizes = [(64, 48), (40, 90), (200, 30)]
    images = [picture("red", sizes[0]), picture("green", sizes[1]), picture("blue", sizes[2])]
    encoded = qwen.prompts.encode_image_prompts([image_prompt("Compare.", *images)], 4096)
    row = encoded.images[0]
    for image, original in zip(row, images, strict=True):
        out = qwen.processor(images=[original], return_tensors="pt")
        assert torch.equal(image.tensors["image_grid_thw"], out["image_grid_thw"])
        assert torch.equal(image.tensors["pixel_values"], out["pixel_values"])
        t, h, w = out["image_grid_thw"][0].tolist()
        assert image.grid == (t, h, w) and image.num_tokens == t * h * w // 4
        assert image.picture.size == (w * 14, h * 14)  # resized once, to the processor's size
    ids = torch.tensor(encoded.ids[0])
    runs = (ids == qwen.spec.placeholder_id).int()
    starts = (runs[1:] > runs[:-1]).nonzero().flatten() + 1
    lengths = [int(runs[s:].cumprod(0).sum()) for s in starts]
    assert lengths == [im.num_tokens for im in row] and len(set(lengths)) > 1


def test_a_long_prompt_loses_text_never_an_image(qwen):
    system = {"role": "system", "content": "Think about colours. " * 20}
    prompt = [system, *image_prompt("Which colour?", picture("red"))]
    full = qwen.prompts.encode_image_prompts([prompt], 4096)
    length = len(full.ids[0])
    image_start = full.ids[0].index(qwen.spec.placeholder_id)
    cut = qwen.prompts.encode_image_prompts([prompt], length - image_start + 3)  # a few tokens before the image
    assert cut.num_truncated == 1 and cut.ids[0] == full.ids[0][image_start - 3:]
    with pytest.raises(ValueError, match=r"prompts\[0\] has \d+ tokens with its 1 image\(s\).*would cut an image"):
        qwen.prompts.encode_image_prompts([prompt], length - image_start - 1)


def test_a_template_that_does_not_write_images_is_refused(qwen):
    from lightning_grpo.rollout.image_prompts import ImagePrompts
    from lightning_grpo.rollout.prompts import TemplatePrompts

    tokenizer = qwen.tokenizer.__class__.from_pretrained(qwen.path)
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {% for p in m['content'] %}{% if p['type'] "
                               "== 'text' %}{{ p['text'] }}{% endif %}{% endfor %}\n{% endfor %}")
    prompts = ImagePrompts(TemplatePrompts(tokenizer), tokenizer, qwen.processor, qwen.spec, qwen.policy.config)
    with pytest.raises(ValueError, match=r"prompts\[0\] has 1 image\(s\), but its chat template wrote 0"):
        prompts.encode_image_prompts([image_prompt("Hi", picture())], 4096)


def test_vllm_gets_each_run_collapsed_and_its_expansion_is_checked(qwen):
    images = [picture("red", (64, 48)), picture("blue", (40, 90))]
    encoded = qwen.prompts.encode_image_prompts([image_prompt("Two.", *images)], 4096)
    ids, row = encoded.ids[0], encoded.images[0]
    pad = qwen.spec.placeholder_id
    request = vllm_prompt(ids, row, pad)
    collapsed = request["prompt_token_ids"]
    assert collapsed.count(pad) == 2 and len(collapsed) == len(ids) - sum(im.num_tokens - 1 for im in row)
    assert request["multi_modal_data"]["image"] == [im.picture for im in row]
    check_expansion(ids, ids, 0)
    with pytest.raises(ValueError, match="prompt 3: vLLM expanded the image placeholders into"):
        check_expansion(ids[:-1] + [pad], ids, 3)  # an expansion one token off (verl #1640)
    with pytest.raises(ValueError, match="image features and image tokens do not match"):
        collapse_runs(ids[:-2] if ids[-1] == pad else [t for t in ids if t != pad][:5] + [pad], row, pad)
    restored = PromptImage.from_state(row[0].state())
    with pytest.raises(ValueError, match="no picture"):
        vllm_prompt(ids, (restored, row[1]), pad)


def test_banned_tokens_are_bad_words_only_when_exact(qwen):
    words = bad_words(qwen.tokenizer, qwen.spec.banned_token_ids)
    assert words == ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    assert bad_words(qwen.tokenizer, ()) is None
    merged = next(i for i in range(300, 2000) if len(qwen.tokenizer.convert_ids_to_tokens(i)) > 3
                  and qwen.tokenizer.encode(qwen.tokenizer.convert_ids_to_tokens(i), add_special_tokens=False) != [i])
    with pytest.raises(ValueError, match=f"banned token {merged}"):
        bad_words(qwen.tokenizer, [merged])


def test_pictures_and_images_survive_a_checkpoint(qwen):
    images = [picture("red", (64, 48)), picture("blue", (33, 47))]
    batch = {"prompt": [image_prompt("Two.", *images)], "answer": ["red"]}
    encoded = qwen.prompts.encode_image_prompts(batch["prompt"], 4096)
    rows = [encoded.images[0], encoded.images[0], ()]
    buffer = io.BytesIO()
    torch.save({"batch": pictures_state(batch), "images": row_images_state(rows)}, buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    back = pictures_from_state(state["batch"])
    parts = back["prompt"][0][0]["content"]
    for part, original in zip(parts[:2], images, strict=True):
        assert np.array_equal(np.asarray(part["image"]), np.asarray(original))
    restored = row_images_from_state(state["images"])
    assert restored[0] is restored[1] and restored[2] == ()  # rows that shared their images share them again
    table, saved_rows = state["images"]
    assert row_images_from_state([table, [*saved_rows[:2], None]])[2] == ()  # a checkpoint's None row: no images
    assert row_images_from_state(None) == []  # a checkpoint's rollout without images
    for a, b in zip(restored[0], encoded.images[0], strict=True):
        assert a.num_tokens == b.num_tokens and a.grid == b.grid
        assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in b.tensors)
