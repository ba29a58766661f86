"""The experience maker's room: one prompt batch -> one scored, shaped
:class:`~lightning_grpo.training.experience.Experience` (``maker``: :class:`ExperienceMaker` and its
:class:`RolloutContext`), with what only it uses: the rows a rollout's generation rounds collected (``collected``),
the no-grad old / reference / teacher logprob passes (``passes``) and the evaluation rollouts of a validation or test
batch (``evaluation``)."""

from lightning_grpo.experience.maker import ExperienceMaker, RolloutContext

__all__ = ["ExperienceMaker", "RolloutContext"]
