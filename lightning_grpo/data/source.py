"""What ``GRPOModule`` reads from the trainer's datamodule: :class:`PromptSource` (``PromptDataModule`` implements
it; any ``LightningDataModule`` with these two attributes works)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class PromptSource(Protocol):
    """A datamodule of prompt batches."""

    @property
    def prompts_per_step(self) -> int:
        """Prompts per rollout batch on each process (the train DataLoader's batch size)."""
        ...

    @property
    def eval_names(self) -> list[str]:
        """The evaluated datasets, one per validation/test DataLoader, in order (their metrics are prefixed with
        the name from the second on)."""
        ...
