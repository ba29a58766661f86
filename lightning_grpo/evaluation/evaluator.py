"""Sampled evaluation as torchmetrics: unbiased pass@k, maj@k and mean@k, with any reward function as the check.

For one prompt with ``n`` sampled completions of which ``c`` are correct (a reward function's value > 0.5):

* pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", eq. 1): the probability that at
  least one of ``k`` completions drawn without replacement from the ``n`` is correct,
  ``1 - C(n - c, k) / C(n, k)``, an unbiased estimator for ``n >= k``; computed as the stable product
  ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)`` (the paper's numpy form).
* maj@k (majority voting, "self-consistency", Wang et al. 2023): the ``k`` (= ``n``) completions vote with their
  extracted final answers (:func:`answer_key`; a completion without one abstains); answers are grouped by
  mathematical equivalence (:func:`same_answer`: numbers by exact value, other LaTeX answers by math-verify, so
  ``\\boxed{2\\sqrt{2}}`` and ``\\boxed{\\sqrt{8}}`` are one vote and ``\\boxed{2\\sqrt{2}}`` is not the number 2); the
  largest group wins and the prompt scores that group's correctness (the mean reward of the completions in it). A tie
  scores the mean over the tied groups, i.e. the expected score of a uniformly random tie-break; no vote at all
  scores 0.
* mean@k: the mean reward of the ``n`` completions (the mean of the raw values, not thresholded).

Each metric's state is a sum and a count (``dist_reduce_fx="sum"``), so under DDP it is the mean over all
processes' prompts, each prompt counted once: Lightning's ``DistributedSampler`` pads the evaluation set to a
multiple of the process count by repeating its first prompts, and those repeats are generated (the processes stay
in step) but not counted (:func:`counted_rows`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric, Metric

from lightning_grpo.rewards.gsm8k import boxed_contents, boxed_number, extract_answer
from lightning_grpo.rewards.math import equivalent_answers

#: Rewards above this count as correct for pass@k and maj@k.
CORRECT_THRESHOLD = 0.5


def counted_rows(indices: Sequence[int], num_replicas: int, rank: int) -> Tensor:
    """``(B,)`` bool: which rows of an evaluation batch this process counts, so that every prompt is counted by
    exactly one process: the prompt at dataset position ``i`` by process ``i % num_replicas``.

    Why that is right: torch's ``DistributedSampler`` (which Lightning puts in front of the evaluation loaders,
    ``shuffle=False``) gives process ``r`` the positions ``r, r + W, r + 2W, ...`` of the dataset followed by its
    first ``pad`` prompts again (``W`` processes, ``pad < W``), so the original of prompt ``i`` goes to process
    ``i % W`` and its repeat, at position ``N + i`` with ``N % W != 0``, to another one. Without a distributed
    sampler every process sees every prompt and each is still counted once over the processes.
    """
    return torch.tensor([int(i) % num_replicas == rank for i in indices], dtype=torch.bool)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` correct (Chen et al. 2021, eq. 1): ``1 - C(n-c, k) / C(n, k)``.

    Raises:
        ValueError: ``k < 1``, ``n < k`` or ``c`` outside ``[0, n]`` (the values are named).
    """
    if k < 1 or n < k or not 0 <= c <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    result = 1.0
    for i in range(n - c + 1, n + 1):
        result *= 1.0 - k / i
    return 1.0 - result


#: A canonical number (:func:`lightning_grpo.rewards.numbers.canonical`): ``-12.5``, ``1/3``.
_CANONICAL = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def same_answer(a: str, b: str) -> bool:
    """Whether two extracted answers (:func:`answer_key`) are the same mathematical value: equal texts; two numbers
    (canonical forms) only when equal, i.e. exact values; otherwise math-verify's ``verify`` of the two parsed as
    LaTeX (:func:`lightning_grpo.rewards.math.equivalent_answers`), as the MATH reward compares a completion with its
    gold."""
    if a == b:
        return True
    if _CANONICAL.fullmatch(a) and _CANONICAL.fullmatch(b):
        return False
    return equivalent_answers(a, b)


