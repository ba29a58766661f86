"""What a rollout gives back: :class:`RolloutOutput` (token ids in a fixed layout, masks, sampler logprobs, and what
a sampler adds per row), how that layout is built (:func:`left_pad`, :func:`completion_mask_from_eos`,
:func:`finish_rollout`), and the stop request every engine and sampler polls (:class:`StopFlag`,
:class:`RolloutInterrupted`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Literal, Optional, Sequence

import torch
from torch import Tensor

from lightning_grpo.protocols.episode import EpisodeRecord
from lightning_grpo.protocols.routing import NO_EXPERT, ROUTED_DTYPE
from lightning_grpo.protocols.tokens import (
    PAD_ID,
    ROW_META,
    UNSET,
    Layout,
    cat_rows,
    fields_to,
    fill_unset,
    select_rows,
    token_fields,
    token_meta,
)
from lightning_grpo.protocols.vision import RowImages, row_images_from_state, row_images_state


@dataclass(frozen=True)
class RowMetric:
    """A metric a sampler reports for each row of its rollout (e.g. the model turns of each episode); the experience
    maker logs it over the rows it trains on, all processes together.

    Attributes:
        values: ``(N,)`` float64, each row's value (a mean's numerator, or what a max is taken over).
        counts: ``(N,)`` float64, each row's weight in a mean (its denominator: e.g. the row's tool calls, for an
            error rate over calls); None = 1 per row (a mean over rows). Unused by "max".
        reduce: "mean": ``sum(values) / sum(counts)`` over the trained rows of every process; "max": their largest
            value.
        empty: what is logged when there is nothing to average (``sum(counts)`` is 0 on every process): NaN by default,
            0 for a rate over events that did not happen (as TRL's ``tools/failure_frequency``).

    Raises:
        ValueError: ``values`` is not one-dimensional, ``counts`` has another shape, or ``reduce`` is unknown.
    """

    values: Tensor
    counts: Optional[Tensor] = None
    reduce: Literal["mean", "max"] = "mean"
    empty: float = math.nan

    def __post_init__(self) -> None:
        if self.values.dim() != 1:
            raise ValueError(f"RowMetric.values must be (N,), got shape {tuple(self.values.shape)}")
        if self.counts is not None and self.counts.shape != self.values.shape:
            raise ValueError(f"RowMetric.counts has shape {tuple(self.counts.shape)}, values "
                             f"{tuple(self.values.shape)}: one count per row")
        if self.reduce not in ("mean", "max"):
            raise ValueError(f"RowMetric.reduce={self.reduce!r} is invalid: 'mean' or 'max'")

    def weights(self) -> Tensor:
        """``(N,)`` float64: :attr:`counts`, or 1 per row."""
        return torch.ones_like(self.values) if self.counts is None else self.counts

    def select(self, rows: Tensor) -> "RowMetric":
        """The metric of the rows ``rows`` (``(M,)`` long indices), in that order."""
        return RowMetric(self.values[rows], None if self.counts is None else self.counts[rows], self.reduce, self.empty)

    @staticmethod
    def cat(metrics: Sequence["RowMetric"]) -> "RowMetric":
        """One metric over the rows of ``metrics`` (one rollout's generation rounds) in order; the first one's
        ``reduce`` and ``empty``."""
        first = metrics[0]
        counts = None if all(m.counts is None for m in metrics) else torch.cat([m.weights() for m in metrics])
        return RowMetric(torch.cat([m.values for m in metrics]), counts, first.reduce, first.empty)


@dataclass
class RolloutOutput:
    """The completions of one rollout, in prompt-major order (the G completions of prompt i are rows
    ``i*G .. i*G+G-1``): one row shape whatever sampled it. Every row has its environment mask, its episode record
    and its images, so a single-turn rollout is a rollout of one-turn episodes (prime-rl's training samples, verl's
    ``single_turn_agent_loop``): an engine that leaves ``env_mask``, ``episodes`` or ``images`` out gets all-zero
    masks, one :meth:`~lightning_grpo.protocols.episode.EpisodeRecord.one_turn` episode and ``()`` per row.

    Attributes:
        prompt_ids: ``(N, P)`` long, left-padded prompt ids repeated G times (N = num_prompts * G).
        prompt_mask: ``(N, P)`` long, 1 on real prompt tokens.
        completion_ids: ``(N, T)`` long, right-padded generated ids (multi-turn: the whole episode after the prompt,
            model and environment turns).
        completion_mask: ``(N, T)`` long, 1 up to and including the first EOS (any id in ``eos_token_ids``);
            multi-turn: 1 on the model's tokens only (every model turn through its EOS).
        truncated: ``(N,)`` bool, True when no EOS was generated within ``max_new_tokens`` (multi-turn: the last
            model turn has no EOS, or an observation did not fit the episode's token budget).
        completions: ``N`` decoded completion texts (special tokens skipped); multi-turn: each episode's last model
            turn.
        sampler_logprobs: ``(N, T)`` float32 logprobs of the generated tokens under the distribution the
            engine sampled them from (after temperature and truncation, see
            :class:`~lightning_grpo.protocols.sampling.SamplingConfig`), 0 at masked positions; ``None`` when the
            engine does not report them (HF engine by default).
        weight_version: the version of the weights that sampled these completions, for engines that count their
            weight syncs (the rollout server: 0 = the checkpoint it loaded, +1 per sync); None for the others.
        env_mask: ``(N, T)`` long, 1 on the environment's tokens of multi-turn episodes (:mod:`lightning_grpo.episodes`:
            tool results, observations, the template's turn separators): attended to, never trained; the real tokens
            of a row are ``completion_mask | env_mask``, a prefix. All 0 for single-turn rollouts.
        episodes: one :class:`~lightning_grpo.protocols.episode.EpisodeRecord` per row (multi-turn: turns, tool
            counts, limits, the environment's reward; single-turn: one model turn, ``single_turn``).
        columns: more columns for the reward functions, ``name -> N values`` (multi-turn: ``transcript`` and
            ``env_reward``), next to the dataset's; empty for single-turn rollouts.
        metrics: the sampler's per-row metrics (:class:`RowMetric`; multi-turn: ``turns/*``, ``tools/*``, ...),
            logged over the rows trained on; every process's sampler reports the same names. Empty for single-turn
            rollouts.
        images: each row's images (:class:`~lightning_grpo.protocols.vision.PromptImage`; vision-language prompts),
            in the order of their placeholder runs in the row's prompt and completion ids (multi-turn: the
            prompt's, then those of image observations); the G rows of a prompt share one tuple. ``()`` for a row
            without images.
        unscored: ``(N,)`` bool, rows the sampler says get no reward (an agent's episode that failed, with
            ``AgentRollout(on_error="skip")``): unscored as when every reward function returns None (no loss, left out
            of their group's statistics); None = every row is scored.
        prompt_routed_experts: a mixture-of-experts policy under ``GRPOConfig.routing_replay="R3"``: ``(N, P,
            moe_layers, top_k)`` int16, the experts the sampler's routers selected for each prompt token (the
            policy's routing layers in order, :class:`~lightning_grpo.models.moe.MoeRouters`), -1 at padding and
            wherever nothing was recorded (:mod:`lightning_grpo.protocols.routing`); None otherwise.
        completion_routed_experts: likewise ``(N, T, moe_layers, top_k)`` int16 for the completion tokens
            (multi-turn: the model's and the environment's tokens of every turn); -1 at padding and for a token the
            engine never fed to the model (a completion's last generated token).
        completion_versions: ``(N, T)`` long, the engine's weight version of each sampled token (a sample whose
            sampling spanned an in-flight weight update has several, non-decreasing; streaming rollouts: the
            trainer's optimizer step, which stamps every update, :mod:`lightning_grpo.rollout.streaming`; a multi-turn
            episode: each model turn's), -1 where no engine sampled the token (the environment's tokens, padding, a
            turn whose engine reported no version); None when the engine reports no versions.
    """

    prompt_ids: Tensor = field(metadata=token_meta(Layout.PROMPT, PAD_ID))
    prompt_mask: Tensor = field(metadata=token_meta(Layout.PROMPT, 0))
    completion_ids: Tensor = field(metadata=token_meta(Layout.COMPLETION, PAD_ID))
    completion_mask: Tensor = field(metadata=token_meta(Layout.COMPLETION, 0))
    truncated: Tensor = field(metadata=ROW_META)
    completions: list[str]
    sampler_logprobs: Optional[Tensor] = field(default=None, metadata=token_meta(Layout.COMPLETION, 0.0))
    weight_version: Optional[int] = None
    env_mask: Tensor = field(default=UNSET, metadata=token_meta(Layout.COMPLETION, 0))
    episodes: list[EpisodeRecord] = field(default_factory=list)
    columns: dict[str, list[Any]] = field(default_factory=dict)
    metrics: dict[str, RowMetric] = field(default_factory=dict)
    images: list[RowImages] = field(default_factory=list)
    unscored: Optional[Tensor] = field(default=None, metadata=ROW_META)
    prompt_routed_experts: Optional[Tensor] = field(default=None,
                                                    metadata=token_meta(Layout.PROMPT, NO_EXPERT, ROUTED_DTYPE))
    completion_routed_experts: Optional[Tensor] = field(default=None,
                                                        metadata=token_meta(Layout.COMPLETION, NO_EXPERT, ROUTED_DTYPE))
    completion_versions: Optional[Tensor] = field(default=None, metadata=token_meta(Layout.COMPLETION, -1))

    def __post_init__(self) -> None:
        """Fill what an engine left out (the class docstring).

        Raises:
            ValueError: ``episodes`` or ``images`` given, but not one per row.
        """
        fill_unset(self)
        n = len(self)
        if not self.episodes:
            lengths, truncated = self.completion_mask.sum(dim=1).tolist(), self.truncated.tolist()
            self.episodes = [EpisodeRecord.one_turn(text, int(length), bool(cut), self.weight_version)
                             for text, length, cut in zip(self.completions, lengths, truncated, strict=True)]
        if not self.images:
            self.images = [()] * n
        if len(self.episodes) != n or len(self.images) != n:
            raise ValueError(f"RolloutOutput has {len(self.episodes)} episodes and {len(self.images)} image entries "
                             f"for {n} rows: one of each per row")

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    def select(self, rows: Tensor) -> "RolloutOutput":
        """The rollout of rows ``rows`` (``(M,)`` long indices, in that order): every declared per-token and per-row
        field (:mod:`lightning_grpo.protocols.tokens`), the texts, episodes, images, columns and metrics."""
        index = rows.tolist()
        return replace(
            self, **select_rows(self, rows),
            completions=[self.completions[i] for i in index],
            episodes=[self.episodes[i] for i in index],
            images=[self.images[i] for i in index],
            columns={name: [values[i] for i in index] for name, values in self.columns.items()},
            metrics={name: metric.select(rows.cpu()) for name, metric in self.metrics.items()},
        )

    @staticmethod
    def cat(parts: Sequence["RolloutOutput"], pad_token_id: int) -> "RolloutOutput":
        """The rows of ``parts`` (e.g. the generation rounds of one rollout) in order: prompts re-padded on the left
        and completions on the right to the widest, each declared field with its own padding value
        (:mod:`lightning_grpo.protocols.tokens`).

        Raises:
            ValueError: no parts; or parts that differ in which optional fields they carry (a per-token field, the
                columns or the metrics), or in ``weight_version``: nothing is dropped or invented.
        """
        if not parts:
            raise ValueError("RolloutOutput.cat needs at least one part")
        first = parts[0]
        if len(parts) == 1:
            return first
        joined: dict[str, Any] = {}
        for name, spec in token_fields(RolloutOutput):
            joined[name] = cat_rows(name, [getattr(p, name) for p in parts], spec, pad_token_id)
        joined["truncated"] = torch.cat([p.truncated for p in parts])
        if any(p.unscored is not None for p in parts):  # None = every row scored
            joined["unscored"] = torch.cat([p.unscored if p.unscored is not None
                                            else torch.zeros(len(p), dtype=torch.bool) for p in parts])
        versions = {p.weight_version for p in parts}
        if len(versions) > 1:
            raise ValueError(f"RolloutOutput.cat: the parts were sampled by different weight versions {versions}")
        for attr in ("columns", "metrics"):
            names = [sorted(getattr(p, attr)) for p in parts]
            if any(n != names[0] for n in names):
                raise ValueError(f"RolloutOutput.cat: the parts' {attr} differ: {names}")
        return RolloutOutput(
            **joined,
            completions=[text for p in parts for text in p.completions],
            weight_version=first.weight_version,
            episodes=[e for p in parts for e in p.episodes],
            columns={name: [v for p in parts for v in p.columns[name]] for name in first.columns},
            metrics={name: RowMetric.cat([p.metrics[name] for p in parts]) for name in first.metrics},
            images=[row for p in parts for row in p.images],
        )

    def to(self, device: torch.device) -> "RolloutOutput":
        """The rollout with every declared per-token and per-row tensor on ``device`` (images stay where they are)."""
        return replace(self, **fields_to(self, device))

    def unscored_as_nan(self, rewards: Tensor) -> Tensor:
        """``rewards`` (``(N,)`` float) with NaN, the unscored value, at the rows :attr:`unscored` marks; ``rewards``
        itself when none is marked."""
        if self.unscored is None:
            return rewards
        return rewards.masked_fill(self.unscored.to(rewards.device), float("nan"))

    def state(self) -> dict[str, Any]:
        """As plain data (CPU tensors, lists, numbers, strings), for a checkpoint that loads with
        ``torch.load(weights_only=True)``."""
        state = {f.name: _to_cpu(getattr(self, f.name)) for f in fields(self)}
        state["episodes"] = [e.state() for e in self.episodes]
        state["metrics"] = {name: {f.name: _to_cpu(getattr(m, f.name)) for f in fields(m)}
                            for name, m in self.metrics.items()}
        state["images"] = row_images_state(self.images)
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "RolloutOutput":
        """The output :meth:`state` returned; a state saved before every row had its environment mask, episode and
        images (None for a single-turn rollout) gets all-zero masks, one-turn episodes and ``()`` rows."""
        values = dict(state)
        values["episodes"] = [EpisodeRecord.from_state(e) for e in values.get("episodes") or []]
        values["metrics"] = {name: RowMetric(**m) for name, m in values.get("metrics", {}).items()}
        values["images"] = row_images_from_state(values.get("images"))
        return cls(**values)


def _to_cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, Tensor) else value


class RolloutInterrupted(RuntimeError):
    """A rollout was stopped by its :class:`StopFlag` (e.g. on SIGTERM) before it finished; nothing of it is
    returned, and the caller discards it."""


class StopFlag:
    """A request to stop the rollout in progress, polled by the engines while they generate (the HF engine at
    every generated token, vLLM between engine steps); a stopped ``generate`` raises :class:`RolloutInterrupted`.

    The flag is set by :meth:`set` or whenever the ``watch``-ed predicate (e.g. ``lambda: trainer.received_sigterm``)
    returns True. Polling it neither consumes nor reseeds any random number generator. The engines also count the
    tokens they are generating on it (:meth:`tick`, ``ticks``: an estimate, one per running sequence per decoding
    step), which a progress bar can read while a rollout runs.
    """

    def __init__(self) -> None:
        self._set = False
        self._predicate: Optional[Callable[[], bool]] = None
        self.ticks = 0

    def tick(self, tokens: int) -> None:
        """Count ``tokens`` more tokens generated (progress only; never reset, read differences)."""
        self.ticks += tokens

    def set(self) -> None:
        self._set = True

    def clear(self) -> None:
        self._set = False

    def watch(self, predicate: Optional[Callable[[], bool]]) -> None:
        """Also count as set while ``predicate()`` is True (None: stop watching)."""
        self._predicate = predicate

    def is_set(self) -> bool:
        return self._set or (self._predicate is not None and bool(self._predicate()))

    def check(self, what: str = "the rollout") -> None:
        """Raise :class:`RolloutInterrupted` if the flag is set."""
        if self.is_set():
            raise RolloutInterrupted(f"{what} was stopped by a stop request (e.g. SIGTERM) before it finished")


def left_pad(
    sequences: Sequence[Sequence[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token-id lists into ``(B, L)`` long ids and a ``(B, L)`` long attention mask (the prompt layout of
    :class:`RolloutOutput`)."""
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if len(seq):
            ids[row, length - len(seq) :] = torch.as_tensor(list(seq), dtype=torch.long)
            mask[row, length - len(seq) :] = 1
    return ids.to(device), mask.to(device)


def completion_mask_from_eos(completion_ids: Tensor, eos_token_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Mask of the tokens up to and including the first EOS of each row.

    Works when pad == eos (SmolLM2, Qwen): the first EOS is found by position, not by comparing with pad.

    Args:
        completion_ids: ``(N, T)`` long generated ids (right-padded).
        eos_token_ids: every id that ends a completion (``generation_config.eos_token_id`` may be a list).

    Returns:
        ``(mask, truncated)``: ``(N, T)`` long mask and ``(N,)`` bool, True where no EOS occurs.

    Raises:
        ValueError: if ``eos_token_ids`` is empty.
    """
    if len(eos_token_ids) == 0:
        raise ValueError("eos_token_ids is empty: the tokenizer/generation_config defines no EOS token")
    is_eos = torch.isin(completion_ids, torch.as_tensor(list(eos_token_ids), device=completion_ids.device))
    n, t = completion_ids.shape
    has_eos = is_eos.any(dim=1)
    first = torch.where(has_eos, is_eos.int().argmax(dim=1), torch.full((n,), t, device=completion_ids.device))
    positions = torch.arange(t, device=completion_ids.device).expand(n, t)
    mask = (positions <= first.unsqueeze(1)).long()
    return mask, ~has_eos


def finish_rollout(prompt_ids: Tensor, prompt_mask: Tensor, num_generations: int, completion_ids: Tensor,
                   completion_mask: Tensor, truncated: Tensor, sampler_logprobs: Optional[Tensor], tokenizer: Any,
                   pad_token_id: int, weight_version: Optional[int] = None,
                   images: Sequence[RowImages] = ()) -> RolloutOutput:
    """The :class:`RolloutOutput` of ``B`` left-padded prompts (``(B, P)`` ids and mask, repeated G times here) and
    their ``B * G`` completions (one-turn episodes); the texts are decoded with ``tokenizer`` from the masked ids (pad
    where masked, special tokens skipped). ``images``: each prompt's images (its G rows share them), or none."""
    texts = tokenizer.batch_decode((completion_ids * completion_mask + pad_token_id * (1 - completion_mask)).tolist(),
                                   skip_special_tokens=True)
    return RolloutOutput(prompt_ids=prompt_ids.repeat_interleave(num_generations, dim=0),
                         prompt_mask=prompt_mask.repeat_interleave(num_generations, dim=0),
                         completion_ids=completion_ids, completion_mask=completion_mask, truncated=truncated,
                         completions=texts, sampler_logprobs=sampler_logprobs, weight_version=weight_version,
                         images=[row for row in images for _ in range(num_generations)])


def eos_token_ids_from(generation_config: Any, tokenizer: Any) -> list[int]:
    """Every id that ends a completion: ``generation_config.eos_token_id`` (an int or a list) plus the
    tokenizer's ``eos_token_id``, sorted."""
    ids: set[int] = set()
    configured = getattr(generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured is not None:
        ids.update(int(i) for i in configured)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)
