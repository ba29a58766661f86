"""The rollout schedule the loop runs: how many optimizer steps and micro-batches one rollout makes, how a rollout is
cut into them, and how many rollouts asynchronous training generates ahead; :class:`LoopPlan`, what the module hands
the loop when a fit starts, so that the loop never asks the module for them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch

from lightning_grpo.config import GRPOConfig
from lightning_grpo.protocols.collectives import Collectives
from lightning_grpo.training.experience import Experience, StepPlan, micro_batches

#: What a run without the datamodule's ``prompts_per_step`` is told.
NO_PROMPTS_PER_STEP = (
    "GRPO needs the datamodule's prompts_per_step (prompts per rollout batch): pass a lightning_grpo.data."
    "PromptDataModule or a LightningDataModule with that attribute (lightning_grpo.data.source.PromptSource)"
)


def steps_per_rollout(config: GRPOConfig, prompts_per_step: Optional[int]) -> int:
    """Optimizer steps per rollout: ``num_iterations * (rollout batch / mini_batch_size)``, the rollout batch being
    ``prompts_per_step * num_generations`` sequences.

    Raises:
        ValueError: ``prompts_per_step`` is None (the datamodule does not say it).
    """
    if prompts_per_step is None:
        raise ValueError(NO_PROMPTS_PER_STEP)
    n = prompts_per_step * config.num_generations
    return config.num_iterations * (n // (config.mini_batch_size or n))


def micro_batches_per_rollout(config: GRPOConfig, prompts_per_step: Optional[int],
                              accumulate_grad_batches: int) -> Optional[int]:
    """``training_step`` calls per rollout: ``steps_per_rollout * accumulate_grad_batches``; None with
    ``max_tokens_per_microbatch`` (the token budget decides). Raises as :func:`steps_per_rollout`."""
    steps = steps_per_rollout(config, prompts_per_step)  # checks the datamodule
    return None if config.max_tokens_per_microbatch else steps * accumulate_grad_batches


def rollouts_ahead(config: GRPOConfig, prompts_per_step: Optional[int], prompt_batches: Optional[int] = None) -> int:
    """Rollouts generated in the background ahead of the one being trained: ``max_staleness // steps_per_rollout``
    (the weights of a rollout started at a rollout boundary are then at most ``max_staleness`` optimizer steps old
    when it is trained); 0 = synchronous rollouts.

    Args:
        config: ``max_staleness`` and the batch sizes.
        prompts_per_step: prompts per rollout batch (the datamodule's), None when unknown.
        prompt_batches: rollout batches per epoch (the loop's loader length), None when unknown.

    Raises:
        ValueError: ``0 < max_staleness < steps_per_rollout`` (no rollout could be generated ahead), or as many
            rollouts ahead as the epoch has batches or more: the whole epoch would be generated at its start and
            held in memory and in every checkpoint; as :func:`steps_per_rollout`.
    """
    k = config.max_staleness
    if k == 0:
        return 0
    steps = steps_per_rollout(config, prompts_per_step)
    if k < steps:
        raise ValueError(f"GRPOConfig.max_staleness={k} is less than the {steps} optimizer steps of one rollout "
                         f"(num_iterations * mini-batches): no rollout can be generated ahead; use max_staleness "
                         f">= {steps} or 0")
    ahead = k // steps
    if prompt_batches is not None and ahead >= prompt_batches:
        raise ValueError(f"GRPOConfig.max_staleness={k} generates {ahead} rollouts ahead ({steps} optimizer "
                         f"step(s) per rollout), but an epoch has only {prompt_batches} rollout batches: the "
                         "whole epoch would be generated at its start and held in memory and in every "
                         f"checkpoint. Use max_staleness < {prompt_batches * steps} (at most "
                         f"{prompt_batches - 1} rollouts ahead)")
    return ahead


def rollout_micro_batches(experience: Experience, config: GRPOConfig, step: int, accumulate_grad_batches: int,
                          world_size: int, collectives: Collectives,
                          max_tokens: Optional[int]) -> Iterator[Experience]:
    """One rollout's micro-batches (:func:`lightning_grpo.training.experience.micro_batches`) as ``config`` cuts
    them: mini-batches of ``mini_batch_size`` (the whole rollout without), ``num_iterations`` times, shuffled with
    ``shuffle_seed + step``; ``world_size``: the processes that hold different data; ``max_tokens``: the resolved
    token budget, or None."""
    return micro_batches(
        experience, mini_batch_size=config.mini_batch_size or len(experience),
        accumulate_grad_batches=accumulate_grad_batches, num_iterations=config.num_iterations,
        loss_type=config.loss_type, max_new_tokens=config.max_new_tokens, world_size=world_size,
        generator=torch.Generator().manual_seed(config.shuffle_seed + step), collectives=collectives,
        max_tokens_per_microbatch=max_tokens,
    )


#: ``plan_step(micro_batches) -> plans``: one optimizer step's micro-batches (in training order) -> one
#: :class:`~lightning_grpo.training.experience.StepPlan` each, the step's statistics over all of them (a collective
#: under data parallelism: every process plans each step).
StepPlanner = Callable[[list[Experience]], list[StepPlan]]


@dataclass(frozen=True)
class LoopPlan:
    """The rollout schedule of a fit and what the loop needs to run it, fixed when the fit starts (the module hands it
    to :meth:`lightning_grpo.loop.fit_loop.GRPOFitLoop.use_plan`; again once ``max_tokens_per_microbatch="auto"``
    is resolved).

    Attributes:
        config: the algorithm settings (``num_generations``, ``mini_batch_size``, ``num_iterations``,
            ``max_staleness``, ``shuffle_seed``, ``loss_type``, ``max_new_tokens``, ``max_tokens_per_microbatch``).
        prompts_per_step: prompts per rollout batch (the datamodule's), None when it does not say.
        accumulate_grad_batches: ``Trainer(accumulate_grad_batches)``.
        data_parallel_size: the processes that hold different data (the backend's).
        collectives: the data-parallel reductions (each step's loss normalizer is summed over them); their device is
            where experience tensors live.
        token_budget: the micro-batch token budget in effect (``max_tokens_per_microbatch`` as resolved), else None.
        plan_step: the :data:`StepPlanner` the fetcher plans each optimizer step with before its first micro-batch.
    """

    config: GRPOConfig
    prompts_per_step: Optional[int]
    accumulate_grad_batches: int
    data_parallel_size: int
    collectives: Collectives
    token_budget: Optional[int]
    plan_step: StepPlanner

    @property
    def device(self) -> torch.device:
        """Where experience tensors live (a resumed rollout is loaded there)."""
        return self.collectives.device

    def steps_per_rollout(self) -> int:
        """Optimizer steps per rollout (:func:`steps_per_rollout`; raises as it)."""
        return steps_per_rollout(self.config, self.prompts_per_step)

    def micro_batches_per_rollout(self) -> Optional[int]:
        """``training_step`` calls per rollout, None when they vary (:func:`micro_batches_per_rollout`; raises as
        it)."""
        return micro_batches_per_rollout(self.config, self.prompts_per_step, self.accumulate_grad_batches)

    def rollouts_ahead(self, prompt_batches: Optional[int] = None) -> int:
        """Rollouts generated in the background ahead of the one being trained; 0 = synchronous
        (:func:`rollouts_ahead`; ``prompt_batches``: the loader's length, None when unknown; raises as it)."""
        return rollouts_ahead(self.config, self.prompts_per_step, prompt_batches)

    def micro_batches(self, experience: Experience, step: int) -> Iterator[Experience]:
        """One rollout's micro-batches in training order (:func:`rollout_micro_batches`), shuffled with
        ``shuffle_seed + step`` (``step``: the optimizer step the rollout was made at)."""
        return rollout_micro_batches(experience, self.config, step, self.accumulate_grad_batches,
                                     self.data_parallel_size, self.collectives, self.token_budget)
