"""Vision-language GRPO on a CPU: a LLaVA-style model learns to look at the colour of a shape.

    python recipes/shapes_vlm.py                  # validate, align, validate, train, validate, report
    python recipes/shapes_vlm.py --max-steps 10   # shorter

The model (:func:`lightning_grpo.demos.tiny_vision_models.save_smol_llava`, built once into ``--model-dir``): the
embedded SmolLM2-135M-Instruct as the language model, a small random CLIP vision tower (frozen) and LLaVA's
projector, new. Two stages, as LLaVA trains (then RL):

1. **Projector alignment** (:class:`~lightning_grpo.models.projector_alignment.ProjectorAlignment`, LLaVA's stage 1):
   the projector alone, on captions of the training pictures ("Describe the picture." -> "The shape is red."),
   ``--align-steps`` steps. It never sees the question.
2. **GRPO**: the projector alone by default (``--grpo-trains projector``; ``lora`` or ``lora+projector`` put LoRA
   adapters on the language model's attention, which collapsed onto one colour in the pilots of docs/vision.md),
   rewarded by :func:`~lightning_grpo.data.shapes.shape_colour_accuracy` (the first colour word is the picture's).

The task (``PromptDataModule("shapes")``, :mod:`lightning_grpo.data.shapes`): the same question for every picture,
"What colour is the shape? Answer with one word: red, green or blue.", so the answer is in the pixels only; a model
that does not look is right a third of the time. Held-out greedy accuracy on ``val_size`` pictures never trained on:
of the new model, after the alignment and after GRPO; the run prints the table and the plot's path.
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
import torch  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from lightning_grpo import GRPOConfig, GRPOModule  # noqa: E402
from lightning_grpo.callbacks import CompletionTable, GRPOProgressBar  # noqa: E402
from lightning_grpo.config import EngineConfig, EvalConfig  # noqa: E402
from lightning_grpo.data import PromptDataModule  # noqa: E402
from lightning_grpo.data.shapes import CHANCE, shape_colour_accuracy  # noqa: E402
from lightning_grpo.demos.tiny_vision_models import save_smol_llava  # noqa: E402
from lightning_grpo.evaluation.plot import plot_metrics  # noqa: E402
from lightning_grpo.models.embedded import default_model_path  # noqa: E402
from lightning_grpo.models.projector_alignment import ProjectorAlignment, caption_loader, train_only  # noqa: E402

#: LoRA on the language model's attention; the projector trained in full (LLaVA's stage-1 module).
LORA = dict(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
            modules_to_save=["multi_modal_projector"])

#: What GRPO trains (``--grpo-trains``): the LoRA config, or None for the projector alone (no LoRA).
GRPO_TRAINS: dict[str, Optional[dict]] = {
    "lora+projector": LORA, "lora": {k: v for k, v in LORA.items() if k != "modules_to_save"}, "projector": None}


def build_model(model_dir: str) -> str:
    """The recipe's LLaVA (SmolLM2 + a random 1-layer CLIP on 28 x 28 pictures: 4 image tokens), built once."""
    if not (Path(model_dir) / "config.json").is_file():
        save_smol_llava(model_dir, default_model_path(), image_size=28, patch_size=14, vision_hidden=64,
                        vision_layers=1, seed=0)
    return model_dir


def align(model_dir: str, dest: str, steps: int, batch_size: int, learning_rate: float, seed: int,
          root: str, caption: str = "The shape is {colour}.") -> str:
    """Stage 1: the projector alone on captions of the training pictures (``caption`` with the picture's colour),
    saved into ``dest``."""
    if steps <= 0:
        return model_dir
    from lightning_grpo.data.shapes import shapes_splits

    rows = [{"image": r["image"], "caption": caption.format(colour=r["answer"])} for r in shapes_splits(seed)["train"]]
    stage = ProjectorAlignment(model_dir, learning_rate=learning_rate)
    logger = CSVLogger(root, name="alignment")
    print(f"alignment: {steps} steps of {batch_size} captions (the projector alone), log in {logger.log_dir}")
    L.Trainer(max_steps=steps, max_epochs=-1, log_every_n_steps=10, logger=logger, enable_checkpointing=False,
              enable_model_summary=False, enable_progress_bar=False, default_root_dir=root,
              ).fit(stage, train_dataloaders=caption_loader(rows, batch_size, seed))
    return stage.save(dest)


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
    """The held-out greedy accuracy of the new model, after the alignment and after GRPO; GRPO's train reward."""
    r, a = summary["heldout_accuracy"], summary["reward"]
    return "\n".join([f"{'':36s}{'new':>10s}{'aligned':>10s}{'GRPO':>10s}",
                      f"{'held-out accuracy (greedy)':36s}{r.get('new_model', float('nan')):>10.3f}"
                      f"{r['before']:>10.3f}{r['after']:>10.3f}",
                      f"{f'train reward (first/last {first} GRPO steps)':36s}{'':>10s}{a['first']:>10.3f}"
                      f"{a['last']:>10.3f}"])


