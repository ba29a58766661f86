"""Run-time services around a fit: atomic checkpoints and the ``ckpt_path="last"`` fallback
(``checkpointing``), preemption (``preemption``), what a failed run releases (``cleanup``), and the memory the
process may still use with the peak a piece of work reaches (``memory``)."""
