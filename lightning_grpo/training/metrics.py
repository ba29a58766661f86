"""Step metrics, rollout metrics and the step's wall-time breakdown.

* :class:`StepMetrics` adds up the token-weighted statistics of each micro-batch's
  :class:`~lightning_grpo.algorithm.ObjectiveOutput` over one optimizer step and reduces them over processes with
  one stacked sum (plus one max for the extrema), like torchmetrics' ``update``/``compute``/``reset``.
* :func:`rollout_metrics` is a pure function of a scored rollout (verl's ``metric_utils`` style).
* :class:`StepTimer` is where the step's wall time went (``timing/*``).

Metric names follow TRL's where they mean the same thing (docs/training.md, "Metrics").
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Iterator, Optional

import torch
from torch import Tensor

from lightning_grpo.algorithm import ObjectiveOutput, ScoredRollout
from lightning_grpo.protocols.collectives import Collectives, gather_per_process
from lightning_grpo.protocols.rollout import RowMetric

log = logging.getLogger(__name__)

#: ``reduce(tensor) -> tensor``: a sum (or max) over the data-parallel processes; the identity on one process.

#: The ``timing/<key>`` parts of a step, in seconds (``step_s`` and ``other_s`` are derived from them).
TIMING_KEYS = ("rollout_s", "scoring_s", "logprobs_s", "sync_s", "forward_s", "backward_s", "optimizer_s")
#: ``timing/reward_<name>_s``: the wall seconds of reward function ``<name>`` in the step's rollout (0.0 on a step that
#: scored nothing, once the function was seen: never the last rollout's value again).
REWARD_TIMING_PREFIX = "reward_"
#: ``sampling/mismatch_ratio/<name>``: quantiles of ``pi_old / pi_sampler`` over the step's loss tokens.
MISMATCH_QUANTILES = {"min": 0.0, "p01": 0.01, "p05": 0.05, "p50": 0.5, "p95": 0.95, "p99": 0.99, "max": 1.0}


class StepMetrics:
    """Token-weighted sums and maxima of the micro-batches of one optimizer step.

    Args:
        clip_ratio_c: ``GRPOConfig.clip_ratio_c`` (dual clip: ``clip_ratio/dual_mean`` is logged when set).
        importance_sampling_cap: ``GRPOConfig.importance_sampling_cap`` (``sampling/importance_sampling_ratio/*``
            are logged when set, or when an importance weight was applied; 1 exactly for engines without sampler
            logprobs).

    The mismatch between the sampler and the trainer is logged whenever the engine reported sampler logprobs
    (:func:`mismatch_quantiles`, docs/algorithm.md "Metrics"); the fraction of loss tokens each rollout-correction
    knob dropped whenever the knob is on; the reverse KL to the teacher with on-policy distillation.
    """

    def __init__(self, clip_ratio_c: Optional[float] = None, importance_sampling_cap: Optional[float] = None) -> None:
        self.clip_ratio_c = clip_ratio_c
        self.importance_sampling_cap = importance_sampling_cap
        self._sums: dict[str, Tensor] = {}
        self._maxima: dict[str, Tensor] = {}
        self._log_ratios: list[Tensor] = []  # the step's log(pi_old / pi_sampler) on loss tokens, per micro-batch

    def update(self, output: ObjectiveOutput) -> None:  # noqa: C901 - one optional metric per branch
        """Add one micro-batch's statistics (sums over its loss tokens, 0-dim float32) and extrema."""
        mask = output.mask  # [B, T] bool, the loss tokens

        def masked_sum(values: Tensor) -> Tensor:
            return torch.where(mask, values.float(), torch.zeros_like(values, dtype=torch.float32)).sum()

        def masked_max(values: Tensor) -> Tensor:
            if values.numel() == 0:
                return values.new_tensor(-torch.inf, dtype=torch.float32)
            return torch.where(mask, values.float(), -torch.inf).amax()

        clip = output.clip
        parts = {
            "loss": output.loss.detach().float(),
            "tokens": mask.sum().float(),
            "clip_ratio/low_mean": masked_sum(clip.low),
            "clip_ratio/high_mean": masked_sum(clip.high),
            "clip_ratio/region_mean": masked_sum(clip.region),
        }
        maxima: dict[str, Tensor] = {}
        if self.clip_ratio_c is not None:
            parts["clip_ratio/dual_mean"] = masked_sum(clip.dual)
        if clip.ratio is not None:
            parts["policy_ratio/mean"] = masked_sum(clip.ratio)
            maxima["policy_ratio/max"] = masked_max(clip.ratio)
            maxima["policy_ratio/min"] = masked_max(-clip.ratio)  # stored negated: max(-x) = -min(x)
        if output.entropy is not None:
            parts["entropy"] = masked_sum(output.entropy)
        if output.kl is not None:
            parts["kl"] = masked_sum(output.kl)
        if output.entropy_mask is not None:
            parts["entropy/trained_token_frac"] = masked_sum(output.entropy_mask)
        weights = output.importance_weights
        if self.importance_sampling_cap is not None or weights is not None:
            if weights is None:  # no sampler logprobs (HF engine): the weight is 1 exactly
                weights = torch.ones_like(clip.low, dtype=torch.float32)
            key = "sampling/importance_sampling_ratio"
            parts[f"{key}/mean"] = masked_sum(weights)
            maxima[f"{key}/max"] = masked_max(weights)
            maxima[f"{key}/min"] = masked_max(-weights)
        self._correction_parts(output, mask, parts, maxima)
        for key, value in parts.items():
            self._sums[key] = self._sums.get(key, torch.zeros((), device=value.device)) + value
        for key, value in maxima.items():
            previous = self._maxima.get(key)
            self._maxima[key] = value if previous is None else torch.maximum(previous, value)

    def _correction_parts(self, output: ObjectiveOutput, mask: Tensor, parts: dict[str, Tensor],
                          maxima: dict[str, Tensor]) -> None:
        """The mismatch, the rollout-correction knobs' dropped fractions and the distillation KL of a micro-batch."""

        def masked_sum(values: Tensor) -> Tensor:
            return torch.where(mask, values.float(), 0.0).sum()

        correction, weights = output.correction, output.importance_weights
        if correction.log_ratio is not None:  # the engine reported sampler logprobs
            d = correction.log_ratio.float()
            parts["sampling/sampling_logp_difference/mean"] = masked_sum(d.abs())
            maxima["sampling/sampling_logp_difference/max"] = (torch.where(mask, d.abs(), -torch.inf).amax()
                                                                if d.numel() else d.new_tensor(-torch.inf))
            parts["sampling/k3_kl"] = masked_sum(torch.exp(d) - d - 1)
            self._log_ratios.append(d[mask].detach())
        dropped = torch.zeros_like(mask)
        if weights is not None:
            parts["sampling/masked_fraction/importance_sampling"] = masked_sum(weights == 0)
            dropped = dropped | (weights == 0)
        for name, keep in correction.keep.items():
            parts[f"sampling/masked_fraction/{name}"] = masked_sum(~keep)
            dropped = dropped | ~keep
        if correction.keep:
            parts["sampling/masked_fraction/any"] = masked_sum(dropped)
        if output.distillation_kl is not None:
            parts["distillation/reverse_kl"] = masked_sum(output.distillation_kl)

    def compute(self, collectives: Collectives) -> dict[str, float]:
        """The step's metrics over every process, then :meth:`reset`: ``loss`` (summed: each micro-batch's loss
        is already its share of the step loss), the token-weighted means, the extrema and ``num_tokens`` (the loss
        tokens). A step without loss tokens (e.g. no completion was scored) trains nothing: its means are NaN,
        ``num_tokens`` is 0 and a warning is logged."""
        sums, maxima, log_ratios = self._sums, self._maxima, self._log_ratios
        self.reset()
        keys = sorted(sums)
        reduced = collectives.reduce_sum(torch.stack([sums[k] for k in keys]))
        totals = dict(zip(keys, reduced.tolist(), strict=True))
        tokens = totals.pop("tokens")
        if tokens == 0:
            log.warning("this optimizer step has no loss tokens on any process (no completion was scored, or every "
                        "one was masked): it trains on nothing; its token means are NaN")
        metrics = {"loss": totals.pop("loss")}
        metrics.update({k: v / tokens if tokens > 0 else math.nan for k, v in totals.items()})
        if maxima:
            max_keys = sorted(maxima)
            stacked = collectives.reduce_max(torch.stack([maxima[k] for k in max_keys]))
            for key, value in zip(max_keys, stacked.tolist(), strict=True):
                if value != -float("inf"):  # a step without loss tokens has no extrema
                    metrics[key] = -value if key.endswith("/min") else value
        metrics["num_tokens"] = tokens
        if log_ratios:  # every process has sampler logprobs or none (one engine)
            metrics.update(mismatch_quantiles(torch.cat(gather_per_process(torch.cat(log_ratios).cpu()))))
        return metrics

    def reset(self) -> None:
        self._sums, self._maxima, self._log_ratios = {}, {}, []


def mismatch_quantiles(log_ratios: Tensor) -> dict[str, float]:
    """``sampling/mismatch_ratio/{min,p01,p05,p50,p95,p99,max}``: quantiles (linear interpolation, as
    ``torch.quantile``) of ``pi_old / pi_sampler = exp(log_ratios)`` over every loss token of the step on every
    process; {} without tokens. verl logs the same ratio's extrema as ``rollout_corr/rollout_is_{min,max}``."""
    if log_ratios.numel() == 0:
        return {}
    ordered = torch.exp(log_ratios.double()).sort().values
    last = ordered.numel() - 1
    out = {}
    for name, q in MISMATCH_QUANTILES.items():
        position = q * last
        below = int(math.floor(position))
        above = min(below + 1, last)
        value = ordered[below] + (position - below) * (ordered[above] - ordered[below])
        out[f"sampling/mismatch_ratio/{name}"] = float(value)
    return out


def rollout_metrics(
    rollout: ScoredRollout,
    reward_names: list[str],
    extra: dict[str, tuple[Tensor, Tensor]],
    totals: dict[str, float],
    sampling_stats: Optional[dict[str, float]],
    collectives: Collectives,
    row_metrics: Optional[dict[str, RowMetric]] = None,
) -> dict[str, float]:
    """A rollout's metrics, averaged over every process with one stacked all-reduce (and one all-reduce max per
    "max" row metric, in name order).

    Args:
        rollout: the scored rollout (``rewards`` NaN where no reward function scored a completion).
        reward_names: the reward functions' names (``rewards/<name>/mean``).
        extra: more metrics as ``name -> (sum, count)`` (e.g. ``kl`` with ``kl_in_reward``).
        totals: ``prompts/truncated`` (summed over processes and reported as a total).
        sampling_stats: :meth:`DynamicSampler.batch` statistics, or None without dynamic sampling.
        collectives: the data-parallel reductions (the sum over processes, on ``collectives.device``).
        row_metrics: the sampler's per-row metrics of the rollout's rows
            (:class:`~lightning_grpo.protocols.rollout.RowMetric`; multi-turn: ``turns/*``, ``tools/*``, ...): a
            mean's values and counts summed with the rest, a max reduced on its own; ``empty`` where a mean's counts
            sum to 0.

    Returns:
        ``reward``, ``reward_std`` (mean of the per-group stds, as TRL, over the groups with a scored completion),
        ``frac_reward_zero_std``,
        ``frac_reward_unscored``, ``completions/{mean,min,max}_length``, ``completions/clipped_ratio``,
        ``rewards/<name>/mean``, ``prompts/truncated``, ``dynamic_sampling/*``, the ``extra`` and ``row_metrics``
        keys.
        ``completions/{min,max}_length`` are this process's. A mean over nothing (e.g. ``reward`` when no
        completion of the rollout was scored on any process) is NaN, and that case logs a warning.
    """
    g = rollout.num_generations
    lengths = rollout.rollout.completion_mask.sum(dim=1).float().cpu()  # [N]
    rewards = rollout.rewards.cpu()  # [N]
    valid = ~torch.isnan(rewards).view(-1, g)  # [P, G]
    grouped = torch.where(valid, rewards.view(-1, g), 0.0)  # [P, G]
    count = valid.sum(dim=1)  # [P]
    mean = grouped.sum(dim=1, keepdim=True) / count.clamp(min=1).unsqueeze(1)  # [P, 1]
    group_std = (torch.where(valid, grouped - mean, 0.0).square().sum(dim=1) / (count - 1).clamp(min=1)).sqrt()
    scored_group = count > 0  # [P] groups with at least one scored completion
    sums: dict[str, Tensor] = {
        "reward": grouped.sum(),
        "reward_std": group_std[scored_group].sum(),
        "frac_reward_zero_std": (group_std[scored_group] == 0).float().sum(),
        "frac_reward_unscored": (~valid).float().sum(),
        "completions/mean_length": lengths.sum(),
        "completions/clipped_ratio": rollout.rollout.truncated.float().cpu().sum(),
    }
    counts = {"reward": valid.sum(), "reward_std": scored_group.sum(), "frac_reward_zero_std": scored_group.sum(),
              "frac_reward_unscored": lengths.numel(), "completions/mean_length": lengths.numel(),
              "completions/clipped_ratio": lengths.numel()}
    for name, column in zip(reward_names, rollout.per_function.T, strict=True):
        present = ~torch.isnan(column)
        sums[f"rewards/{name}/mean"] = torch.where(present, column, torch.zeros_like(column)).sum()
        counts[f"rewards/{name}/mean"] = present.sum()
    for key, (total, number) in extra.items():
        sums[key], counts[key] = total, number
    row_metrics = row_metrics or {}
    means = {k: m for k, m in row_metrics.items() if m.reduce == "mean"}
    for key, metric in means.items():
        sums[key], counts[key] = metric.values.sum(), metric.weights().sum()
    # summed over processes, reported as totals (count 1 per process, so "mean" keys are per-process means)
    summed = {"prompts/truncated": totals["prompts/truncated"]}
    if sampling_stats is not None:
        summed.update({f"dynamic_sampling/{k}": v for k, v in sampling_stats.items() if k != "gen_batches"})
        sums["dynamic_sampling/gen_batches"] = torch.tensor(sampling_stats["gen_batches"])
        counts["dynamic_sampling/gen_batches"] = 1
    for key, value in summed.items():
        sums[key], counts[key] = torch.tensor(float(value)), 0
    keys = sorted(sums)
    values = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64).cpu() for k in keys])
    numbers = torch.tensor([float(counts[k]) for k in keys], dtype=torch.float64)
    reduced = collectives.reduce_sum(torch.cat([values, numbers]).to(collectives.device)).cpu()
    metrics = {}
    for i, key in enumerate(keys):
        total, number = float(reduced[i]), float(reduced[len(keys) + i])
        empty = means[key].empty if key in means else math.nan
        metrics[key] = total if key in summed else (total / number if number > 0 else empty)
    if math.isnan(metrics["reward"]):
        log.warning("no completion of this rollout was scored on any process (every reward function returned None "
                    "for all of them): it trains nothing; its reward metrics are NaN")
    metrics["completions/max_length"] = float(lengths.max())
    metrics["completions/min_length"] = float(lengths.min())
    for key in sorted(k for k, m in row_metrics.items() if m.reduce == "max"):
        values = row_metrics[key].values
        local = values.max() if values.numel() else torch.tensor(row_metrics[key].empty, dtype=torch.float64)
        metrics[key] = float(collectives.reduce_max(local.reshape(1).to(collectives.device)).item())
    return metrics


class StepTimer:
    """Where an optimizer step's wall time went, in seconds (``timing/*``), plus ``generated_tokens`` and
    ``train_tokens``. The hooks of :class:`lightning_grpo.module.GRPOModule` call it; it owns every timestamp."""

    def __init__(self) -> None:
        self._parts: dict[str, float] = {}
        self._step_start: Optional[float] = None
        self._backward_start = 0.0
        self._backward_end: Optional[float] = None
        self._rollout_end: Optional[float] = None
        self._reward_keys: set[str] = set()  # the reward timings seen so far (0.0 on the steps without them)

    def add(self, key: str, value: float) -> None:
        self._parts[key] = self._parts.get(key, 0.0) + value

    def get(self, key: str) -> float:
        """Seconds (or count) added to ``key`` since the last step ended."""
        return self._parts.get(key, 0.0)

    @contextlib.contextmanager
    def span(self, key: str) -> Iterator[None]:
        """Add the wall time of the ``with`` body to ``key``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(key, time.perf_counter() - start)

    def start(self) -> None:
        """At the start of training: the first step counts from here."""
        self._step_start = time.perf_counter()
        self._parts = {}

    def rollout_end(self) -> None:
        self._rollout_end = time.perf_counter()

    def before_backward(self) -> None:
        self._backward_start = time.perf_counter()

    def after_backward(self) -> None:
        self._backward_end = time.perf_counter()
        self.add("backward_s", self._backward_end - self._backward_start)

    def after_optimizer_step(self) -> None:
        """Clipping, grad norm and the optimizer's step: from the last backward's end to now."""
        if self._backward_end is not None:
            self.add("optimizer_s", time.perf_counter() - self._backward_end)

    def step_end(self) -> dict[str, float]:
        """The finished step's ``timing/*`` (``step_s`` from the end of the previous step, ``other_s`` the rest,
        ``train_s`` from the end of the rollout or of the previous step, ``reward_<name>_s`` each reward function's
        own time), ``generated_tokens`` and ``train_tokens``; then the next step starts."""
        now = time.perf_counter()
        parts, self._parts = self._parts, {}
        start, self._step_start = self._step_start, now
        self._backward_end = None
        metrics = {f"timing/{k}": parts.get(k, 0.0) for k in TIMING_KEYS}
        # each reward function's own wall time (may overlap scoring_s and, asynchronously, the training: not in other_s)
        self._reward_keys.update(k for k in parts if k.startswith(REWARD_TIMING_PREFIX))
        metrics.update({f"timing/{k}": parts.get(k, 0.0) for k in sorted(self._reward_keys)})
        if start is not None:
            metrics["timing/step_s"] = now - start
            metrics["timing/other_s"] = metrics["timing/step_s"] - sum(metrics[f"timing/{k}"] for k in TIMING_KEYS)
        metrics["timing/train_s"] = now - (self._rollout_end if self._rollout_end is not None else now)
        self._rollout_end = now  # the next step of the same rollout counts from here
        metrics["generated_tokens"] = parts.get("generated_tokens", 0.0)
        metrics["train_tokens"] = parts.get("train_tokens", 0.0)
        return metrics
