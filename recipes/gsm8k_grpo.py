"""GRPO on GSM8K with the embedded SmolLM2-135M-Instruct: the Python-API twin of gsm8k_grpo.yaml.

    python recipes/gsm8k_grpo.py                # 10 steps, as the YAML recipe
    python recipes/gsm8k_grpo.py --max-steps 50
    python recipes/gsm8k_grpo.py --precision bf16-mixed

Validates before and after training and prints the before/after table (lightning_grpo.evaluation.report) and the plot's
path.
"""

import argparse

import lightning as L
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.loggers import CSVLogger

from lightning_grpo import GRPOConfig, GRPOModule
from lightning_grpo.callbacks import CompletionTable, GRPOModelCheckpoint
from lightning_grpo.config import EngineConfig, EvalConfig
from lightning_grpo.data import PromptDataModule
from lightning_grpo.evaluation.report import fit_report


def main(max_steps: int = 10, prompts_per_step: int = 4, num_generations: int = 8, max_new_tokens: int = 160,
         val_size: int = 50, accumulate_grad_batches: int = 4, root: str = "outputs/gsm8k_grpo_py",
         model: str = "embedded", engine: str = "auto", precision: str = "32-true") -> L.Trainer:
    L.seed_everything(42)
    module = GRPOModule(
        model=model,
        reward_funcs=["gsm8k_accuracy", "gsm8k_format"],
        reward_weights=[1.0, 0.2],
        config=GRPOConfig(num_generations=num_generations, max_prompt_length=512, max_new_tokens=max_new_tokens,
                          beta=0.0, eval=EvalConfig(max_new_tokens=200), engine=EngineConfig(name=engine)),
        learning_rate=1e-5,
    )
    data = PromptDataModule("gsm8k", prompts_per_step=prompts_per_step, val_size=val_size, val_batch_size=50,
                            num_fewshot=1)
    trainer = L.Trainer(
        max_steps=max_steps,
        accumulate_grad_batches=accumulate_grad_batches,  # micro-batches per optimizer step
        gradient_clip_val=1.0,
        precision=precision,  # "bf16-mixed": float32 weights, bf16 compute (docs/performance.md, bf16)
        log_every_n_steps=1,
        val_check_interval=accumulate_grad_batches * max_steps,  # validate once, after the last step
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=CSVLogger(root),
        callbacks=[GRPOModelCheckpoint(save_last="link", every_n_train_steps=max_steps, save_on_exception=True),
                   LearningRateMonitor("step"), CompletionTable(every_n_steps=1)],
        default_root_dir=root,
    )
    if val_size:
        trainer.validate(module, datamodule=data)  # the held-out "before"
    trainer.fit(module, datamodule=data)
    print(fit_report(trainer))
    return trainer


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--precision", default="32-true", help="Lightning's: 32-true, bf16-mixed or bf16-true")
    main(**{k.replace("-", "_"): v for k, v in vars(parser.parse_args()).items()})