def majority_score(answers: Sequence[Optional[str]], rewards: Sequence[float],
                   equivalent: Callable[[str, str], bool] = same_answer) -> float:
    """maj@k of one prompt: the largest group of equivalent answers' mean reward, ties averaged (see the module
    docstring).

    Args:
        answers: the ``k`` completions' extracted answers (None: abstains).
        rewards: their ``k`` reward values.
        equivalent: whether two distinct answers are one vote (:func:`same_answer`); each distinct answer joins the
            first group it is equivalent to.

    Raises:
        ValueError: ``answers`` and ``rewards`` differ in length.
    """
    if len(answers) != len(rewards):
        raise ValueError(f"maj@k got {len(answers)} answers for {len(rewards)} rewards")
    groups: list[list[str]] = []  # distinct answers, grouped
    for answer in dict.fromkeys(a for a in answers if a is not None):
        group = next((g for g in groups if any(equivalent(answer, other) for other in g)), None)
        if group is None:
            groups.append([answer])
        else:
            group.append(answer)
    if not groups:
        return 0.0
    members = [[float(r) for a, r in zip(answers, rewards, strict=True) if a in group] for group in groups]
    top = max(len(m) for m in members)
    scores = [sum(m) / len(m) for m in members if len(m) == top]
    return sum(scores) / len(scores)


def answer_key(completion: str) -> Optional[str]:
    """The final answer a completion votes with. With a ``\\boxed{...}``, the last box read whole: its number in
    canonical form (:func:`lightning_grpo.rewards.gsm8k.boxed_number`) or else its LaTeX without spaces
    (``\\boxed{2\\sqrt{2}}`` votes ``2\\sqrt{2}``, not 2); without a box, the GSM8K extraction (``#### N``, "the answer
    is N", the last number); None when there is none."""
    boxes = boxed_contents(completion)
    if boxes:
        return boxed_number(boxes[-1]) or "".join(boxes[-1].split()) or None
    return extract_answer(completion)


class _MeanOverPrompts(Metric):
    """A sum of per-prompt scores and a prompt count; ``compute`` is their ratio (NaN when empty)."""

    full_state_update = False
    higher_is_better = True

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")

    def _add(self, scores: list[float]) -> None:
        self.total += sum(scores)
        self.count += len(scores)

    def compute(self) -> Tensor:
        return (self.total / self.count).float() if self.count > 0 else torch.tensor(float("nan"))


def _check_rewards(rewards: Tensor, k: int) -> Tensor:
    if rewards.dim() != 2 or rewards.shape[1] < k:
        raise ValueError(f"rewards must be (prompts, n) with n >= k={k}, got shape {tuple(rewards.shape)}")
    return rewards.detach().double().cpu()


class PassAtK(_MeanOverPrompts):
    """Mean unbiased pass@k over prompts (:func:`pass_at_k`). ``update(rewards)``: ``rewards`` (prompts, n) float,
    ``n >= k``; NaN (unscored) counts as wrong.

    Raises:
        ValueError: ``k < 1``; at ``update``, a shape with ``n < k``.
    """

    def __init__(self, k: int, **kwargs) -> None:
        super().__init__(**kwargs)
        if k < 1:
            raise ValueError(f"pass@k needs k >= 1, got k={k}")
        self.k = k

    def update(self, rewards: Tensor) -> None:
        values = _check_rewards(rewards, self.k)
        correct = (values > CORRECT_THRESHOLD).sum(dim=1).tolist()
        self._add([pass_at_k(values.shape[1], int(c), self.k) for c in correct])


class MajAtK(_MeanOverPrompts):
    """Mean maj@k over prompts (:func:`majority_score`). ``update(rewards, answers)``: ``rewards`` (prompts, k)
    float (NaN counts 0), ``answers`` one list of ``k`` extracted answers (or None) per prompt.

    Raises:
        ValueError: a shape that does not match ``answers``.
    """

    def update(self, rewards: Tensor, answers: Sequence[Sequence[Optional[str]]]) -> None:
        values = _check_rewards(rewards, 1).nan_to_num(0.0)
        if len(answers) != values.shape[0]:
            raise ValueError(f"maj@k got answers for {len(answers)} prompts and rewards for {values.shape[0]}")
        self._add([majority_score(a, r) for a, r in zip(answers, values.tolist(), strict=True)])


