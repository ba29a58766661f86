"""A seeded synthetic visual task: the colour of a shape drawn with PIL, which no model can answer without looking.

``PromptDataModule("shapes")`` (the image column ``image`` is then set for you): each row is
``{"question": "What colour is the shape? ...", "answer": "green", "image": <PIL image>}``, one ellipse, rectangle or
triangle of a random size and position, in red, green or blue (each channel jittered), on a light background
(jittered too). The question is the same in every row, so the answer is in the pixels only; the three colours are
equally likely, so a model that does not look is right a third of the time (:data:`CHANCE`).

Rows are drawn from :class:`random.Random` seeded with ``seed`` (the same splits on every machine): the test split
first, then the train split, from one stream, so no test picture is a train picture.
"""

from __future__ import annotations

import random
import re
from typing import Any

#: Dataset name of the task.
SHAPES_NAME = re.compile(r"shapes")
#: The colours and their base RGB values.
COLOURS = {"red": (200, 30, 30), "green": (30, 160, 50), "blue": (40, 60, 210)}
#: The accuracy of a model that does not look (a third: three equally likely colours).
CHANCE = 1 / len(COLOURS)
#: The question of every row.
QUESTION = "What colour is the shape? Answer with one word: red, green or blue."
#: Train and test sizes of :func:`shapes_splits`.
TRAIN_SIZE, TEST_SIZE = 3000, 150


def draw_shape(rng: random.Random, colour: str, size: int = 56) -> Any:
    """One ``size`` x ``size`` RGB picture: a random ellipse, rectangle or triangle of ``colour`` (jittered), at
    least a third of the side across, on a light jittered background."""
    from PIL import Image, ImageDraw

    background = tuple(rng.randint(215, 255) for _ in range(3))
    image = Image.new("RGB", (size, size), background)
    fill = tuple(min(255, max(0, c + rng.randint(-25, 25))) for c in COLOURS[colour])
    side = rng.randint(size // 3, size - 4)
    x, y = rng.randint(0, size - side), rng.randint(0, size - side)
    draw = ImageDraw.Draw(image)
    kind = rng.choice(["ellipse", "rectangle", "triangle"])
    if kind == "ellipse":
        draw.ellipse((x, y, x + side, y + side), fill=fill)
    elif kind == "rectangle":
        draw.rectangle((x, y, x + side, y + side // 2 + rng.randint(0, side // 2)), fill=fill)
    else:
        draw.polygon([(x, y + side), (x + side, y + side), (x + side // 2, y)], fill=fill)
    return image


def shapes_splits(seed: int = 0, train_size: int = TRAIN_SIZE, test_size: int = TEST_SIZE,
                  size: int = 56) -> dict[str, list[dict[str, Any]]]:
    """The train and test splits of the task (see the module docstring)."""
    rng = random.Random(seed)

    def row() -> dict[str, Any]:
        colour = rng.choice(sorted(COLOURS))
        return {"question": QUESTION, "answer": colour, "image": draw_shape(rng, colour, size)}

    test = [row() for _ in range(test_size)]
    return {"train": [row() for _ in range(train_size)], "test": test}


def colour_answer(completion: str) -> str | None:
    """The first colour word of ``completion`` (case-insensitive, whole words), or None."""
    match = re.search(r"\b(red|green|blue)\b", completion.lower())
    return match.group(1) if match else None


def shape_colour_accuracy(prompts: list, completions: list[str], answer: list[str], **columns: Any) -> list[float]:
    """1.0 when a completion's first colour word is the row's ``answer``, else 0.0 (no colour word: 0.0)."""
    return [float(colour_answer(c) == a) for c, a in zip(completions, answer, strict=True)]
