"""Multi-node launches: the wiring of trainer nodes and rollout servers (:mod:`~lightning_grpo.launch.plan`), the
scripts that start them (:mod:`~lightning_grpo.launch.scripts`), ``lightning-grpo launch``
(:mod:`~lightning_grpo.launch.command`) and ``lightning-grpo health`` (:mod:`~lightning_grpo.launch.health`)."""

from lightning_grpo.launch.plan import LaunchPlan, ServerSpec, TrainerNode, WeightSyncGroup

__all__ = ["LaunchPlan", "ServerSpec", "TrainerNode", "WeightSyncGroup"]
