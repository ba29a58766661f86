"""What ``GRPOModule`` reads from the trainer's datamodule: :class:`PromptSource` for training (any
``LightningDataModule`` with ``prompts_per_step``) and :class:`EvalSource` for per-dataset evaluation metrics;
``PromptDataModule`` implements both. :data:`EVAL_INDEX` is the column of an evaluation batch that numbers its
prompts."""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

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
