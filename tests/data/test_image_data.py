"""Image columns in PromptDataModule (lightning_grpo.data.image_columns):

* an image column of file paths (one per row, or a list: several per prompt), of bytes, or of ``datasets.Image``
  values (Parquet, decoded to PIL): each batch's prompts hold the pictures in their image parts, in order, before
  the question;
* ``max_prompt_length`` counts the images' tokens with the model's processor: a prompt that does not fit is left out
  and counted (``long_prompts="skip"``) or refused naming its row (``"error"``); a prompt is never cut;
* a missing file, bytes that are no image, a missing column: errors naming the row, column and value.
"""

from __future__ import annotations

import io
import json

import datasets
import numpy as np
import pytest

from lightning_grpo.data import PromptDataModule
from support.vision import picture


def _rows(root, count=6):
    rows = []
    for i in range(count):
        path = root / f"{i}.png"
        picture(["red", "green", "blue"][i % 3], (40 + 8 * i, 48)).save(path)
        rows.append({"question": f"Colour {i}?", "answer": ["red", "green", "blue"][i % 3], "image": str(path)})
    return rows


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _batch(data):
    data.setup("fit")
    return next(iter(data.train_dataloader()))


def _images(prompt):
    return [part["image"] for message in prompt for part in message["content"] if part.get("type") == "image"]


def test_paths_and_several_images_per_prompt(tmp_path):
    rows = _rows(tmp_path)
    rows[2]["image"] = [rows[2]["image"], rows[3]["image"]]
    for row in rows:
        row["image"] = row["image"] if isinstance(row["image"], list) else [row["image"]]
    data = PromptDataModule(_write(tmp_path / "d.jsonl", rows), image_field="image", prompts_per_step=6,
                            val_size=0, system_prompt="Look.", seed=0)
    data.setup("fit")
    batch = {k: v for k, v in next(iter(data.train_dataloader())).items()}
    for prompt, paths in zip(batch["prompt"], batch["image"], strict=True):
        system, user = prompt
        assert system["content"] == [{"type": "text", "text": "Look."}]
        images = _images(prompt)
        assert len(images) == len(paths) and [p["type"] for p in user["content"]][-1] == "text"
        from PIL import Image

        for image, path in zip(images, paths, strict=True):
            assert np.array_equal(np.asarray(image), np.asarray(Image.open(path).convert("RGB")))
    assert sorted(len(_images(p)) for p in batch["prompt"]) == [1, 1, 1, 1, 1, 2]


def test_bytes_and_datasets_images_from_parquet(tmp_path):
    rows = _rows(tmp_path, 4)
    encoded = []
    for row in rows:
        buffer = io.BytesIO()
        picture("blue", (30, 30)).save(buffer, format="PNG")
        encoded.append({**row, "raw": buffer.getvalue()})
    table = datasets.Dataset.from_list(encoded).cast_column("image", datasets.Image())
    path = tmp_path / "d.parquet"
    table.to_parquet(str(path))
    for field in ("image", "raw"):
        batch = _batch(PromptDataModule(str(path), image_field=field, prompts_per_step=4, val_size=0))
        assert all(len(_images(p)) == 1 and _images(p)[0].mode == "RGB" for p in batch["prompt"])


def test_long_image_prompts_are_skipped_and_counted_or_refused(tmp_path, tiny_qwen_vl_path):
    rows = _rows(tmp_path)
    big = tmp_path / "big.png"
    picture("red", (400, 400)).save(big)  # 16 image tokens at the tiny processor's 112 x 112 pixel limit
    rows[1]["image"] = [str(big), str(big), str(big)]
    data = _write(tmp_path / "d.jsonl", rows)
    kept = PromptDataModule(data, image_field="image", prompts_per_step=2, val_size=0, max_prompt_length=60,
                            tokenizer=tiny_qwen_vl_path)
    kept.setup("fit")
    assert kept.dropped_prompts == {"train": 1} and len(kept.train_dataset) == 5
    assert all(not isinstance(v, list) for v in kept.train_dataset["image"])
    with pytest.raises(ValueError, match=r"split 'train' row 1: its prompt has \d+ tokens with its 3 image"):
        PromptDataModule(data, image_field="image", prompts_per_step=2, val_size=0, max_prompt_length=60,
                         tokenizer=tiny_qwen_vl_path, long_prompts="error").setup("fit")
    with pytest.raises(ValueError, match="long_prompts='maybe'"):
        PromptDataModule(data, long_prompts="maybe")


@pytest.mark.parametrize("bad", ["missing", "not_an_image", "no_column"])
def test_bad_images_are_named(tmp_path, bad):
    rows = _rows(tmp_path, 2)
    if bad == "missing":
        rows[1]["image"] = str(tmp_path / "nowhere.png")
    elif bad == "not_an_image":
        (tmp_path / "text.png").write_text("not a picture")
        rows[1]["image"] = str(tmp_path / "text.png")
    data = PromptDataModule(_write(tmp_path / "d.jsonl", rows), image_field="picture" if bad == "no_column"
                            else "image", prompts_per_step=2, val_size=0, seed=0)
    message = {"missing": r"\(question 'Colour 1\?'\), column 'image': no image file .*nowhere.png",
               "not_an_image": "column 'image': not an image",
               "no_column": "image_field='picture' is not a column"}[bad]
    with pytest.raises(ValueError, match=message):
        data.setup("fit")
        batches = iter(data.train_dataloader())
        next(batches)


def test_a_row_whose_image_is_null_is_a_text_only_prompt(tmp_path):
    """docs/vision.md: a null image (or an empty list) gives the row's user message no image part, its text alone."""
    rows = _rows(tmp_path, 3)
    rows[1]["image"] = None
    data = PromptDataModule(_write(tmp_path / "d.jsonl", rows), image_field="image", prompts_per_step=3, val_size=0,
                            system_prompt=None, seed=0)
    batch = _batch(data)
    assert sorted(len(_images(p)) for p in batch["prompt"]) == [0, 1, 1]
    (text_only,) = [p for p in batch["prompt"] if not _images(p)]
    (part,) = text_only[0]["content"]
    assert len(text_only) == 1 and part["type"] == "text" and "Colour 1?" in part["text"]
