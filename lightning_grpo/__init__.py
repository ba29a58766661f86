"""GRPO for language models as a PyTorch Lightning plugin."""

from lightning_grpo import strategies  # noqa: F401  (registers the "grpo_fsdp2" strategy names)
from lightning_grpo.config import EngineConfig, EvalConfig, GRPOConfig
from lightning_grpo.module import GRPOModule
from lightning_grpo.runtime.checkpointing import install_last_checkpoint_fallback

__all__ = ["EngineConfig", "EvalConfig", "GRPOConfig", "GRPOModule", "PromptDataModule"]
__version__ = "0.1.0"

# fit(ckpt_path="last") resumes from the newest complete checkpoint when no complete last.ckpt exists
install_last_checkpoint_fallback()


def __getattr__(name: str):
    if name == "PromptDataModule":
        from lightning_grpo.data import PromptDataModule

        return PromptDataModule
    raise AttributeError(name)
