"""The Experience batch: one rollout's token ids, masks, logprobs and advantages, how it is cut into the micro-batches
that ``training_step`` receives, and the :class:`StepPlan` each of them carries (its optimizer step's statistics)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Optional

import torch
from torch import Tensor

from lightning_grpo.functional import loss_normalizer
from lightning_grpo.protocols.collectives import Collectives
from lightning_grpo.protocols.rollout import RolloutOutput
from lightning_grpo.protocols.routing import NO_EXPERT
from lightning_grpo.protocols.tokens import (
    PAD_ID,
    ROW_META,
    UNSET,
    Layout,
    fill_unset,
    select_rows,
    token_fields,
    token_meta,
    trim_columns,
)
from lightning_grpo.protocols.vision import RowImages, images_to
from lightning_grpo.training.packing import sequence_token_counts, token_budget_partition


class StepPlan:
    """What the objective takes from the whole optimizer step a micro-batch belongs to
    (:meth:`lightning_grpo.training.selection.StepSelection.plan`), carried by the micro-batch: the loop plans each
    step before its first micro-batch is handed out, so accumulation does not change the gradient.

    A plain object, not a dataclass or a collection, on purpose: Lightning's batch hooks (``move_data_to_device``, the
    precision plugins' ``convert_input``, e.g. FSDP's) walk a batch's dataclass fields and collections and rebuild them,
    which a plan neither needs (it is made where its micro-batches are, in their dtype) nor allows (it holds the step's
    other micro-batches); an object they do not know they hand through as it is.

    Attributes:
        statistics: ``grpo_objective`` keyword arguments shared by the step's micro-batches (``entropy_threshold``,
            ``covariance_stats``, Clip-Cov's ``generator``); {} when the objective needs none.
        clip_cov_selected: ``(B, T)`` bool, this micro-batch's tokens of Clip-Cov's draw over the whole step, else
            None.
        later: on the step's first micro-batch, the step's other micro-batches in training order (each with its own
            plan), which a backend that runs whole optimizer steps trains at the first; () on the others.
    """

    __slots__ = ("statistics", "clip_cov_selected", "later")

    def __init__(self, statistics: Optional[dict[str, Any]] = None, clip_cov_selected: Optional[Tensor] = None,
                 later: tuple["Experience", ...] = ()) -> None:
        self.statistics: dict[str, Any] = {} if statistics is None else statistics
        self.clip_cov_selected = clip_cov_selected
        self.later = later

    def with_later(self, later: tuple["Experience", ...]) -> "StepPlan":
        """This plan naming the step's other micro-batches (the first micro-batch's)."""
        return StepPlan(self.statistics, self.clip_cov_selected, later)

    def __repr__(self) -> str:
        return (f"StepPlan(statistics={sorted(self.statistics)}, clip_cov_selected="
                f"{None if self.clip_cov_selected is None else tuple(self.clip_cov_selected.shape)}, "
                f"later={len(self.later)} micro-batches)")

    def objective_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``grpo_objective`` for this micro-batch."""
        kwargs = dict(self.statistics)
        if self.clip_cov_selected is not None:
            kwargs["clip_cov_selected"] = self.clip_cov_selected
        return kwargs


