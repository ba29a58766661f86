"""Prompt data: the :class:`PromptDataModule` (``module``), local files (``files``), dataset presets (``presets``),
few-shot prompts (``fewshot``), the synthetic arithmetic task (``synthetic``) and the epoch sampler (``sampler``)."""

from lightning_grpo.data.datamodule import PromptDataModule

__all__ = ["PromptDataModule"]
