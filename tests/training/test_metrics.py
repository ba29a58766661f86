"""StepMetrics, rollout_metrics and StepTimer on their own (no model, no Trainer): hand-worked values, the sum over
processes through a Collectives record, and the timer's breakdown on a fake clock."""

import logging
import math

import pytest
import torch

from lightning_grpo import functional as F
from lightning_grpo.algorithm import ObjectiveOutput, ScoredRollout
from lightning_grpo.protocols.collectives import Collectives
from lightning_grpo.protocols.rollout import RolloutOutput, RowMetric
from lightning_grpo.training import metrics as metrics_module
from lightning_grpo.training.metrics import TIMING_KEYS, StepMetrics, StepTimer, rollout_metrics

T, F_ = True, False
#: two processes holding the same data: every sum doubles, maxima stay
TWO_ALIKE = Collectives(reduce_sum=lambda t: t + t)


def _output(loss, mask, low, high, dual, ratio, entropy=None, kl=None, weights=None):
    return ObjectiveOutput(
        loss=torch.tensor(loss), mask=torch.tensor(mask),
        clip=F.ClipStats(torch.tensor(low), torch.tensor(high), torch.tensor(dual), torch.tensor(ratio)),
        entropy=None if entropy is None else torch.tensor(entropy), kl=None if kl is None else torch.tensor(kl),
        importance_weights=None if weights is None else torch.tensor(weights),
    )


def _first():
    """3 loss tokens; the masked positions hold values that would change every metric if they were counted."""
    return _output(
        0.4, [[T, T, F_], [T, F_, F_]], low=[[T, F_, T], [F_, F_, F_]], high=[[F_, T, F_], [F_, F_, T]],
        dual=[[F_, F_, F_], [T, F_, T]], ratio=[[1.1, 0.9, 5.0], [1.2, 9.0, 0.01]],
        entropy=[[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]], kl=[[0.1, 0.2, 9.0], [0.3, 9.0, 9.0]],
    )


def _second():
    """3 loss tokens, with sampler importance weights."""
    return _output(
        0.1, [[T, T, T]], low=[[F_, F_, F_]], high=[[T, T, F_]], dual=[[F_, F_, F_]], ratio=[[0.5, 1.0, 1.5]],
        entropy=[[1.0, 1.0, 1.0]], kl=[[0.0, 0.0, 0.3]], weights=[[0.5, 2.0, 1.5]],
    )


def test_step_metrics_are_token_weighted_over_the_micro_batches_golden():
    metrics = StepMetrics(clip_ratio_c=3.0, importance_sampling_cap=2.0)
    metrics.update(_first())
    metrics.update(_second())
    result = metrics.compute(Collectives())
    expected = {
        "loss": 0.5,  # summed: each micro-batch's loss is already its share of the step's
        "num_tokens": 6.0,
        "clip_ratio/low_mean": 1 / 6,
        "clip_ratio/high_mean": 3 / 6,
        "clip_ratio/region_mean": 4 / 6,
        "clip_ratio/dual_mean": 1 / 6,
        "policy_ratio/mean": (1.1 + 0.9 + 1.2 + 0.5 + 1.0 + 1.5) / 6,
        "policy_ratio/max": 1.5,  # 5.0 and 9.0 are masked
        "policy_ratio/min": 0.5,  # 0.01 is masked
        "entropy": (1 + 2 + 3 + 3) / 6,
        "kl": (0.1 + 0.2 + 0.3 + 0.3) / 6,
        # the first micro-batch has no sampler logprobs: weight 1 exactly on its 3 tokens
        "sampling/importance_sampling_ratio/mean": (3 + 0.5 + 2.0 + 1.5) / 6,
        "sampling/importance_sampling_ratio/max": 2.0,
        "sampling/importance_sampling_ratio/min": 0.5,
        "sampling/masked_fraction/importance_sampling": 0.0,  # no weight of the second micro-batch is 0
    }
    assert set(result) == set(expected)
    assert result == pytest.approx(expected)


