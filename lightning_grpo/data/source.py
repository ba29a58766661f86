"""What ``GRPOModule`` reads from the trainer's datamodule: :class:`PromptSource` for training (any
``LightningDataModule`` with ``prompts_per_step``), :class:`EvalSource` for per-dataset evaluation metrics and
:class:`ImageSource` for the column of the prompts' images; ``PromptDataModule`` implements the three. They are read
once per stage, at setup, into a :class:`DataPlan`.
:data:`EVAL_INDEX` is the column of an evaluation batch that numbers its prompts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, runtime_checkable

#: The batch column holding each evaluation prompt's position in its dataset (added by the data module; the module
#: counts each prompt once over the processes with it, :func:`lightning_grpo.evaluation.evaluator.counted_rows`).
EVAL_INDEX = "eval_index"


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
    datamodule's own dataset), each with the reward that checks its answers."""

    @property
    def eval_names(self) -> list[str]:
        """The evaluated datasets, one per validation/test DataLoader, in order (their metrics are prefixed with
        the name from the second on)."""
        ...

    @property
    def eval_accuracy(self) -> list[Optional[str]]:
        """The reward function that checks the answers of each evaluated dataset, as :attr:`eval_names`: a registered
        name or a ``"module:function"`` path (:data:`lightning_grpo.rewards.REWARD_FUNCTIONS`); None = the module's
        ``accuracy_reward`` (always for the first, the training dataset)."""
        ...


@runtime_checkable
class ImageSource(Protocol):
    """A datamodule whose prompts hold images read from a column (docs/vision.md)."""

    @property
    def image_field(self) -> Optional[str]:
        """The column of each row's image or images (None: text prompts); the policy must be a vision-language
        model when it is set."""
        ...


@dataclass(frozen=True)
class DataPlan:
    """What the run knows of its datamodule, read once at setup (:meth:`of`).

    Attributes:
        prompts_per_step: prompts per rollout batch on each process (:class:`PromptSource`), None when the
            datamodule does not say (then there is no training: ``steps_per_rollout`` raises).
        eval_names: the evaluated datasets' names, one per validation/test DataLoader (:class:`EvalSource`); ``[None]``
            without them (every DataLoader is the datamodule's own dataset).
        eval_accuracy: each evaluated dataset's answer check (a reward function's name or path), as ``eval_names``;
            None: the module's ``accuracy_reward``.
        image_field: the column the prompts' images come from (:class:`ImageSource`), None: text prompts (or a
            datamodule that does not say).
    """

    prompts_per_step: Optional[int] = None
    eval_names: list[Optional[str]] = field(default_factory=lambda: [None])
    eval_accuracy: list[Optional[str]] = field(default_factory=lambda: [None])
    image_field: Optional[str] = None

    @classmethod
    def of(cls, datamodule: Any) -> "DataPlan":
        """Read ``datamodule`` (None: dataloaders given to the trainer directly) once."""
        prompts = datamodule.prompts_per_step if isinstance(datamodule, PromptSource) else None
        images = datamodule.image_field if isinstance(datamodule, ImageSource) else None
        if not isinstance(datamodule, EvalSource):
            return cls(prompts, image_field=images)
        return cls(prompts, list(datamodule.eval_names), list(datamodule.eval_accuracy), images)

    def evaluated(self, dataloader_idx: int) -> tuple[Optional[str], Optional[str]]:
        """``(dataset name, answer check)`` of a validation/test DataLoader: ``(None, None)`` for the first (the
        training dataset: the module's accuracy) and beyond the named ones."""
        if 0 < dataloader_idx < len(self.eval_names):
            return self.eval_names[dataloader_idx], self.eval_accuracy[dataloader_idx]
        return None, None
