"""LLaVA's stage 1 (lightning_grpo/models/projector_alignment.py) on the tiny random LLaVA: which tokens are scored,
the loss against a hand-written cross-entropy, that only the projector moves, the saved folder, bad settings."""

from __future__ import annotations

import random

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from lightning_grpo.data.shapes import draw_shape
from lightning_grpo.models.projector_alignment import ProjectorAlignment, caption_loader


@pytest.fixture(scope="module")
def rows():
    rng = random.Random(0)
    colours = ["red", "green", "blue", "red"]
    return [{"image": draw_shape(rng, c), "caption": f"A {c} shape." + " It is big." * i}
            for i, c in enumerate(colours)]


def test_only_the_caption_and_its_end_of_turn_are_scored(tiny_llava_path, rows):
    align = ProjectorAlignment(tiny_llava_path)
    tokenizer = align.processor.tokenizer
    batch = align.encode([r["image"] for r in rows], [r["caption"] for r in rows])
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    for i, row in enumerate(rows):
        ids, labels, mask = batch["input_ids"][i], batch["labels"][i], batch["attention_mask"][i]
        scored = labels[labels != -100].tolist()
        assert scored == tokenizer(row["caption"] + "<|im_end|>", add_special_tokens=False)["input_ids"]
        length = int(mask.sum())
        assert mask[:length].all() and not mask[length:].any()  # right padding
        assert ids[length - len(scored):length].tolist() == scored  # the caption ends the row
        assert (ids[:length - len(scored)] == image_id).sum() == 16  # 56 / 14 = 4 x 4 image tokens, in the prompt
        prompt = tokenizer.decode(ids[:length - len(scored)]).replace("<image>", "")
        assert prompt.endswith("Describe the picture.<|im_end|>\n<|im_start|>assistant\n")
    assert batch["pixel_values"].shape == (4, 3, 56, 56)


def test_loss_is_the_mean_cross_entropy_of_the_caption_tokens(tiny_llava_path, rows):
    align = ProjectorAlignment(tiny_llava_path)
    batch = align.encode([r["image"] for r in rows], [r["caption"] for r in rows])
    loss = align.loss([r["image"] for r in rows], [r["caption"] for r in rows])
    logits = align.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         pixel_values=batch["pixel_values"]).logits
    targets = batch["labels"][:, 1:]
    per_token = F.cross_entropy(logits[:, :-1].transpose(1, 2), targets.clamp(min=0), reduction="none")
    expected = per_token[targets != -100].mean()
    torch.testing.assert_close(loss, expected)


def test_a_fit_moves_the_projector_alone_and_lowers_the_loss(tiny_llava_path, rows, tmp_path):
    torch.manual_seed(0)
    align = ProjectorAlignment(tiny_llava_path, learning_rate=1e-2)
    before = {n: p.detach().clone() for n, p in align.model.named_parameters()}
    images, captions = [r["image"] for r in rows], [r["caption"] for r in rows]
    with torch.no_grad():
        first = align.loss(images, captions).item()
    loader = caption_loader(rows * 2, batch_size=4, seed=0)
    L.Trainer(max_steps=20, max_epochs=-1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, accelerator="cpu").fit(align, train_dataloaders=loader)
    with torch.no_grad():
        last = align.loss(images, captions).item()
    assert first - last > 0.1, (first, last)  # 7.61 -> 7.44: what a projector can move in a random 2-layer LM
    changed = {n for n, p in align.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(".multi_modal_projector." in "." + n for n in changed), sorted(changed)
    assert len(changed) == 4  # linear_1 and linear_2, weight and bias
    from transformers import AutoModelForImageTextToText

    saved = AutoModelForImageTextToText.from_pretrained(align.save(str(tmp_path / "aligned")), dtype=torch.float32)
    for name, parameter in saved.named_parameters():
        assert torch.equal(parameter, dict(align.model.named_parameters())[name]), name
    assert (tmp_path / "aligned" / "processor_config.json").is_file() or (tmp_path / "aligned" /
                                                                         "preprocessor_config.json").is_file()


def test_bad_settings_are_errors_naming_them(tiny_llava_path):
    with pytest.raises(ValueError, match=r"trainable=\['projector'\]: no parameter"):
        ProjectorAlignment(tiny_llava_path, trainable=("projector",))
    with pytest.raises(ValueError, match="learning_rate=0.0: must be positive"):
        ProjectorAlignment(tiny_llava_path, learning_rate=0.0)


def test_caption_loader_batches_are_shuffled_by_the_seed_and_complete(rows):
    first = [b["captions"] for b in caption_loader(rows, batch_size=3, seed=1)]
    again = [b["captions"] for b in caption_loader(rows, batch_size=3, seed=1)]
    assert first == again and len(first) == 1 and len(first[0]) == 3  # 4 rows: one batch of 3, the rest dropped
    seen = {c for b in caption_loader(rows, batch_size=1, seed=2) for c in b["captions"]}
    assert seen == {r["caption"] for r in rows}