@dataclass
class Experience:
    """Experience of ``N`` completions (prompt-major order within a rollout).

    Attributes:
        prompt_ids: ``(N, P)`` long, left-padded.
        prompt_mask: ``(N, P)`` long, 1 on prompt tokens.
        completion_ids: ``(N, T)`` long, right-padded.
        completion_mask: ``(N, T)`` long, 1 on tokens that get a loss (through the first EOS; all 0 for a
            completion that gets no loss: truncated under ``mask_truncated_completions``, or unscored). It is
            also the attention mask of the completion in the training forward pass (with ``env_mask``:
            :attr:`completion_attention_mask`).
        advantages: ``(N,)`` float32.
        old_logprobs: ``(N, T)`` float32 behaviour-policy logprobs, stored when the policy changes before the
            rollout is used up (``num_iterations > 1`` or several mini-batches); else None.
        ref_logprobs: ``(N, T)`` float32 reference-policy logprobs (beta > 0), else None.
        sampler_logprobs: ``(N, T)`` float32 logprobs reported by the rollout engine (vLLM), else None.
        loss_normalizer: the loss denominator of the whole optimizer step this micro-batch belongs to, summed
            over its micro-batches and processes (see :func:`lightning_grpo.functional.loss_normalizer`); None =
            this batch's own.
        loss_scale: factor that undoes Lightning's division by ``accumulate_grad_batches`` and the data-parallel
            gradient averaging (``accumulate_grad_batches * world_size``), so the step's gradient is the gradient
            of (summed loss / loss_normalizer).
        step_start: True on the first micro-batch of an optimizer step (the gradients are zeroed before it).
        step_end: True on the last micro-batch of an optimizer step (metrics are logged then).
        on_policy: True while the policy has not been updated since the rollout (the micro-batches of a rollout's
            first optimizer step): the detached current logprobs are then the old logprobs, so the ratio is
            exactly 1 and ``old_logprobs`` are not read.
        metrics: rollout metrics (reward, lengths, timings), attached to step-end micro-batches.
        rows: ``(N,)`` long, the rows of the rollout's experience this micro-batch holds (a canonical order for
            step-level random choices), else None.
        env_mask: ``(N, T)`` long, 1 on the environment's tokens of multi-turn episodes in the rows with loss tokens
            (tool results, observations: context the forward pass attends to, with no loss and no gradient;
            ``completion_mask`` holds the model's tokens only, so the loss, KL, entropy and every ``loss_type``'s
            normalizer count those only); all 0 for single-turn rollouts (the default: left out, it is filled). See
            :attr:`completion_attention_mask`.
        images: each row's images (:class:`~lightning_grpo.protocols.vision.PromptImage`: ``pixel_values`` and grid
            sizes; vision-language prompts), in the order of their placeholder runs in the row's ids; a prompt's G
            rows share one tuple, and every cut (mini-, micro-batch, token budget) takes each row's own. ``()`` for a
            row without images (the default: left out, one ``()`` per row).
        teacher_logprobs: ``(N, T)`` float32 teacher logprobs of the completion tokens (on-policy distillation,
            ``GRPOConfig.distillation``), else None.
        completion_versions: ``(N, T)`` long, the weight version that sampled each completion token (the rollout's
            :attr:`~lightning_grpo.protocols.rollout.RolloutOutput.completion_versions`; -1 on tokens no engine
            sampled), else None: the staleness metrics and the age bound of streaming rollouts read it, and
            ``streaming.newest_version_only`` masks the loss with it.
        step_plan: the :class:`StepPlan` of the optimizer step this micro-batch belongs to (the loop's fetcher sets it
            before handing the micro-batch out); None elsewhere (the objective then takes this batch's own
            statistics). Never saved (:func:`lightning_grpo.loop.resume.experience_state`).
        prompt_routed_experts, completion_routed_experts: ``(N, P | T, moe_layers, top_k)`` int16, the experts each
            token is routed to in the policy's forward passes (routing replay: the sampler's with "R3", the old
            policy's with "R2"; -1: the router's own choice), else None
            (:class:`~lightning_grpo.protocols.rollout.RolloutOutput`).
    """

    prompt_ids: Tensor = field(metadata=token_meta(Layout.PROMPT, PAD_ID))
    prompt_mask: Tensor = field(metadata=token_meta(Layout.PROMPT, 0))
    completion_ids: Tensor = field(metadata=token_meta(Layout.COMPLETION, PAD_ID))
    completion_mask: Tensor = field(metadata=token_meta(Layout.COMPLETION, 0))
    advantages: Tensor = field(metadata=ROW_META)
    old_logprobs: Optional[Tensor] = field(default=None, metadata=token_meta(Layout.COMPLETION, 0.0))
    ref_logprobs: Optional[Tensor] = field(default=None, metadata=token_meta(Layout.COMPLETION, 0.0))
    sampler_logprobs: Optional[Tensor] = field(default=None, metadata=token_meta(Layout.COMPLETION, 0.0))
    loss_normalizer: Optional[float] = None
    loss_scale: float = 1.0
    step_start: bool = True
    step_end: bool = True
    on_policy: bool = True
    metrics: dict[str, float] = field(default_factory=dict)
    rows: Optional[Tensor] = field(default=None, metadata=ROW_META)
    env_mask: Tensor = field(default=UNSET, metadata=token_meta(Layout.COMPLETION, 0))
    images: list[RowImages] = field(default_factory=list)
    teacher_logprobs: Optional[Tensor] = field(default=None, metadata=token_meta(Layout.COMPLETION, 0.0))
    completion_versions: Optional[Tensor] = field(default=None, metadata=token_meta(Layout.COMPLETION, -1))
    step_plan: Optional[StepPlan] = None
    prompt_routed_experts: Optional[Tensor] = field(default=None, metadata=token_meta(Layout.PROMPT, NO_EXPERT))
    completion_routed_experts: Optional[Tensor] = field(default=None, metadata=token_meta(Layout.COMPLETION, NO_EXPERT))

    def __post_init__(self) -> None:
        """Fill ``env_mask`` and ``images`` when they were left out (all 0; ``()`` per row).

        Raises:
            ValueError: ``images`` given, but not one per row.
        """
        fill_unset(self)
        if not self.images:
            self.images = [()] * len(self)
        if len(self.images) != len(self):
            raise ValueError(f"Experience has {len(self.images)} image entries for {len(self)} rows: one per row")

    @classmethod
    def of(cls, rollout: RolloutOutput, device: torch.device) -> "Experience":
        """The experience of ``rollout`` on ``device``: every per-token field both records declare (ids, masks, the
        sampler's logprobs, ...: :mod:`lightning_grpo.protocols.tokens`) and the images; advantages 0 (set later)."""
        shared = {name for name, _ in token_fields(cls)} & {name for name, _ in token_fields(RolloutOutput)}
        values = {name: getattr(rollout, name).to(device) for name in shared if getattr(rollout, name) is not None}
        return cls(**values, advantages=torch.zeros(len(rollout), device=device),
                   images=images_to(rollout.images, device))

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def completion_attention_mask(self) -> Tensor:
        """``(N, T)`` long, the completion tokens the forward pass attends to: ``completion_mask`` and ``env_mask``, the
        environment's tokens (a prefix mask in every row with loss tokens, all 0 in the others)."""
        return (self.completion_mask.bool() | self.env_mask.bool()).long()

    def step_members(self) -> tuple["Experience", ...]:
        """The micro-batches of this batch's optimizer step, this one first (the first micro-batch's plan names the
        others); just this batch without a plan."""
        return (self,) if self.step_plan is None else (self, *self.step_plan.later)

    def select(self, index: Tensor) -> "Experience":
        """Rows ``index`` (a 1-D long tensor), with all-padding columns trimmed away."""
        images = [self.images[i] for i in index.tolist()]
        selected = replace(self, **select_rows(self, index), metrics={}, images=images, step_plan=None)
        return selected.trimmed()

    def trimmed(self) -> "Experience":
        """Drop prompt columns that are padding in every row (left) and completion columns likewise (right)."""
        prompt_keep = self.prompt_mask.any(dim=0).nonzero()
        start = int(prompt_keep[0]) if prompt_keep.numel() else self.prompt_mask.shape[1]
        completion_keep = self.completion_mask.any(dim=0).nonzero()
        end = int(completion_keep[-1]) + 1 if completion_keep.numel() else 1
        return replace(self, **trim_columns(self, start, end))


