"""Lightning callbacks for GRPO runs: the typed rollout-event base (:class:`GRPOCallback`), the completion table,
the progress bar, and the checkpoint callback whose ``ckpt_path="last"`` falls back to the newest complete
checkpoint."""

from lightning_grpo.callbacks.completions import CompletionTable
from lightning_grpo.callbacks.grpo_callback import EventRoute, GRPOCallback
from lightning_grpo.callbacks.progress import GRPOProgressBar
from lightning_grpo.runtime.checkpointing import GRPOModelCheckpoint

__all__ = ["CompletionTable", "EventRoute", "GRPOCallback", "GRPOModelCheckpoint", "GRPOProgressBar"]
