"""What ``GRPOModule`` reads from the trainer's datamodule: :class:`PromptSource` for training (any
``LightningDataModule`` with ``prompts_per_step``) and :class:`EvalSource` for per-dataset evaluation metrics;
``PromptDataModule`` implements both."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class PromptSource(Protocol):
    """A datamodule of prompt batches."""

    @property
    def prompts_per_step(self) -> int:
        """Prompts per rollout batch on each process (the train DataLoader's batch size)."""
        ...


@runtime_checkable
class EvalSource(Protocol):
    """A datamodule with several evaluation datasets (without one, every validation/test DataLoader is the
    datamodule's own dataset)."""

    @property
    def eval_names(self) -> list[str]:
        """The evaluated datasets, one per validation/test DataLoader, in order (their metrics are prefixed with
        the name from the second on)."""
        ...
