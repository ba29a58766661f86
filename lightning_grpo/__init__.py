"""GRPO for language models as a PyTorch Lightning plugin."""

from lightning_grpo import strategies  # noqa: F401  (registers the "grpo_fsdp2" strategy names)
from lightning_grpo.config import EngineConfig, EvalConfig, GRPOConfig
from lightning_grpo.module import GRPOModule

__all__ = ["EngineConfig", "EvalConfig", "GRPOConfig", "GRPOModule", "PromptDataModule"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "PromptDataModule":
        from lightning_grpo.data import PromptDataModule

        return PromptDataModule
    raise AttributeError(name)
