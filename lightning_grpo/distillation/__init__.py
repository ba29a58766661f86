"""On-policy distillation's teachers (``GRPOConfig.distillation``): the frozen local model (``local_teacher``), the
served ones (``served_teachers``: a rollout server, an OpenAI-compatible server), the tokenizer check they share
(``tokenizer_check``) and the teacher of a run (``make``). Each implements
:class:`~lightning_grpo.protocols.teacher.Teacher`; the loss is :mod:`lightning_grpo.algorithm.distillation`, the
settings :mod:`lightning_grpo.config.distillation`."""
