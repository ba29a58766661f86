"""Vision-language GRPO steps under 1 and 2 processes, run as a script (``python tests/support/vision_worker.py
<config.json>``, the way :mod:`support.dist` runs its workers): one optimizer step on a fixed rollout of image
prompts (each rank the rows of its own prompts, images included), recording what ``support.dist.assert_same_step``
compares (loss, post-clip gradients, weights)."""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path[:0] = [str(Path(__file__).resolve().parents[i]) for i in (2, 1)]  # the checkout, tests/ (for support.*)

collecting = gc.isenabled()  # the cyclic collector is paused while the libraries below are imported
gc.disable()  # (why: lightning_grpo/__init__.py)
import lightning as L  # noqa: E402
import torch  # noqa: E402

from lightning_grpo import GRPOConfig, GRPOModule  # noqa: E402
from support.dist_worker import GradRecording, IndexPrompts, StepRecorder, make_strategy, rank_file  # noqa: E402
from support.vision import Loaded, image_experience, image_prompt, picture  # noqa: E402

if collecting:
    gc.enable()

COLOURS = ["red", "green", "blue", "red"]
SIZES = [(64, 48), (40, 90), (56, 56), (90, 60)]


def fixed_rollout(loaded: Loaded, g: int):
    """4 image prompts (a second image in prompt 1), ``g`` rows each with completions of 1..6 tokens."""
    prompts = [image_prompt("Colour?", picture(c, s)) for c, s in zip(COLOURS, SIZES, strict=True)]
    prompts[1] = image_prompt("Colour?", picture("green", (40, 90)), picture("blue", (30, 30)))
    gen = torch.Generator().manual_seed(0)
    completions = [torch.randint(10, 2000, (int(n),), generator=gen).tolist()
                   for n in torch.randint(1, 7, (4 * g,), generator=gen)]
    advantages = torch.randn(4 * g, generator=gen)
    return image_experience(loaded, prompts, completions, g, advantages)


class FixedImageModule(GradRecording, GRPOModule):
    """GRPOModule whose rollout is the rows (and images) of this rank's prompts of a fixed image rollout."""

    def __init__(self, *args, fixed, num_generations: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.fixed, self.g = fixed, num_generations

    def make_experience(self, batch, **kwargs):
        rows = torch.cat([torch.arange(i * self.g, (i + 1) * self.g) for i in batch["index"]])
        return self.fixed.select(rows)


def image_step(cfg: dict) -> None:
    torch.manual_seed(0)
    g = 2
    loaded = Loaded(cfg["model"])
    module = FixedImageModule(cfg["model"], reward_funcs=[lambda p, c, **k: [0.0] * len(c)], learning_rate=1e-3,
                              config=GRPOConfig(num_generations=g, max_new_tokens=7, **cfg.get("knobs", {})),
                              fixed=fixed_rollout(loaded, g), num_generations=g, export_dir="")
    recorder = StepRecorder()
    trainer = L.Trainer(accelerator="cpu", devices=cfg["devices"], strategy=make_strategy(cfg["strategy"]),
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[recorder], default_root_dir=cfg["out"])
    trainer.fit(module, datamodule=IndexPrompts(4, 4 // cfg["devices"]))
    record = recorder.records[-1]
    record["ref_logprobs"] = {}
    torch.save(record, rank_file(cfg["out"], "image_step", trainer.global_rank))


if __name__ == "__main__":
    torch.set_num_threads(1)
    with open(sys.argv[1]) as f:
        config = json.load(f)
    {"image_step": image_step}[config["scenario"]](config)
    from support.exit import end_if_launched_rank

    end_if_launched_rank()
