"""GRPO for language models as a PyTorch Lightning plugin."""

import gc as _gc

# Importing the package imports torch, Lightning, transformers and their dependencies: about a million long-lived
# objects and no garbage, yet the cyclic collector would traverse them again and again while they are made (6.5 s ->
# 5.4 s a fresh process on one core, alternated runs; tests/README.md). It is paused for the import and resumed after,
# as it was; reference counting frees everything as usual meanwhile.
_collecting = _gc.isenabled()
_gc.disable()
try:
    from lightning_grpo import strategies  # noqa: F401  (registers the "grpo_fsdp2" strategy names)
    from lightning_grpo.config import EngineConfig, EvalConfig, GRPOConfig
    from lightning_grpo.module import GRPOModule
finally:
    if _collecting:
        _gc.enable()

__all__ = ["EngineConfig", "EvalConfig", "GRPOConfig", "GRPOModule", "PromptDataModule"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "PromptDataModule":
        from lightning_grpo.data import PromptDataModule

        return PromptDataModule
    raise AttributeError(name)
