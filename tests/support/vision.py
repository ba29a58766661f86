"""Helpers of the vision-language tests: pictures drawn here (shapes of a colour on a background), prompts with image
parts, the tiny models' pieces loaded once (policy, tokenizer, image processor, :class:`ImagePrompts`), and an
experience of image prompts for the training layouts."""

from __future__ import annotations

from typing import Any, Optional

import torch
from PIL import Image, ImageDraw

from lightning_grpo.models.vision_loading import load_image_processor, load_vision_policy
from lightning_grpo.protocols.rollout import left_pad
from lightning_grpo.protocols.vision import vision_spec
from lightning_grpo.rollout.image_prompts import ImagePrompts
from lightning_grpo.rollout.prompts import TemplatePrompts
from lightning_grpo.training.experience import Experience

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220)}


def picture(colour: str = "red", size: tuple[int, int] = (64, 48), shape: str = "ellipse",
            background: str = "white") -> Image.Image:
    """An RGB picture of ``size`` (width, height): one ``shape`` ("ellipse", "rectangle") of ``colour`` in the
    middle."""
    image = Image.new("RGB", size, background)
    w, h = size
    box = (w // 5, h // 5, 4 * w // 5, 4 * h // 5)
    draw = ImageDraw.Draw(image)
    (draw.ellipse if shape == "ellipse" else draw.rectangle)(box, fill=COLOURS.get(colour, colour))
    return image


def image_prompt(text: str, *images: Image.Image) -> list[dict]:
    """One user message: the images' parts, then the text."""
    return [{"role": "user", "content": [*({"type": "image", "image": im} for im in images),
                                         {"type": "text", "text": text}]}]


class Loaded:
    """A tiny vision-language checkpoint's pieces: ``policy`` (eval, float32), ``tokenizer``, ``processor``,
    ``spec``, ``prompts`` (:class:`ImagePrompts` over the chat template)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.path = path
        self.policy = load_vision_policy(path, torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.processor = load_image_processor(path)
        spec = vision_spec(self.policy.config)
        assert spec is not None
        self.spec = spec
        self.prompts = ImagePrompts(TemplatePrompts(self.tokenizer), self.tokenizer, self.processor, spec,
                                    self.policy.config)


def image_experience(loaded: Loaded, prompts: list[Any], completions: list[list[int]], num_generations: int,
                     advantages: Optional[torch.Tensor] = None) -> Experience:
    """An :class:`Experience` of ``prompts`` (with images), each repeated ``num_generations`` times, and the given
    completion ids (one list per row, right-padded here; the mask covers each list)."""
    encoded = loaded.prompts.encode_image_prompts(prompts, 4096)
    ids, mask = left_pad(encoded.ids, int(loaded.tokenizer.pad_token_id), torch.device("cpu"))
    g = num_generations
    t = max(len(c) for c in completions)
    completion_ids = torch.full((len(completions), t), int(loaded.tokenizer.pad_token_id), dtype=torch.long)
    completion_mask = torch.zeros((len(completions), t), dtype=torch.long)
    for i, c in enumerate(completions):
        completion_ids[i, : len(c)] = torch.tensor(c)
        completion_mask[i, : len(c)] = 1
    n = len(completions)
    return Experience(prompt_ids=ids.repeat_interleave(g, dim=0), prompt_mask=mask.repeat_interleave(g, dim=0),
                      completion_ids=completion_ids, completion_mask=completion_mask,
                      advantages=advantages if advantages is not None else torch.linspace(-1.0, 1.0, n),
                      images=[row for row in encoded.images for _ in range(g)])
