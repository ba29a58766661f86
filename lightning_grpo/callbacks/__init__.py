"""Lightning callbacks for GRPO runs: the completion table, the progress bar, and the rollout-event forwarding."""

from lightning_grpo.callbacks.base import forward_event
from lightning_grpo.callbacks.completions import CompletionTable
from lightning_grpo.callbacks.progress import GRPOProgressBar

__all__ = ["CompletionTable", "GRPOProgressBar", "forward_event"]
