"""Run-time services around a fit: atomic checkpoints and the ``ckpt_path="last"`` fallback
(``checkpointing``), preemption (``preemption``)."""