def test_step_metrics_reset_after_compute_and_sum_over_processes():
    metrics = StepMetrics()
    metrics.update(_first())
    metrics.compute(Collectives())
    metrics.update(_second())
    result = metrics.compute(TWO_ALIKE)  # only the second micro-batch: compute reset the first
    assert "clip_ratio/dual_mean" not in result
    # an importance weight was applied (its bounds are the objective's business): its ratio is logged
    assert result["sampling/importance_sampling_ratio/mean"] == pytest.approx((0.5 + 2.0 + 1.5) / 3)
    assert result["loss"] == pytest.approx(0.2) and result["num_tokens"] == 6.0  # sums over the two processes
    assert result["clip_ratio/high_mean"] == pytest.approx(2 / 3)  # means are unchanged by identical processes
    assert result["policy_ratio/max"] == 1.5 and result["policy_ratio/min"] == 0.5


def test_a_step_without_loss_tokens_has_nan_means_no_extrema_and_warns(caplog):
    metrics = StepMetrics()
    empty = _second()
    empty.mask = torch.zeros_like(empty.mask)
    metrics.update(empty)
    with caplog.at_level(logging.WARNING, logger=metrics_module.__name__):
        result = metrics.compute(Collectives())
    assert result["num_tokens"] == 0 and result["loss"] == pytest.approx(0.1)
    assert math.isnan(result["entropy"]) and math.isnan(result["clip_ratio/low_mean"])
    assert "policy_ratio/max" not in result and "policy_ratio/min" not in result
    assert "no loss tokens" in caplog.text


def _rollout():
    """2 groups of G=2: rewards [1, 0 | unscored, 0.5], lengths [3, 1, 2, 3], rows 0 and 3 truncated."""
    nan = float("nan")
    rollout = RolloutOutput(
        prompt_ids=torch.ones(4, 2, dtype=torch.long), prompt_mask=torch.ones(4, 2, dtype=torch.long),
        completion_ids=torch.ones(4, 3, dtype=torch.long),
        completion_mask=torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]]),
        truncated=torch.tensor([True, False, False, True]), completions=[""] * 4,
    )
    return ScoredRollout(
        rollout, per_function=torch.tensor([[1.0, nan], [0.0, nan], [nan, nan], [0.5, 1.0]]),
        rewards=torch.tensor([1.0, 0.0, nan, 0.5]), num_generations=2, pad_token_id=0,
    )


def test_rollout_metrics_golden():
    extra = {"kl": (torch.tensor(0.6), torch.tensor(3.0))}
    result = rollout_metrics(_rollout(), ["acc", "fmt"], extra, {"prompts/truncated": 1}, None, Collectives())
    expected = {
        "reward": 1.5 / 3,  # over the scored completions
        "reward_std": (math.sqrt(0.5) + 0.0) / 2,  # group 1: unbiased std of [1, 0]; group 2: one scored -> 0
        "frac_reward_zero_std": 1 / 2,
        "frac_reward_unscored": 1 / 4,
        "completions/mean_length": 9 / 4,
        "completions/max_length": 3.0,
        "completions/min_length": 1.0,
        "completions/clipped_ratio": 2 / 4,
        "rewards/acc/mean": 1.5 / 3,
        "rewards/fmt/mean": 1.0,
        "prompts/truncated": 1.0,
        "kl": 0.2,
    }
    assert set(result) == set(expected)
    assert result == pytest.approx(expected)


def test_rollout_metrics_average_means_and_add_totals_over_processes():
    stats = {"gen_batches": 2, "dropped_groups": 3, "filled_groups": 1}
    one = rollout_metrics(_rollout(), ["acc", "fmt"], {}, {"prompts/truncated": 1}, stats, Collectives())
    two = rollout_metrics(_rollout(), ["acc", "fmt"], {}, {"prompts/truncated": 1}, stats, TWO_ALIKE)
    assert one["dynamic_sampling/gen_batches"] == 2 and one["dynamic_sampling/dropped_groups"] == 3
    # totals double, means (including the generation rounds per process) do not
    assert two["prompts/truncated"] == 2.0 and two["dynamic_sampling/dropped_groups"] == 6.0
    assert two["dynamic_sampling/filled_groups"] == 2.0 and two["dynamic_sampling/gen_batches"] == 2.0
    for key in ("reward", "reward_std", "frac_reward_zero_std", "completions/mean_length", "rewards/acc/mean"):
        assert two[key] == pytest.approx(one[key])


