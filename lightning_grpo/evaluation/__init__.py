"""Evaluation: pass@k / maj@k / mean@k metrics and the per-dataset evaluator (``evaluator``), the before/after
report (``report``) and the metrics plot (``plot``)."""