def micro_batches(
    experience: Experience,
    *,
    mini_batch_size: int,
    accumulate_grad_batches: int,
    num_iterations: int,
    loss_type: str,
    max_new_tokens: int,
    world_size: int = 1,
    generator: Optional[torch.Generator] = None,
    collectives: Collectives = Collectives(),  # noqa: B008 - immutable: the single-process identities
    max_tokens_per_microbatch: Optional[int] = None,
) -> Iterator[Experience]:
    """Cut one rollout's experience into the micro-batches of ``num_iterations`` shuffled passes.

    Each pass shuffles the ``N`` sequences, cuts them into ``N / mini_batch_size`` mini-batches (one optimizer
    step each) and each mini-batch into ``accumulate_grad_batches`` micro-batches (one ``training_step`` each), or,
    with ``max_tokens_per_microbatch``, into as many micro-batches as the token budget needs
    (:func:`lightning_grpo.training.packing.token_budget_partition` over real prompt + completion tokens). The loss
    normalizer is the mini-batch's, so the step's loss and gradient do not depend on the split.

    Args:
        experience: the rollout's experience (``N`` rows on this process).
        mini_batch_size: sequences per optimizer step on this process; must divide ``N``.
        accumulate_grad_batches: micro-batches per optimizer step; must divide ``mini_batch_size``.
        num_iterations: passes over the experience.
        loss_type, max_new_tokens: used to compute each step's loss normalizer.
        world_size: data-parallel processes (for ``loss_scale``).
        generator: random generator of the shuffles.
        collectives: the data-parallel reductions (the normalizer is summed over the processes; identities on one
            process).
        max_tokens_per_microbatch: token budget of a micro-batch (then ``accumulate_grad_batches`` must be 1);
            None = fixed counts.

    Yields:
        micro-batch Experiences, with ``loss_normalizer``, ``loss_scale``, ``step_end`` and ``on_policy`` (True
        for the micro-batches of the first optimizer step) set; the rollout metrics go on every step-end
        micro-batch.

    Raises:
        ValueError: if the sizes do not divide as described (the message names the fields and values).
    """
    n = len(experience)
    if n % mini_batch_size != 0:
        raise ValueError(
            f"GRPOConfig.mini_batch_size={mini_batch_size} must divide the rollout batch of {n} sequences "
            "(prompts_per_step * num_generations) on each process"
        )
    if mini_batch_size % accumulate_grad_batches != 0:
        raise ValueError(
            f"Trainer(accumulate_grad_batches={accumulate_grad_batches}) must divide "
            f"GRPOConfig.mini_batch_size={mini_batch_size} (micro-batches per optimizer step)"
        )
    if max_tokens_per_microbatch is not None and accumulate_grad_batches != 1:
        raise ValueError(
            f"GRPOConfig.max_tokens_per_microbatch={max_tokens_per_microbatch} forms the micro-batches of a step by "
            f"token budget: set Trainer(accumulate_grad_batches=1), not {accumulate_grad_batches}"
        )
    micro_size = mini_batch_size // accumulate_grad_batches
    counts = sequence_token_counts(experience.prompt_mask, experience.completion_attention_mask).tolist()
    step = 0
    for _ in range(num_iterations):
        order = torch.randperm(n, generator=generator)
        for mini in order.split(mini_batch_size):
            mask = experience.completion_mask[mini]
            local = torch.tensor([loss_normalizer(mask, loss_type, max_new_tokens)], dtype=torch.float64)
            normalizer = float(collectives.reduce_sum(local.to(experience.completion_mask.device)).item())
            if max_tokens_per_microbatch is None:
                parts = list(mini.split(micro_size))
            else:
                bins = token_budget_partition([counts[i] for i in mini.tolist()], max_tokens_per_microbatch)
                parts = [mini[torch.tensor(b, dtype=torch.long)] for b in bins]
            batches = []
            for i, micro in enumerate(parts):
                batch = experience.select(micro)
                batch.rows = micro
                batch.loss_normalizer = normalizer
                batch.loss_scale = float(accumulate_grad_batches * world_size)
                batch.step_start = i == 0
                batch.step_end = i == len(parts) - 1
                batch.on_policy = step == 0
                if batch.step_end:
                    batch.metrics = dict(experience.metrics)
                batches.append(batch)
            yield from batches
            step += 1
