"""GRPO on MATH-style problems, offline: MATH-500 split into disjoint train and held-out parts.

    python recipes/math_grpo.py                      # 5 steps on a 2-core CPU (a smoke run, not a learning claim)
    python recipes/math_grpo.py --max-steps 200 --engine vllm

Only MATH-500 (``../shared/data/math500/test.jsonl``, the 500-problem test subset of Lightman et al. 2023) is
available offline, so the recipe writes a seeded split of it into ``<root>/data/{train,test}.jsonl``: ``val_size``
held-out problems (never trained on) and the rest for training; the answer is checked by ``math_accuracy``
(math-verify on ``\\boxed{}``), with a small reward for having a ``\\boxed{}`` at all. For a real MATH run, point
``--dataset`` at a folder holding the MATH train split as ``train.jsonl`` (columns ``problem``, ``solution``,
``answer``) and evaluate with ``lightning-grpo test --config recipes/eval.yaml`` (MATH-500 stays held out then).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Optional

import lightning as L
from lightning.pytorch.loggers import CSVLogger

from lightning_grpo import GRPOConfig, GRPOModule
from lightning_grpo.callbacks import CompletionTable, GRPOModelCheckpoint, GRPOProgressBar
from lightning_grpo.config import EngineConfig
from lightning_grpo.data import PromptDataModule
from lightning_grpo.data.datamodule import MATH_INSTRUCTION, default_data_dirs
from lightning_grpo.evaluation.plot import plot_metrics


def boxed_format(prompts: list, completions: list[str], **kwargs) -> list[float]:
    """1.0 when the completion puts an answer in ``\\boxed{...}``, else 0.0."""
    return [1.0 if "\\boxed{" in c else 0.0 for c in completions]


def split_math500(root: Path, val_size: int, seed: int) -> Path:
    """Write a seeded split of MATH-500 into ``root/{train,test}.jsonl`` (``val_size`` test rows); returns ``root``.

    Raises:
        FileNotFoundError: no offline MATH-500 (the folders tried are named).
    """
    tried = [d / "math500" / "test.jsonl" for d in default_data_dirs()]
    source = next((p for p in tried if p.is_file()), None)
    if source is None:
        raise FileNotFoundError(f"no offline MATH-500 at {[str(p) for p in tried]}")
    rows = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    random.Random(seed).shuffle(rows)
    root.mkdir(parents=True, exist_ok=True)
    for name, part in (("test", rows[:val_size]), ("train", rows[val_size:])):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    return root


def main(max_steps: int = 5, prompts_per_step: int = 2, num_generations: int = 4, max_new_tokens: int = 256,
         val_size: int = 50, learning_rate: float = 1e-6, engine: str = "auto", dataset: Optional[str] = None,
         root: str = "outputs/math_grpo", model: str = "embedded", seed: int = 42) -> L.Trainer:
    L.seed_everything(seed)
    folder = dataset or str(split_math500(Path(root) / "data", val_size, seed))
    module = GRPOModule(
        model=model,
        reward_funcs=["math_accuracy", boxed_format],
        reward_weights=[1.0, 0.1],
        config=GRPOConfig(num_generations=num_generations, max_prompt_length=512, max_new_tokens=max_new_tokens,
                          beta=0.0, loss_type="dr_grpo", engine=EngineConfig(name=engine)),
        learning_rate=learning_rate,
    )
    data = PromptDataModule(folder, prompts_per_step=prompts_per_step, val_size=val_size, val_batch_size=val_size,
                            instruction=MATH_INSTRUCTION, question_field="problem", solution_field="solution",
                            seed=seed)
    logger = CSVLogger(root, name="lightning_logs")
    trainer = L.Trainer(
        max_steps=max_steps, gradient_clip_val=1.0, log_every_n_steps=1, val_check_interval=max_steps,
        check_val_every_n_epoch=None, num_sanity_val_steps=0, logger=logger, default_root_dir=root,
        callbacks=[GRPOModelCheckpoint(save_last="link", every_n_train_steps=max_steps, save_on_exception=True),
                   CompletionTable(), GRPOProgressBar()],
    )
    trainer.fit(module, datamodule=data)
    print(f"plot: {plot_metrics(logger.log_dir)}")
    return trainer


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=5)
    parser.add_argument("--engine", default="auto", choices=["auto", "hf", "vllm"])
    parser.add_argument("--dataset", default=None, help="a folder with train.jsonl/test.jsonl instead of MATH-500")
    main(**{k.replace("-", "_"): v for k, v in vars(parser.parse_args()).items()})
