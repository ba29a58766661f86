"""The experience maker: one prompt batch -> one scored, shaped :class:`~lightning_grpo.training.experience.Experience`.

generate -> score -> (dynamic sampling: more rounds) -> shape the rewards -> behaviour (old), reference and teacher
logprobs -> KL in the reward -> group advantages -> rollout metrics. It sees models, a rollout worker, a reward set
and a :class:`RolloutContext` (the collectives and the trainer's settings, bound once per fit), never a Trainer or a
LightningModule.

Asynchronous rollouts (``GRPOConfig.max_staleness > 0``): :meth:`ExperienceMaker.prefetch` starts a rollout's
generation in the background (:class:`lightning_grpo.rollout.prefetch.RolloutPrefetcher`) and
:meth:`ExperienceMaker.make` given that :class:`~lightning_grpo.rollout.prefetch.PrefetchedRollout` waits for it and
does the rest (scoring, shaping, logprobs, advantages) on the trainer's thread, with the weights of the moment.

Streaming rollouts (``GRPOConfig.streaming.enabled``): :meth:`ExperienceMaker.open_stream` starts a
:class:`~lightning_grpo.rollout.streaming.RolloutStream` (groups sampled, scored and filtered as they arrive);
:meth:`ExperienceMaker.make` without a batch takes the next ``prompts_per_step`` finished groups from it and does the
rest; :meth:`ExperienceMaker.after_optimizer_step` sends every optimizer step's weights to the engine in flight.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field, replace
from typing import Callable, ContextManager, Optional

import torch
from torch import Tensor, nn

from lightning_grpo import functional as F
from lightning_grpo.algorithm import DynamicSampler, ScoredRollout
from lightning_grpo.algorithm.shaping import batch_reward_std, overlong_penalty, transform_rewards
from lightning_grpo.config import GRPOConfig
from lightning_grpo.evaluation.evaluator import EvalBatch
from lightning_grpo.events import ON_EXPERIENCE, ON_ROLLOUT_END, EventSink, ExperienceReady, RolloutEnd
from lightning_grpo.experience.collected import RolloutRows, reward_columns
from lightning_grpo.experience.evaluation import evaluate_batch
from lightning_grpo.experience.passes import LogprobPasses
from lightning_grpo.protocols.collectives import Collectives
from lightning_grpo.protocols.rollout import RolloutInterrupted, RolloutOutput
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.protocols.teacher import Teacher
from lightning_grpo.rewards import RewardSet, StartedScores
from lightning_grpo.rollout.prefetch import PrefetchedRollout, RolloutPrefetcher
from lightning_grpo.rollout.streaming import RolloutStream, TakenGroups
from lightning_grpo.rollout.streaming.group_scoring import GroupScorer
from lightning_grpo.rollout.streaming.versions import newest_version_mask, version_metrics
from lightning_grpo.rollout.worker import RolloutWorker, prompt_rows
from lightning_grpo.training.experience import Experience
from lightning_grpo.training.logprobs import CompletionLogprobs
from lightning_grpo.training.metrics import REWARD_TIMING_PREFIX, StepTimer, rollout_metrics

log = logging.getLogger(__name__)

PromptBatch = dict[str, list]


@dataclass(frozen=True)
class RolloutContext:
    """What the experience maker needs from the run, fixed for a fit (``GRPOModule`` binds it when the trainer's
    backend is known: :meth:`ExperienceMaker.bind`).

    Attributes:
        collectives: the data-parallel reductions (the backend's), flags on the device of the experience.
        timer: the step timer (``rollout_s``, ``scoring_s``, ``logprobs_s``, ``sync_s``, ``generated_tokens``).
        forward_context: the trainer's precision context for the no-grad logprob passes.
        micro_batches_per_step: ``Trainer(accumulate_grad_batches)``; a logprob pass takes
            ``mini_batch_size // micro_batches_per_step`` sequences (the rollout batch without ``mini_batch_size``).
        rank: this process's global rank: per-request seeds of rank r are offset by r * 2**32, so processes seeded
            alike never sample with the same seeds.
        token_budget: the micro-batch token budget (``max_tokens_per_microbatch`` as resolved,
            :class:`~lightning_grpo.config.ResolvedConfig`): the logprob passes take that many tokens at a time; None:
            ``micro_batches_per_step`` sequences.
    """

    collectives: Collectives = field(default_factory=Collectives)
    timer: StepTimer = field(default_factory=StepTimer)
    forward_context: Callable[[], ContextManager] = contextlib.nullcontext
    micro_batches_per_step: int = 1
    rank: int = 0
    token_budget: Optional[int] = None

    @property
    def device(self) -> torch.device:
        """Where the experience's tensors go."""
        return self.collectives.device


@dataclass
class _Collected:
    """What the generation rounds of one rollout produced (step 1 of :meth:`ExperienceMaker.make`)."""

    rollout: ScoredRollout
    sampling_stats: Optional[dict]
    weights_version: int
    totals: dict[str, float]
    rows: RolloutRows  # every row generated, by row_index
    generation_s: float
    outcomes: dict[str, list[float]]  # "<reward>/<outcome>" -> [completions, of all completions] (pooled rewards)
    taken: Optional[TakenGroups] = None  # streaming rollouts: the groups taken from the stream


def _check_prompt_column(batch: PromptBatch) -> None:
    if "prompt" not in batch:
        raise KeyError(f"prompt batches need a 'prompt' column, got columns {sorted(batch)}")


def _expand(batch: PromptBatch, g: int) -> tuple[list, dict[str, list]]:
    """A prompt batch's prompts and other columns, each entry repeated G times (prompt-major, as the completions)."""
    prompts = [p for p in batch["prompt"] for _ in range(g)]
    columns = {k: [v for v in values for _ in range(g)] for k, values in batch.items() if k != "prompt"}
    return prompts, columns


class ExperienceMaker:
    """Makes experience from prompt batches (see :meth:`make`).

    Args:
        config: the algorithm settings.
        rollout: the rollout worker (engine, prompt encoding, weight sync).
        rewards: the reward functions.
        logprobs: the completion-logprob computer (old and reference passes).
        events: called as ``events(name, payload)`` with ``on_rollout_end`` (:class:`~lightning_grpo.events.RolloutEnd`)
            and ``on_experience`` (:class:`~lightning_grpo.events.ExperienceReady`), see :mod:`lightning_grpo.events`.
        teacher: on-policy distillation's teacher (:mod:`lightning_grpo.distillation`), which scores every
            rollout's tokens into ``Experience.teacher_logprobs``; None without distillation.

    Attributes:
        prefetcher: the background generation of asynchronous rollouts (its thread starts with the first
            :meth:`prefetch`).
        stream: streaming rollouts' stream (:meth:`open_stream`), else None.
        context: the run's :class:`RolloutContext` (single-process defaults until :meth:`bind`).
    """

    def __init__(self, config: GRPOConfig, rollout: RolloutWorker, rewards: RewardSet,
                 logprobs: CompletionLogprobs, events: Optional[EventSink] = None,
                 teacher: Optional[Teacher] = None) -> None:
        self.config = config
        self.rollout = rollout
        self.rewards = rewards
        self.logprobs = logprobs
        self.passes = LogprobPasses(config, logprobs, teacher)
        self.events = events
        self.prefetcher = RolloutPrefetcher(rollout, on_generated=self._start_rewards)
        self.stream: Optional[RolloutStream] = None
        self._updates: list = []  # streaming: the weight updates since the last step's metrics
        self.context = RolloutContext()

    def bind(self, context: RolloutContext) -> None:
        """Use ``context`` (the collectives, timer, precision context, accumulation and rank of this run) from now
        on."""
        self.context = context

    def prefetch(self, batch: PromptBatch, policy: nn.Module) -> PrefetchedRollout:
        """Asynchronous rollouts: start generating ``batch``'s G completions per prompt in the background, from
        ``policy``'s current weights (:meth:`lightning_grpo.rollout.prefetch.RolloutPrefetcher.start`: waits for the
        engine to be idle, syncs, draws the seed base, starts). Pass the result to :meth:`make`.

        Raises:
            KeyError: ``batch`` has no "prompt" column.
            NonFiniteError: the policy has NaN or infinite weights.
        """
        _check_prompt_column(batch)
        ctx = self.context
        return self.prefetcher.start(batch, policy, self.config.num_generations, self._sampling, ctx.timer,
                                     ctx.collectives)

    def wait_for_rollouts(self) -> None:
        """Wait until no rollout is being generated in the background (before a checkpoint or a weight sync)."""
        self.prefetcher.wait_idle()

    def close(self) -> None:
        """Stop background generations and end their thread and the reward pool's (end of fit); a stream stops and
        is dropped."""
        self.prefetcher.close()
        if self.stream is not None:
            stream, self.stream = self.stream, None
            stream.close()
        self.rewards.close()

    def open_stream(self, policy: nn.Module, prompts_per_step: int, steps_per_rollout: int) -> RolloutStream:
        """Streaming rollouts: send ``policy``'s weights to the streaming engine as the trainer's version, then start
        keeping groups in flight (:class:`~lightning_grpo.rollout.streaming.RolloutStream`, kept as :attr:`stream`;
        idempotent). Group ``key`` is sampled with seeds from one base drawn now from torch's global generator.

        Raises:
            ValueError: the worker has no streaming engine; as :meth:`StreamingConfig.sizes`.
            NonFiniteError: the policy has NaN or infinite weights.
        """
        if self.stream is not None:
            return self.stream
        adapter = self.rollout.streaming_engine
        if adapter is None:
            raise ValueError("GRPOConfig.streaming.enabled=True needs a streaming engine: engine.name='vllm_server' "
                             "(the rollout servers' pool) or GRPOModule.streaming_engine = engine")
        cfg, ctx = self.config, self.context
        self.rollout.prepare(policy, force_sync=True, timer=ctx.timer, collectives=ctx.collectives)
        scorer = GroupScorer(self.rewards, self.rollout.tokenizer, adapter.pad_token_id, cfg.dynamic_sampling)
        sampling = replace(self._sampling(), seed=None)
        self.stream = RolloutStream(adapter.streaming, adapter.loop, cfg.streaming, scorer, self.rollout.encode,
                                    sampling, cfg.num_generations, prompts_per_step, steps_per_rollout,
                                    self.rollout.stop, self._request_seed())
        self.stream.open()
        return self.stream

    def after_optimizer_step(self, policy: nn.Module) -> None:
        """Streaming rollouts: after an optimizer step (the worker's ``weights_version`` already counts it), send the
        new weights to the engine in flight (:meth:`RolloutWorker.prepare`: the NaN check, the versioned update,
        counted as ``sync_s``) and apply the age bound to the finished groups; nothing otherwise."""
        if self.stream is None:
            return
        ctx = self.context
        self.rollout.prepare(policy, force_sync=True, timer=ctx.timer, collectives=ctx.collectives)
        if self.rollout.last_update is not None:
            self._updates.append(self.rollout.last_update)
        self.stream.purge(self.rollout.weights_version)

    def weight_update_metrics(self) -> dict[str, float]:
        """Streaming rollouts: ``timing/weight_update_s`` (the trainer's seconds sending weights) and
        ``timing/weight_pause_s`` (the longest time an engine's generation paused for them), summed over the updates
        since the last call; {} otherwise."""
        if self.stream is None:
            return {}
        updates, self._updates = self._updates, []
        return {"timing/weight_update_s": float(sum(u.seconds for u in updates)),
                "timing/weight_pause_s": float(sum(u.paused_s for u in updates))}

    def release(self) -> None:
        """What a failed run leaves (:class:`~lightning_grpo.runtime.cleanup.ReleaseOnException`): :meth:`close`, and
        the rollout engine the worker made is closed. Idempotent."""
        self.close()
        self.rollout.close()

    def _start_rewards(self, prefetched: PrefetchedRollout, out: RolloutOutput) -> Optional[StartedScores]:
        """On the generating thread, when a prefetched rollout is generated: start its slow rewards in the pool."""
        if not self.rewards.has_pooled:
            return None
        prompts, columns = _expand(prefetched.batch, prefetched.num_generations)
        return self.rewards.start(prompts, out.completions, reward_columns(columns, out), prefetched.num_generations)

    @torch.no_grad()
    def make(self, batch: Optional[PromptBatch], policy: nn.Module, ref: Optional[nn.Module], *,
             next_prompt_batch: Optional[Callable[[], Optional[PromptBatch]]] = None,
             prefetched: Optional[PrefetchedRollout] = None) -> Optional[Experience]:
        """One rollout batch: generate G completions per prompt, score them, shape the rewards, compute advantages
        and (when needed) the old, reference and teacher logprobs. Runs on this process's prompts only.

        Streaming rollouts (``batch`` None, after :meth:`open_stream`): the next ``prompts_per_step`` finished groups
        of the stream (:meth:`lightning_grpo.rollout.streaming.RolloutStream.take`, ``next_prompt_batch`` drawing the
        prompts it samples), scored when they arrived; the rest as below with ``policy`` as it is now (the proximal
        policy of AReaL's decoupled objective; each token's behaviour logprob is the sampler's, whatever version
        sampled it); with ``streaming.newest_version_only`` the tokens of each sample before its newest version
        become context (``env_mask``: attended to, no loss). None when the epoch's data is used up on any process
        (fewer groups than a rollout can still finish).

        With ``prefetched`` (asynchronous rollouts, from :meth:`prefetch` of the same ``batch``) the completions are
        that rollout's, generated from older weights (waited for if still running); the rest uses ``policy`` as it
        is now, which is the proximal policy of the decoupled objective (docs/algorithm.md, "Asynchronous
        rollouts"). ``rollout/staleness_{mean,max}``: optimizer steps between the weights that generated the rollout
        and ``policy``'s (0 for a synchronous rollout with ``engine.sync_every=1``).

        Rewards become advantages in this order (docs/algorithm.md): weighted sum of the reward functions (a
        completion that no function could score is "unscored": it gets no loss and is left out of its group's
        statistics) -> + soft overlong penalty -> scale, bias, clip -> - beta * sequence KL (``kl_in_reward``) ->
        :func:`lightning_grpo.functional.group_advantages`.

        With ``dynamic_sampling``, groups whose primary reward is the same for all G completions are dropped and
        ``next_prompt_batch`` is called for more prompts until ``len(batch["prompt"])`` informative groups are held
        or ``max_num_gen_batches`` prompt batches were generated; the batch is then filled up with dropped groups
        (:class:`lightning_grpo.algorithm.DynamicSampler`). Every process generates the same number of prompt
        batches (decided together), so every process ends with ``len(batch["prompt"]) * G`` sequences.

        Args:
            batch: a prompt batch, a dict of equal-length lists with a "prompt" key (message lists or strings)
                and the dataset's other columns (passed to the reward functions).
            policy: the policy (old logprobs); ``ref``: the reference policy (beta > 0) or None.
            next_prompt_batch: returns the next prompt batch, or None when the data is used up (dynamic sampling).
            prefetched: the rollout :meth:`prefetch` started for ``batch`` (None: generate it now).

        Raises:
            KeyError: a prompt batch has no "prompt" column.
            ValueError, RuntimeError: a reward function misbehaves or raises (see
                :func:`lightning_grpo.rewards.scoring.score_completions`); streaming: ``batch`` None without a stream
                (:meth:`open_stream`), or as :meth:`~lightning_grpo.rollout.streaming.RolloutStream.take`.
            RolloutInterrupted: the rollout worker's stop flag was set (e.g. SIGTERM) on any process: during
                generation (the engine stops within a token), scoring (after the reward function in progress) or
                the logprob passes; the partial rollout is discarded, on every process together.
            NonFiniteError: the policy has NaN or infinite weights (checked before sampling).
        """
        if batch is None:
            return self._make_streamed(policy, ref, next_prompt_batch)
        _check_prompt_column(batch)
        # 1. generate and score: the prefetched rollout, or generation rounds now (more with dynamic sampling)
        collected = self._collect(batch, policy, next_prompt_batch, prefetched)
        return self._experience(collected, policy, ref, len(batch["prompt"]))

    def _make_streamed(self, policy: nn.Module, ref: Optional[nn.Module],
                       draw: Optional[Callable[[], Optional[PromptBatch]]]) -> Optional[Experience]:
        """:meth:`make` of streaming rollouts: take the next finished groups (all processes agree whether the epoch
        ended or a stop request came), then the rest; the groups count as trained once their experience is made, and
        go back first in line when it fails."""
        stream, ctx = self.stream, self.context
        if stream is None:
            raise ValueError("ExperienceMaker.make without a prompt batch takes streamed groups: open_stream first "
                             "(GRPOModule does when GRPOConfig.streaming.enabled)")
        taken: Optional[TakenGroups] = None
        interrupted = False
        with ctx.timer.span("rollout_s"):
            try:
                taken = stream.take(stream.prompts_per_step, self.rollout.weights_version, draw)
            except RolloutInterrupted:
                interrupted = True
        stop, ended = ctx.collectives.any_process(interrupted), ctx.collectives.any_process(taken is None)
        if (stop or ended) and taken is not None:
            stream.untake()
        if stop:
            raise RolloutInterrupted("the rollout was stopped by a stop request (e.g. SIGTERM) before it finished")
        if ended or taken is None:
            return None
        try:
            experience = self._experience(self._collect_streamed(taken), policy, ref, len(taken.groups))
        except BaseException:
            stream.untake()
            raise
        stream.commit()
        return experience

    def _collect_streamed(self, taken: TakenGroups) -> _Collected:
        """Step 1 of :meth:`make` for streamed groups: their rows, rewards and outcome counts, as one rollout."""
        rows, timer = RolloutRows(), self.context.timer
        outcomes: dict[str, list[float]] = {}
        totals = {"prompts/truncated": 0.0, "generated_tokens": 0.0}
        parts = []
        for group in taken.groups:
            out, row = group.scored.rollout, group.item.row
            g = len(out)
            columns = {k: [v] * g for k, v in row.items() if k != "prompt"}
            parts.append(replace(group.scored, row_index=rows.add([row["prompt"]] * g, columns, out)))
            totals["prompts/truncated"] += float(group.item.truncated)
            totals["generated_tokens"] += float(out.completion_mask.sum())
            for key, count in group.outcomes.items():
                tally = outcomes.setdefault(key, [0.0, 0.0])
                tally[0] += count
                tally[1] += g
            for name, seconds in group.reward_seconds.items():
                timer.add(f"{REWARD_TIMING_PREFIX}{name}_s", seconds)
        scored = ScoredRollout.cat(parts)
        oldest = [v for v in (group.oldest_version for group in taken.groups) if v is not None]
        return _Collected(scored, None, min(oldest) if oldest else taken.version, totals, rows, taken.interval_s,
                          outcomes, taken)

    def _experience(self, collected: _Collected, policy: nn.Module, ref: Optional[nn.Module],
                    num_prompts: int) -> Experience:
        """Steps 2-5 of :meth:`make`: from the scored rollout to the experience and its metrics (``num_prompts``: the
        rollout's prompts, which size the logprob passes without ``mini_batch_size``)."""
        ctx = self.context
        rollout = collected.rollout.rollout  # the rows as sampled (ids, masks, per-token fields)
        scored_rollout = self._rollout_event(collected)
        if self.events is not None:
            self.events(ON_ROLLOUT_END, scored_rollout)
        # 2. shape the rewards: overlong penalty, scale / bias / clip
        extra: dict[str, tuple[Tensor, Tensor]] = {}  # metric -> (sum, count)
        shaped, scored = self._shaped_rewards(collected.rollout, extra)
        # 3. the experience (every per-token field of the rollout), its old, reference and teacher logprobs (and the
        # KL in the reward); an unscored row gets no loss token and is not laid out
        experience = Experience.of(rollout, ctx.device)
        experience.completion_mask = experience.completion_mask * scored.unsqueeze(1)  # [N, T] through the EOS
        experience.env_mask = experience.env_mask * scored.unsqueeze(1)
        if collected.taken is not None and self.config.streaming.newest_version_only:
            self._newest_version_only(experience)
        with ctx.timer.span("logprobs_s"):
            shaped = self._behaviour_logprobs(experience, shaped, scored, extra, policy, ref, num_prompts)
        if self.config.mask_truncated_completions:
            kept = (~rollout.truncated.to(ctx.device)).unsqueeze(1)
            experience.completion_mask = experience.completion_mask * kept
            experience.env_mask = experience.env_mask * kept  # a row without loss tokens is not laid out at all
        # 4. group advantages
        cfg = self.config
        experience.advantages = F.group_advantages(
            shaped, cfg.num_generations, cfg.scale_rewards, cfg.advantage_eps, estimator=cfg.advantage_estimator,
            std_floor=cfg.advantage_std_floor, valid=scored,
            batch_std=batch_reward_std(shaped, scored, ctx.collectives) if cfg.scale_rewards == "batch" else None,
        )
        # 5. rollout metrics, and a stop during the logprob passes still discards the rollout
        extra["reward_shaped"] = (shaped[scored].sum(), scored.sum().float())
        for key, (count, total) in collected.outcomes.items():  # every process has the same keys (declared ones)
            extra[f"rewards/{key}"] = (torch.tensor(count), torch.tensor(total))
        experience.metrics = self._metrics(collected, extra)
        if ctx.collectives.any_process(self.rollout.stop.is_set()):
            raise RolloutInterrupted("the rollout was stopped by a stop request (e.g. SIGTERM) before it finished")
        ctx.timer.add("generated_tokens", collected.totals["generated_tokens"])
        ctx.timer.rollout_end()
        if self.events is not None:
            self.events(ON_EXPERIENCE, ExperienceReady(experience, scored_rollout, shaped))
        return experience

    @staticmethod
    def _newest_version_only(experience: Experience) -> None:
        """``streaming.newest_version_only``: each sample's tokens before its newest weight version lose their loss
        and become context (``env_mask``: attended to, no gradient; they are a prefix, versions never decrease)."""
        versions = experience.completion_versions
        assert versions is not None, "streamed rollouts carry their tokens' versions"
        mask = experience.completion_mask
        kept = newest_version_mask(versions, mask)
        context = mask - kept
        experience.env_mask = context if experience.env_mask is None else experience.env_mask + context
        experience.completion_mask = kept

    def _collect(self, batch: PromptBatch, policy: nn.Module,
                 next_prompt_batch: Optional[Callable[[], Optional[PromptBatch]]],
                 prefetched: Optional[PrefetchedRollout]) -> _Collected:
        """Step 1 of :meth:`make`: the scored completions of the rollout, with what its metrics need."""
        ctx, cfg = self.context, self.config
        sampler = DynamicSampler(len(batch["prompt"]), self.rewards.primary_index, cfg.dynamic_sampling)
        rows = RolloutRows()
        outcomes: dict[str, list[float]] = {}
        totals = {"prompts/truncated": 0.0, "generated_tokens": 0.0}
        rollout_s_before = ctx.timer.get("rollout_s")
        if prefetched is not None:  # asynchronous: generated in the background (no dynamic sampling there)
            with ctx.timer.span("rollout_s"):
                try:
                    out: Optional[RolloutOutput] = prefetched.result()
                except RolloutInterrupted:
                    out = None
            pad = int(self.rollout.require_engine().pad_token_id)
            sampler.add(self._score(batch, out, prefetched.num_truncated, pad, totals, rows, outcomes,
                                    prefetched.started_rewards))
            version = prefetched.weights_version
        else:
            with self.rollout.awake(policy, timer=ctx.timer, collectives=ctx.collectives):
                version = self.rollout.engine_version
                while True:
                    sampler.add(self._generate_and_score(batch, totals, rows, outcomes))
                    if not cfg.dynamic_sampling or sampler.gen_batches >= cfg.max_num_gen_batches:
                        break
                    if not ctx.collectives.any_process(sampler.need_more):
                        break
                    next_batch = next_prompt_batch() if next_prompt_batch is not None else None
                    if ctx.collectives.any_process(next_batch is None):
                        break
                    assert next_batch is not None
                    batch = next_batch
        rollout, sampling_stats = sampler.batch()
        generation_s = ctx.timer.get("rollout_s") - rollout_s_before  # this rollout's generation time, all rounds
        if prefetched is not None:  # the engine's own time, not the wait for it
            generation_s = prefetched.generate_s
        return _Collected(rollout, sampling_stats if cfg.dynamic_sampling else None, version, totals, rows,
                          generation_s, outcomes)

    def _shaped_rewards(self, rollout: ScoredRollout, extra: dict[str, tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        """Step 2 of :meth:`make`: ``(shaped, scored)``, the ``[N]`` rewards after the overlong penalty and
        scale / bias / clip (NaN = unscored) and the ``[N]`` bool mask of the scored completions."""
        cfg, device = self.config, self.context.device
        shaped = rollout.rewards.to(device)  # [N] weighted sum, NaN = unscored
        scored = ~torch.isnan(shaped)  # [N]
        if cfg.overlong_buffer > 0:
            lengths = rollout.rollout.completion_mask.to(device).sum(dim=1)
            penalty = overlong_penalty(lengths, cfg.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty_factor)
            shaped = shaped + penalty
            extra["rewards/overlong_penalty/mean"] = (penalty.sum(), torch.tensor(float(len(penalty))))
        return transform_rewards(shaped, cfg.reward_scale, cfg.reward_bias, cfg.reward_clip), scored

    def _metrics(self, collected: _Collected, extra: dict[str, tuple[Tensor, Tensor]]) -> dict[str, float]:
        """Step 5 of :meth:`make`: the rollout metrics (all processes; with the sampler's per-row metrics of the rows
        trained on, e.g. multi-turn ``turns/*``), ``tokens_per_s`` and the staleness."""
        rollout = collected.rollout
        metrics = rollout_metrics(rollout, self.rewards.names, extra, collected.totals, collected.sampling_stats,
                                  self.context.collectives, collected.rows.metrics(rollout.row_index))
        metrics["tokens_per_s"] = collected.totals["generated_tokens"] / max(collected.generation_s, 1e-9)
        staleness = float(self.rollout.weights_version - collected.weights_version)
        metrics["rollout/staleness_mean"] = metrics["rollout/staleness_max"] = staleness
        if collected.taken is not None:
            metrics.update(self._stream_metrics(collected))
        return metrics

    def _stream_metrics(self, collected: _Collected) -> dict[str, float]:
        """Streaming rollouts' metrics (docs/engines.md, "Streaming rollouts"): the tokens' and samples' staleness and
        version spans (:func:`~lightning_grpo.rollout.streaming.versions.version_metrics`), the groups dropped or sent
        again since the last rollout (summed over processes), the groups in flight and waiting, and the trainer's wait
        for them (``timing/data_wait_s``, the longest of the processes')."""
        taken, collectives = collected.taken, self.context.collectives
        assert taken is not None
        rollout = collected.rollout.rollout
        assert rollout.completion_versions is not None, "streamed rollouts carry their tokens' versions"
        metrics = version_metrics(rollout.completion_versions, rollout.completion_mask, taken.version, collectives)
        counts = taken.counts
        names = ("streaming/stale_groups", "streaming/regenerated_groups", "streaming/resampled_groups",
                 "streaming/uninformative_groups", "streaming/inflight_groups", "streaming/buffered_groups")
        local = torch.tensor([counts.stale, counts.regenerated, counts.resampled, counts.uninformative,
                              taken.in_flight, taken.ready], dtype=torch.float64)
        summed = collectives.reduce_sum(local.to(collectives.device)).cpu().tolist()
        metrics.update(dict(zip(names, summed, strict=True)))
        if self.config.dynamic_sampling:
            metrics["dynamic_sampling/dropped_groups"] = metrics["streaming/uninformative_groups"]
        wait = torch.tensor([taken.wait_s], dtype=torch.float64)
        metrics["timing/data_wait_s"] = float(collectives.reduce_max(wait.to(collectives.device)).item())
        return metrics

    def _rollout_event(self, collected: _Collected) -> RolloutEnd:
        """The texts and scores of the rollout to be trained on (rows found by ``row_index``)."""
        rollout = collected.rollout
        rows = collected.rows.select(rollout.row_index)
        names = sorted({k for row in rows for k in row.columns})
        return RolloutEnd(
            prompts=[r.prompt for r in rows], completions=[r.completion for r in rows], rewards=rollout.rewards,
            per_function=rollout.per_function, reward_names=list(self.rewards.names),
            lengths=rollout.rollout.completion_mask.sum(dim=1), truncated=rollout.rollout.truncated,
            columns={k: [r.columns.get(k) for r in rows] for k in names}, num_generations=rollout.num_generations,
            weights_version=collected.weights_version, episodes=collected.rows.episodes(rollout.row_index),
            prompt_keys=None if collected.taken is None else [k for k in collected.taken.prompt_keys
                                                              for _ in range(rollout.num_generations)],
        )

    def _generate_and_score(self, batch: PromptBatch, totals: dict[str, float], rows: RolloutRows,
                            outcomes: dict[str, list[float]]) -> ScoredRollout:
        """Generate G completions for each prompt of ``batch`` and score them (one generation round). A stopped
        round raises :class:`RolloutInterrupted` on every process together (so that no process is left waiting in
        a collective)."""
        _check_prompt_column(batch)
        engine = self.rollout.require_engine()
        with self.context.timer.span("rollout_s"):
            encoded = self.rollout.encode(batch["prompt"], prompt_rows(batch))
            sampling = self._sampling()
            try:
                out: Optional[RolloutOutput] = self.rollout.sample(engine, encoded, self.config.num_generations,
                                                                   sampling, self.context.collectives)
            except RolloutInterrupted:
                out = None
        return self._score(batch, out, encoded.num_truncated, int(engine.pad_token_id), totals, rows, outcomes)

    def _sampling(self) -> SamplingConfig:
        """The rollouts' sampling settings, with a per-request seed base (:meth:`_request_seed`)."""
        cfg = self.config
        return SamplingConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                              top_k=cfg.top_k, min_p=cfg.min_p, seed=self._request_seed(),
                              banned_token_ids=self.rollout.banned_token_ids)

    def _score(self, batch: PromptBatch, out: Optional[RolloutOutput], num_truncated: int, pad_token_id: int,
               totals: dict[str, float], rows: RolloutRows, outcomes: dict[str, list[float]],
               started: Optional[StartedScores] = None) -> ScoredRollout:
        """Score one generation round's completions (``out`` None: it was interrupted, which every process then
        raises as :class:`RolloutInterrupted`); its rows go into ``rows``. ``started``: its slow rewards,
        started when it was generated. Adds ``timing/reward_<name>_s`` to the timer and the pooled rewards' outcome
        counts to ``outcomes``."""
        g, timer = self.config.num_generations, self.context.timer
        prompts, columns = _expand(batch, g)
        if out is not None and not self.rollout.stop.is_set():
            columns = reward_columns(columns, out)
            with timer.span("scoring_s"):
                scores = self.rewards.score(prompts, out.completions, columns, group_size=g, started=started)
            for name, seconds in scores.seconds.items():
                timer.add(f"{REWARD_TIMING_PREFIX}{name}_s", seconds)
            for key, count in scores.outcomes.items():
                tally = outcomes.setdefault(key, [0.0, 0.0])
                tally[0] += count
                tally[1] += len(out.completions)
        if self.context.collectives.any_process(out is None or self.rollout.stop.is_set()):
            raise RolloutInterrupted("the rollout was stopped by a stop request (e.g. SIGTERM) before it finished")
        assert out is not None
        scores.rewards = out.unscored_as_nan(scores.rewards)  # e.g. a failed agent's episode under on_error="skip"
        if unscored := torch.isnan(scores.rewards).nonzero().flatten().tolist():
            log.warning("no reward function scored completions %s (or the sampler marked them): no loss", unscored)
        totals["prompts/truncated"] += num_truncated
        totals["generated_tokens"] += float(out.completion_mask.sum())
        row_index = rows.add(prompts, columns, out)
        return ScoredRollout(out, per_function=scores.per_function, rewards=scores.rewards, num_generations=g,
                             pad_token_id=pad_token_id, row_index=row_index)

    def evaluate(self, batch: PromptBatch, policy: nn.Module, accuracy: Optional[Callable[..., list]] = None,
                 replica: tuple[int, int] = (0, 1)) -> EvalBatch:
        """The evaluation rollouts of a validation batch (:func:`lightning_grpo.experience.evaluation.evaluate_batch`,
        ``replica``: this process's distributed sampler ``(rank, num_replicas)``), scored by ``accuracy`` (default:
        the reward set's), once no background rollout runs (no sync while one does)."""
        self.prefetcher.wait_idle()
        return evaluate_batch(self.rollout, self.config, batch, policy, accuracy or self.rewards.accuracy,
                              self.context.collectives, replica)

    def _request_seed(self) -> Optional[int]:
        """A base for per-request seeds (engines that ``seeds_per_request``: vLLM, colocated or served), drawn from
        torch's global generator (restored on resume), offset by ``rank * 2**32`` (disjoint per process); None for an
        engine that samples from that generator itself (HF)."""
        if not self.rollout.require_engine().capabilities.seeds_per_request:
            return None
        return int(torch.randint(0, 2**31 - 1, (1,)).item()) + self.context.rank * 2**32

    def _behaviour_logprobs(self, experience: Experience, shaped: Tensor, scored: Tensor,
                            extra: dict[str, tuple[Tensor, Tensor]], policy: nn.Module, ref: Optional[nn.Module],
                            num_prompts: int) -> Tensor:
        """Step 3 of :meth:`make`: the old, reference and teacher logprobs and the KL in the reward
        (:class:`~lightning_grpo.experience.passes.LogprobPasses`), in passes of ``mini_batch_size //
        micro_batches_per_step`` sequences (the rollout batch of ``num_prompts`` prompts without ``mini_batch_size``)
        or of the run's token budget. Returns the rewards (minus beta * sequence KL with ``kl_in_reward``)."""
        cfg, ctx = self.config, self.context
        micro_batch_size = max(1, (cfg.mini_batch_size or num_prompts * cfg.num_generations)
                               // ctx.micro_batches_per_step)
        return self.passes.run(experience, shaped, scored, extra, policy, ref, micro_batch_size, ctx.forward_context,
                               max_tokens=ctx.token_budget)