class MeanAtK(_MeanOverPrompts):
    """Mean reward over prompts and their ``n`` samples. ``update(rewards)``: ``rewards`` (prompts, n) float; NaN
    (unscored) counts 0."""

    def update(self, rewards: Tensor) -> None:
        values = _check_rewards(rewards, 1).nan_to_num(0.0)
        self._add(values.mean(dim=1).tolist())


@dataclass
class EvalBatch:
    """One validation batch's results.

    Attributes:
        greedy: ``(B,)`` float32 greedy completions' scores, NaN where unscored.
        lengths: ``(B,)`` long greedy completion lengths in tokens.
        samples: ``(B, n)`` float32 sampled completions' scores (NaN unscored), or None without samples.
        answers: the samples' extracted answers (:func:`answer_key`), ``B`` lists of ``n``.
        counted: ``(B,)`` bool, the rows this process counts (:func:`counted_rows`; the others are a distributed
            sampler's padding), or None for all.
    """

    greedy: Tensor
    lengths: Tensor
    samples: Optional[Tensor] = None
    answers: list[list[Optional[str]]] = field(default_factory=list)
    counted: Optional[Tensor] = None

    def only_counted(self) -> "EvalBatch":
        """The batch without its uncounted rows."""
        if self.counted is None:
            return self
        keep = self.counted.to(self.greedy.device)
        rows = keep.nonzero().flatten().tolist()
        return EvalBatch(self.greedy[keep], self.lengths[keep], None if self.samples is None else self.samples[keep],
                         [self.answers[i] for i in rows] if self.answers else [])


class Evaluator(nn.Module):
    """The validation/test metrics of every dataset (dataloader), as torchmetrics the module logs.

    Names: ``<stage>/<metric>`` for the first dataset and ``<stage>/<dataset>/<metric>`` for the others, metric in
    ``accuracy`` (greedy), ``pass@1`` (greedy accuracy without samples, else unbiased from the samples),
    ``pass@<k>``, ``maj@<k>``, ``mean@<k>`` (with samples) and ``mean_length`` (greedy, tokens).

    Args:
        k: k of pass@k and maj@k (maj@k votes with the first k samples).
    """

    def __init__(self, k: Optional[int]) -> None:
        super().__init__()
        self.k = k
        self.metrics = nn.ModuleDict()

    def _metric(self, key: str, make: type, device: torch.device, *args) -> Metric:
        if key not in self.metrics:
            self.metrics[key] = make(*args).to(device)
        metric = self.metrics[key]
        if not torch.is_inference_mode_enabled():  # states made under inference mode (a trainer.validate before
            for name in metric._defaults:  # fit): clone them, or the in-place update outside it fails
                state = getattr(metric, name)
                if isinstance(state, Tensor) and state.is_inference():
                    setattr(metric, name, state.clone())
        return metric

    def update(self, stage: str, dataset: Optional[str], out: EvalBatch) -> dict[str, tuple[Metric, int, str]]:
        """Update the metrics of ``stage`` ("val" or "test") and ``dataset`` (None: the first) with ``out``;
        returns ``{name: (metric, batch size, its attribute path under this module)}`` to log."""
        prefix = stage if dataset is None else f"{stage}/{dataset}"
        out = out.only_counted()
        device, size = out.greedy.device, max(1, len(out.greedy))
        logged: dict[str, tuple[Metric, int, str]] = {}

        def add(name: str, make: type, *args) -> Metric:
            key = _key(f"{prefix}/{name}")
            metric = self._metric(key, make, device, *args)
            logged[f"{prefix}/{name}"] = (metric, size, f"metrics.{key}")
            return metric

        greedy = out.greedy[~torch.isnan(out.greedy)]
        add("accuracy", MeanMetric).update(greedy)
        add("mean_length", MeanMetric).update(out.lengths.float())
        if out.samples is None:
            add("pass@1", MeanMetric).update(greedy)
            return logged
        k = self.k or out.samples.shape[1]
        add("pass@1", PassAtK, 1).update(out.samples)
        add(f"pass@{k}", PassAtK, k).update(out.samples)
        add(f"maj@{k}", MajAtK).update(out.samples[:, :k], [a[:k] for a in out.answers])
        add(f"mean@{k}", MeanAtK).update(out.samples[:, :k])
        return logged


def _key(name: str) -> str:
    """A metric name as a valid ``nn.ModuleDict`` key."""
    return name.replace("/", "|").replace("@", "_at_").replace(".", "_")
