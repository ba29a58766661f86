"""Vision-language GRPO on a CPU: a LLaVA-style model learns to look at the colour of a shape.

    python recipes/shapes_vlm.py                  # validate, train, validate, report
    python recipes/shapes_vlm.py --max-steps 10   # shorter

The model (:func:`lightning_grpo.models.vision_testing.save_smol_llava`, built once into ``--model-dir``): the
embedded SmolLM2-135M-Instruct as the language model, a small random CLIP vision tower (frozen) and LLaVA's
projector. Trained: the projector in full and LoRA adapters on the language model's attention
(``modules_to_save=["multi_modal_projector"]``). The task (``PromptDataModule("shapes")``,
:mod:`lightning_grpo.data.shapes`): the same question for every picture, "What colour is the shape? Answer with one
word: red, green or blue.", so the answer is in the pixels only; a model that does not look is right a third of the
time. The reward is :func:`~lightning_grpo.data.shapes.shape_colour_accuracy` (the first colour word is the
picture's). Held-out greedy accuracy on ``val_size`` pictures never trained on, before training
(``trainer.validate``) and after it; the run prints the before/after table and the plot's path.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))

import argparse  # noqa: E402
import csv  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Optional  # noqa: E402

import lightning as L  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from lightning_grpo import GRPOConfig, GRPOModule  # noqa: E402
from lightning_grpo.callbacks import CompletionTable, GRPOProgressBar  # noqa: E402
from lightning_grpo.config import EngineConfig, EvalConfig  # noqa: E402
from lightning_grpo.data import PromptDataModule  # noqa: E402
from lightning_grpo.data.shapes import CHANCE, shape_colour_accuracy  # noqa: E402
from lightning_grpo.evaluation.plot import plot_metrics  # noqa: E402
from lightning_grpo.models.embedded import default_model_path  # noqa: E402
from lightning_grpo.models.vision_testing import save_smol_llava  # noqa: E402

#: LoRA on the language model's attention; the projector trained in full (LLaVA's stage-1 module).
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            modules_to_save=["multi_modal_projector"])


def build_model(model_dir: str) -> str:
    """The recipe's LLaVA (SmolLM2 + a random 1-layer CLIP on 28 x 28 pictures: 4 image tokens), built once."""
    if not (Path(model_dir) / "config.json").is_file():
        save_smol_llava(model_dir, default_model_path(), image_size=28, patch_size=14, vision_hidden=64,
                        vision_layers=1, seed=0)
    return model_dir


def _mean(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else float("nan")


def summarize(metrics_csv: Path, first: int = 5) -> dict[str, Any]:
    """Train reward (mean of the first and of the last ``first`` steps), held-out accuracy (first and last
    validation) and the curves of a run's ``metrics.csv``."""
    rows = list(csv.DictReader(open(metrics_csv, newline="")))

    def column(name: str) -> list[tuple[int, float]]:
        return [(int(r["step"]), float(r[name])) for r in rows if r.get(name) not in (None, "")]

    reward, accuracy = column("reward"), column("val/accuracy")
    return {
        "reward": {"first": _mean([v for _, v in reward[:first]]), "last": _mean([v for _, v in reward[-first:]])},
        "heldout_accuracy": {"before": accuracy[0][1] if accuracy else float("nan"),
                             "after": accuracy[-1][1] if len(accuracy) > 1 else float("nan"), "chance": CHANCE},
        "curve": {"step": [s for s, _ in reward], "reward": [v for _, v in reward],
                  "timing_step_s": [v for _, v in column("timing/step_s")]},
        "val_curve": accuracy,
    }


def table(summary: dict[str, Any], first: int = 5) -> str:
    r, a = summary["reward"], summary["heldout_accuracy"]
    return "\n".join([f"{'':36s}{'before':>10s}{'after':>10s}",
                      f"{f'train reward (first/last {first} steps)':36s}{r['first']:>10.3f}{r['last']:>10.3f}",
                      f"{'held-out accuracy (greedy)':36s}{a['before']:>10.3f}{a['after']:>10.3f}"])


def main(max_steps: int = 60, prompts_per_step: int = 4, num_generations: int = 8, max_new_tokens: int = 8,
         learning_rate: float = 5e-4, val_size: int = 150, temperature: float = 1.0, val_every: int = 0,
         root: str = "outputs/shapes_vlm", model_dir: str = "outputs/shapes_vlm/model", seed: int = 0,
         time_limit_min: float = 0.0) -> dict[str, Any]:
    """Validate, train ``max_steps`` GRPO steps (fewer when ``time_limit_min`` > 0 runs out), validate again; print
    the table and the plot's path; return the summary (:func:`summarize` plus ``seconds``, ``plot``, ``log_dir``,
    ``settings``)."""
    start = time.perf_counter()
    L.seed_everything(seed)
    module = GRPOModule(
        model=build_model(model_dir), reward_funcs=[shape_colour_accuracy], lora=LORA,
        config=GRPOConfig(num_generations=num_generations, max_prompt_length=96, max_new_tokens=max_new_tokens,
                          temperature=temperature, beta=0.0, loss_type="dr_grpo", engine=EngineConfig(name="hf"),
                          eval=EvalConfig(max_new_tokens=max_new_tokens)),
        learning_rate=learning_rate, export_dir="",
    )
    data = PromptDataModule("shapes", prompts_per_step=prompts_per_step, val_size=val_size, val_batch_size=50,
                            seed=seed)
    logger = CSVLogger(root, name="lightning_logs")
    trainer = L.Trainer(
        max_steps=max_steps, log_every_n_steps=1, gradient_clip_val=1.0, num_sanity_val_steps=0,
        val_check_interval=val_every or max_steps, check_val_every_n_epoch=None, logger=logger,
        callbacks=[CompletionTable(every_n_steps=5, print_every_n_steps=0), GRPOProgressBar()],
        default_root_dir=root, enable_model_summary=False, enable_checkpointing=False,
        max_time={"minutes": time_limit_min} if time_limit_min > 0 else None,
    )
    trainer.validate(module, datamodule=data)  # the held-out accuracy before training, logged at step 0
    trainer.fit(module, datamodule=data)
    if trainer.global_step % (val_every or max_steps):  # stopped by the time limit between validations
        trainer.validate(module, datamodule=data)
    log_dir = Path(logger.log_dir)
    summary = summarize(log_dir / "metrics.csv")
    summary["plot"] = str(plot_metrics(log_dir, title="GRPO on shapes: SmolLM2 + a small CLIP (LLaVA), CPU"))
    summary["log_dir"] = str(log_dir)
    summary["steps"] = trainer.global_step
    summary["seconds"] = time.perf_counter() - start
    summary["settings"] = dict(max_steps=max_steps, prompts_per_step=prompts_per_step, num_generations=num_generations,
                               max_new_tokens=max_new_tokens, learning_rate=learning_rate, val_size=val_size,
                               temperature=temperature, seed=seed, lora=LORA, time_limit_min=time_limit_min)
    print(table(summary))
    print(f"plot: {summary['plot']}\ntook {summary['seconds'] / 60:.1f} min ({trainer.global_step} steps)")
    return summary


def parse_args(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = main.__defaults__  # type: ignore[attr-defined]
    names = main.__code__.co_varnames[: main.__code__.co_argcount]
    for name, default in zip(names, defaults, strict=True):
        parser.add_argument("--" + name.replace("_", "-"), type=type(default), default=default)
    return {k.replace("-", "_"): v for k, v in vars(parser.parse_args(argv)).items()}


if __name__ == "__main__":
    main(**parse_args())