def test_rollout_metrics_of_an_unscored_rollout_are_nan_and_warn(caplog):
    rollout = _rollout()
    rollout.rewards = torch.full((4,), float("nan"))
    rollout.per_function = torch.full((4, 1), float("nan"))
    with caplog.at_level(logging.WARNING, logger=metrics_module.__name__):
        result = rollout_metrics(rollout, ["acc"], {}, {"prompts/truncated": 0}, None, Collectives())
    assert math.isnan(result["reward"]) and math.isnan(result["reward_std"]) and math.isnan(result["rewards/acc/mean"])
    assert result["frac_reward_unscored"] == 1.0 and result["completions/mean_length"] == 9 / 4
    assert "no completion of this rollout was scored" in caplog.text


def test_row_metrics_are_reduced_over_the_rows_and_processes_golden():
    """A sampler's per-row metrics: a mean is sum(values) / sum(counts), a max the largest value over the processes,
    ``empty`` where the counts sum to 0."""
    f64 = dict(dtype=torch.float64)
    rows = {"turns/mean": RowMetric(torch.tensor([1.0, 3.0, 2.0, 2.0], **f64)),
            "turns/max": RowMetric(torch.tensor([1.0, 3.0, 2.0, 2.0], **f64), reduce="max"),
            "tools/error_rate": RowMetric(torch.tensor([1.0, 0.0, 1.0, 0.0], **f64),
                                          torch.tensor([2.0, 0.0, 1.0, 1.0], **f64), empty=0.0),
            "tools/timeout_rate": RowMetric(torch.zeros(4, **f64), torch.zeros(4, **f64), empty=0.0),
            "tokens/nothing": RowMetric(torch.zeros(4, **f64), torch.zeros(4, **f64))}
    one = rollout_metrics(_rollout(), ["acc", "fmt"], {}, {"prompts/truncated": 0}, None, Collectives(), rows)
    assert (one["turns/mean"], one["turns/max"], one["tools/error_rate"]) == (8 / 4, 3.0, 2 / 4)
    assert one["tools/timeout_rate"] == 0.0 and math.isnan(one["tokens/nothing"])
    elsewhere = Collectives(reduce_sum=lambda t: t + t, reduce_max=lambda t: torch.maximum(t, torch.full_like(t, 5.0)))
    two = rollout_metrics(_rollout(), ["acc", "fmt"], {}, {"prompts/truncated": 0}, None, elsewhere, rows)
    assert (two["turns/mean"], two["turns/max"], two["tools/error_rate"]) == (8 / 4, 5.0, 2 / 4)


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_step_timer_breakdown_on_a_fake_clock(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(metrics_module.time, "perf_counter", clock)
    timer = StepTimer()
    timer.start()
    with timer.span("rollout_s"):
        clock.now = 3.0
    timer.add("generated_tokens", 40)
    clock.now = 4.0
    timer.rollout_end()
    timer.before_backward()
    clock.now = 6.0
    timer.after_backward()  # 2 s
    clock.now = 6.5
    timer.before_backward()
    clock.now = 7.0
    timer.after_backward()  # 0.5 s
    clock.now = 8.0
    timer.after_optimizer_step()  # from the last backward's end: 1 s
    timer.add("train_tokens", 100)
    assert timer.get("backward_s") == 2.5 and timer.get("scoring_s") == 0.0
    clock.now = 10.0
    first = timer.step_end()
    assert first == {
        **{f"timing/{k}": 0.0 for k in TIMING_KEYS},
        "timing/rollout_s": 3.0, "timing/backward_s": 2.5, "timing/optimizer_s": 1.0,
        "timing/step_s": 10.0, "timing/other_s": 10.0 - 3.0 - 2.5 - 1.0,
        "timing/train_s": 6.0,  # from the rollout's end
        "generated_tokens": 40.0, "train_tokens": 100.0,
    }
    # the next step of the same rollout: no rollout, counts from the previous step's end; no optimizer_s without
    # an optimizer step after the backward
    clock.now = 11.0
    timer.before_backward()
    clock.now = 12.0
    timer.after_backward()
    clock.now = 15.0
    second = timer.step_end()
    assert second["timing/step_s"] == 5.0 and second["timing/train_s"] == 5.0
    assert second["timing/backward_s"] == 1.0 and second["timing/optimizer_s"] == 0.0
    assert second["timing/other_s"] == 4.0 and second["generated_tokens"] == 0.0 and timer.get("backward_s") == 0.0


def test_a_reward_timing_is_zero_on_a_step_that_scored_nothing(monkeypatch):
    """``timing/reward_<name>_s`` is the step's own: a later step of the same rollout logs 0.0, never the value of the
    step that scored (which a logger's last-value view would keep showing)."""
    clock = _Clock()
    monkeypatch.setattr(metrics_module.time, "perf_counter", clock)
    timer = StepTimer()
    timer.start()
    timer.add("reward_slow_s", 2.0)
    assert timer.step_end()["timing/reward_slow_s"] == 2.0
    assert timer.step_end()["timing/reward_slow_s"] == 0.0
    assert "timing/reward_other_s" not in timer.step_end()  # a function never timed: no key


def test_step_timer_without_start_has_no_step_time():
    timer = StepTimer()
    timer.add("rollout_s", 2.0)
    result = timer.step_end()
    assert "timing/step_s" not in result and "timing/other_s" not in result
    assert result["timing/rollout_s"] == 2.0 and result["timing/train_s"] == 0.0


def test_mismatch_metrics_and_masked_fractions_golden():
    """Issue 33: with sampler logprobs the mismatch is logged whatever the correction: d = log pi_old - log
    pi_sampler = [[0.1, -0.2, (masked 9)], [0.3, (masked), (masked)]] on 3 loss tokens. |d| mean 0.2, max 0.3; k3 mean
    (e^0.1 - 1.1 + e^-0.2 - 0.8 + e^0.3 - 1.3) / 3; ratio quantiles over exp(d) (linear interpolation); each knob's
    dropped fraction and "any" (a token dropped by either knob counts once); the reverse KL to a teacher."""
    from lightning_grpo.algorithm.correction import CorrectionOutput

    output = _output(0.0, [[T, T, F_], [T, F_, F_]], low=[[F_] * 3] * 2, high=[[F_] * 3] * 2, dual=[[F_] * 3] * 2,
                     ratio=[[1.0] * 3] * 2)
    output.correction = CorrectionOutput(
        log_ratio=torch.tensor([[0.1, -0.2, 9.0], [0.3, 9.0, 9.0]]),
        keep={"geometric": torch.tensor([[T, T, T], [F_, T, T]]), "kl": torch.tensor([[T, F_, F_], [F_, F_, F_]])})
    output.distillation_kl = torch.tensor([[0.5, 0.25, 9.0], [-0.15, 9.0, 9.0]])
    metrics = StepMetrics()
    metrics.update(output)
    result = metrics.compute(Collectives())
    k3 = (math.exp(0.1) - 1.1 + math.exp(-0.2) - 0.8 + math.exp(0.3) - 1.3) / 3
    ratios = sorted([math.exp(0.1), math.exp(-0.2), math.exp(0.3)])
    expected = {
        "sampling/sampling_logp_difference/mean": 0.2, "sampling/sampling_logp_difference/max": 0.3,
        "sampling/k3_kl": k3,
        "sampling/masked_fraction/geometric": 1 / 3, "sampling/masked_fraction/kl": 2 / 3,
        "sampling/masked_fraction/any": 2 / 3, "distillation/reverse_kl": 0.2,
        "sampling/mismatch_ratio/min": ratios[0], "sampling/mismatch_ratio/max": ratios[2],
        "sampling/mismatch_ratio/p50": ratios[1],
        "sampling/mismatch_ratio/p05": ratios[0] + 0.1 * (ratios[1] - ratios[0]),  # position 0.05 * 2 = 0.1
        "sampling/mismatch_ratio/p99": ratios[1] + 0.98 * (ratios[2] - ratios[1]),  # position 1.98
    }
    for key, value in expected.items():
        assert result[key] == pytest.approx(value, abs=1e-6), key
    # two processes holding the same data: the same means and quantiles (every token counted twice)
    metrics.update(output)
    assert metrics.compute(TWO_ALIKE)["sampling/k3_kl"] == pytest.approx(k3)
    plain = StepMetrics()
    plain.update(_first())  # no sampler logprobs, no knob: no mismatch metric
    assert not [k for k in plain.compute(Collectives()) if k.startswith("sampling/")]