def main(max_steps: int = 60, prompts_per_step: int = 4, num_generations: int = 8, max_new_tokens: int = 8,
         learning_rate: float = 1e-4, val_size: int = 150, temperature: float = 1.0, val_every: int = 0,
         root: str = "outputs/shapes_vlm", model_dir: str = "outputs/shapes_vlm/model", seed: int = 0,
         time_limit_min: float = 0.0, align_steps: int = 150, align_batch_size: int = 8,
         align_learning_rate: float = 2e-3, align_caption: str = "The shape is {colour}.",
         validate_new_model: bool = True,
         grpo_trains: str = "projector", beta: float = 0.0) -> dict[str, Any]:
    """Validate the new model (``validate_new_model``), align its projector (``align_steps``; 0: no alignment),
    validate, train ``max_steps`` GRPO steps (fewer when the whole run's ``time_limit_min`` > 0 minutes run out: GRPO
    stops a minute before, the last validation's time), validate again; print the
    table and the plot's path; return the summary (:func:`summarize` plus ``seconds``, ``stage_seconds``, ``plot``,
    ``log_dir``, ``settings``)."""
    start = time.perf_counter()
    data = PromptDataModule("shapes", prompts_per_step=prompts_per_step, val_size=val_size, val_batch_size=50,
                            seed=seed)
    config = GRPOConfig(num_generations=num_generations, max_prompt_length=96, max_new_tokens=max_new_tokens,
                        temperature=temperature, beta=beta, loss_type="dr_grpo", engine=EngineConfig(name="hf"),
                        eval=EvalConfig(max_new_tokens=max_new_tokens))

    if grpo_trains not in GRPO_TRAINS:
        raise ValueError(f"grpo_trains={grpo_trains!r}: one of {sorted(GRPO_TRAINS)}")
    lora = GRPO_TRAINS[grpo_trains]

    def grpo_module(path: str) -> GRPOModule:
        model: Any = path
        if lora is None:  # the projector alone: every other weight frozen
            from lightning_grpo.models.vision_loading import load_vision_policy

            model = load_vision_policy(path, torch.float32)
            train_only(model, ["multi_modal_projector"])
        return GRPOModule(model=model, tokenizer=path, processor=path, reward_funcs=[shape_colour_accuracy],
                          lora=lora, config=config, learning_rate=learning_rate, export_dir="")

    base, seconds = build_model(model_dir), {}
    new_model = float("nan")
    if validate_new_model:  # the held-out accuracy of the new model (random projector)
        new_model = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False).validate(
            grpo_module(base), datamodule=data, verbose=False)[0]["val/accuracy"]
    seconds["load_and_validate_new_model"] = time.perf_counter() - start
    L.seed_everything(seed)
    aligned = align(base, str(Path(root) / "aligned"), align_steps, align_batch_size, align_learning_rate, seed, root,
                    align_caption)
    seconds["alignment"] = time.perf_counter() - start - sum(seconds.values())
    L.seed_everything(seed)
    module = grpo_module(aligned)
    logger = CSVLogger(root, name="lightning_logs")
    trainer = L.Trainer(
        max_steps=max_steps, log_every_n_steps=1, gradient_clip_val=1.0, num_sanity_val_steps=0,
        val_check_interval=val_every or max_steps, check_val_every_n_epoch=None, logger=logger,
        callbacks=[CompletionTable(every_n_steps=5, print_every_n_steps=0), GRPOProgressBar()],
        default_root_dir=root, enable_model_summary=False, enable_checkpointing=False,
        max_time=None if time_limit_min <= 0 else  # the whole run's budget, a minute kept for the last validation
        {"minutes": max(0.0, time_limit_min - 1.0 - (time.perf_counter() - start) / 60)},
    )
    trainer.validate(module, datamodule=data)  # the held-out accuracy before GRPO, logged at step 0
    trainer.fit(module, datamodule=data)
    if trainer.global_step % (val_every or max_steps):  # stopped by the time limit between validations
        trainer.validate(module, datamodule=data)
    seconds["grpo"] = time.perf_counter() - start - sum(seconds.values())
    log_dir = Path(logger.log_dir)
    summary = summarize(log_dir / "metrics.csv")
    summary["heldout_accuracy"]["new_model"] = new_model
    summary["plot"] = str(plot_metrics(log_dir, title="GRPO on shapes: SmolLM2 + a small CLIP (LLaVA), CPU"))
    summary["log_dir"] = str(log_dir)
    summary["steps"] = trainer.global_step
    summary["seconds"] = time.perf_counter() - start
    summary["stage_seconds"] = seconds
    summary["settings"] = dict(max_steps=max_steps, prompts_per_step=prompts_per_step, num_generations=num_generations,
                               max_new_tokens=max_new_tokens, learning_rate=learning_rate, val_size=val_size,
                               temperature=temperature, seed=seed, lora=lora, time_limit_min=time_limit_min,
                               align_steps=align_steps, align_batch_size=align_batch_size,
                               align_learning_rate=align_learning_rate, align_caption=align_caption,
                               grpo_trains=grpo_trains, beta=beta)
    print(table(summary))
    print(f"plot: {summary['plot']}\ntook {summary['seconds'] / 60:.1f} min (alignment {align_steps} steps, "
          f"GRPO {trainer.global_step} steps)")
    return summary


def _flag(value: str) -> bool:
    if value.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"{value!r}: true or false")
    return value.lower() == "true"


def parse_args(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = main.__defaults__  # type: ignore[attr-defined]
    names = main.__code__.co_varnames[: main.__code__.co_argcount]
    for name, default in zip(names, defaults, strict=True):
        parser.add_argument("--" + name.replace("_", "-"), type=_flag if isinstance(default, bool) else type(default),
                            default=default)
    return {k.replace("-", "_"): v for k, v in vars(parser.parse_args(argv)).items()}


if __name__ == "__main__":
    main(**parse_args())
