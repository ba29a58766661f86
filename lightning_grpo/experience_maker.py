"""The experience maker: one prompt batch -> one scored, shaped :class:`~lightning_grpo.training.experience.Experience`.

generate -> score -> (dynamic sampling: more rounds) -> shape the rewards -> behaviour (old) and reference
logprobs -> KL in the reward -> group advantages -> rollout metrics. It sees models, a rollout worker, a reward set
and a :class:`Collectives` object, never a Trainer or a LightningModule.

Asynchronous rollouts (``GRPOConfig.max_staleness > 0``): :meth:`ExperienceMaker.prefetch` starts a rollout's
generation in the background (:class:`lightning_grpo.rollout.prefetch.RolloutPrefetcher`) and
:meth:`ExperienceMaker.make` given that :class:`~lightning_grpo.rollout.prefetch.PrefetchedRollout` waits for it and
does the rest (scoring, shaping, logprobs, advantages) on the trainer's thread, with the weights of the moment.
The slow rewards (:class:`~lightning_grpo.rewards.pool.PooledReward`: reward models, judges, sandboxed code) are
started in the reward pool as soon as a prefetched rollout is generated, on the generating thread, so they run while
the trainer trains; ``make`` collects them.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, ContextManager, Optional, Protocol

import torch
from torch import Tensor, nn

from lightning_grpo import functional as F
from lightning_grpo.algorithm import DynamicSampler, ScoredRollout
from lightning_grpo.algorithm.shaping import overlong_penalty, sequence_kl, transform_rewards
from lightning_grpo.config import GRPOConfig
from lightning_grpo.evaluation.evaluator import EvalBatch, answer_key
from lightning_grpo.events import ON_EXPERIENCE, ON_ROLLOUT_END, EventSink, ExperienceReady, RolloutEnd
from lightning_grpo.rewards import RewardSet, StartedScores
from lightning_grpo.rollout.base import RolloutInterrupted, RolloutOutput, SamplingConfig
from lightning_grpo.rollout.prefetch import PrefetchedRollout, RolloutPrefetcher
from lightning_grpo.rollout.worker import RolloutWorker
from lightning_grpo.training.experience import Experience
from lightning_grpo.training.logprobs import CompletionLogprobs
from lightning_grpo.training.metrics import REWARD_TIMING_PREFIX, StepTimer, rollout_metrics

log = logging.getLogger(__name__)

PromptBatch = dict[str, list]


class Collectives(Protocol):
    """The data-parallel reductions the experience maker needs (every process must call them together)."""

    def reduce_sum(self, tensor: Tensor) -> Tensor: ...

    def any_process(self, flag: bool, device: torch.device) -> bool: ...


class ExperienceMaker:
    """Makes experience from prompt batches (see :meth:`make`).

    Args:
        config: the algorithm settings.
        rollout: the rollout worker (engine, prompt encoding, weight sync).
        rewards: the reward functions.
        logprobs: the completion-logprob computer (old and reference passes).
        events: called as ``events(name, payload)`` with ``on_rollout_end`` (:class:`~lightning_grpo.events.RolloutEnd`)
            and ``on_experience`` (:class:`~lightning_grpo.events.ExperienceReady`), see :mod:`lightning_grpo.events`.

    Attributes:
        prefetcher: the background generation of asynchronous rollouts (its thread starts with the first
            :meth:`prefetch`).
        rank: this process's global rank (the module sets it): per-request seeds of rank r are offset by r * 2**32,
            so processes seeded alike never sample with the same seeds.
    """

    def __init__(self, config: GRPOConfig, rollout: RolloutWorker, rewards: RewardSet,
                 logprobs: CompletionLogprobs, events: Optional[EventSink] = None) -> None:
        self.config = config
        self.rollout = rollout
        self.rewards = rewards
        self.logprobs = logprobs
        self.events = events
        self._texts: list[tuple] = []  # (prompt, completion, columns) of every row generated for this rollout
        self._outcomes: dict[str, list[float]] = {}  # "<reward>/<outcome>" -> [completions, of all completions]
        self.prefetcher = RolloutPrefetcher(rollout, on_generated=self._start_rewards)
        self.rank = 0

    def prefetch(self, batch: PromptBatch, policy: nn.Module, collectives: Collectives, timer: StepTimer,
                 device: torch.device) -> PrefetchedRollout:
        """Asynchronous rollouts: start generating ``batch``'s G completions per prompt in the background, from
        ``policy``'s current weights (:meth:`lightning_grpo.rollout.prefetch.RolloutPrefetcher.start`: waits for the
        engine to be idle, syncs, draws the seed base, starts). Pass the result to :meth:`make`.

        Raises:
            KeyError: ``batch`` has no "prompt" column.
            NonFiniteError: the policy has NaN or infinite weights.
        """
        if "prompt" not in batch:
            raise KeyError(f"prompt batches need a 'prompt' column, got columns {sorted(batch)}")
        return self.prefetcher.start(batch, policy, self.config.num_generations, self._sampling, timer,
                                     lambda flag: collectives.any_process(flag, device))

    def wait_for_rollouts(self) -> None:
        """Wait until no rollout is being generated in the background (before a checkpoint or a weight sync)."""
        self.prefetcher.wait_idle()

    def close(self) -> None:
        """Stop background generations and end their thread and the reward pool's (end of fit)."""
        self.prefetcher.close()
        self.rewards.close()

    def _start_rewards(self, prefetched: PrefetchedRollout, out: RolloutOutput) -> Optional[StartedScores]:
        """On the generating thread, when a prefetched rollout is generated: start its slow rewards in the pool."""
        if not self.rewards.has_pooled:
            return None
        prompts, columns = _expand(prefetched.batch, prefetched.num_generations)
        return self.rewards.start(prompts, out.completions, columns, prefetched.num_generations)

    @torch.no_grad()
    def make(  # noqa: C901 - the numbered steps of one rollout, read top to bottom
        self,
        batch: PromptBatch,
        policy: nn.Module,
        ref: Optional[nn.Module],
        collectives: Collectives,
        timer: StepTimer,
        device: torch.device,
        micro_batch_size: int,
        next_prompt_batch: Optional[Callable[[], Optional[PromptBatch]]] = None,
        forward_context: Callable[[], ContextManager] = contextlib.nullcontext,
        prefetched: Optional[PrefetchedRollout] = None,
    ) -> Experience:
        """One rollout batch: generate G completions per prompt, score them, shape the rewards, compute advantages
        and (when needed) the old and reference logprobs. Runs on this process's prompts only.

        With ``prefetched`` (asynchronous rollouts, from :meth:`prefetch` of the same ``batch``) the completions are
        that rollout's, generated from older weights (waited for if still running); the rest uses ``policy`` as it
        is now, which is the proximal policy of the decoupled objective (docs/algorithm.md, "Asynchronous
        rollouts"). ``rollout/staleness_{mean,max}``: optimizer steps between the weights that generated the rollout
        and ``policy``'s (0 for a synchronous rollout with ``vllm_sync_every=1``).

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
            collectives: the data-parallel reductions (a backend).
            timer: the step timer (``rollout_s``, ``scoring_s``, ``logprobs_s``, ``sync_s``, ``generated_tokens``;
                with ``prefetched``, ``rollout_s`` is the wait for it).
            device: where the experience's tensors go.
            micro_batch_size: sequences per no-grad logprob pass.
            next_prompt_batch: returns the next prompt batch, or None when the data is used up (dynamic sampling).
            forward_context: the trainer's precision context for the logprob passes.
            prefetched: the rollout :meth:`prefetch` started for ``batch`` (None: generate it now).

        Raises:
            KeyError: a prompt batch has no "prompt" column.
            ValueError, RuntimeError: a reward function misbehaves or raises (see
                :func:`lightning_grpo.rewards.scoring.score_completions`).
            RolloutInterrupted: the rollout worker's stop flag was set (e.g. SIGTERM) on any process: during
                generation (the engine stops within a token), scoring (after the reward function in progress) or
                the logprob passes; the partial rollout is discarded, on every process together.
            NonFiniteError: the policy has NaN or infinite weights (checked before sampling).
        """
        if "prompt" not in batch:
            raise KeyError(f"prompt batches need a 'prompt' column, got columns {sorted(batch)}")
        cfg = self.config
        sampler = DynamicSampler(len(batch["prompt"]), self.rewards.primary_index, cfg.dynamic_sampling)
        self._texts, self._outcomes = [], {}
        totals = {"prompts/truncated": 0.0, "generated_tokens": 0.0}
        rollout_s_before = timer.get("rollout_s")

        def any_process(flag: bool) -> bool:
            return collectives.any_process(flag, device)

        if prefetched is not None:  # asynchronous: generated in the background (no dynamic sampling there)
            with timer.span("rollout_s"):
                try:
                    out: Optional[RolloutOutput] = prefetched.result()
                except RolloutInterrupted:
                    out = None
            pad = int(self.rollout.require_engine().pad_token_id)
            sampler.add(self._score(batch, out, prefetched.num_truncated, pad, totals, timer, any_process,
                                    prefetched.started_rewards))
            version = prefetched.weights_version
        else:
            with self.rollout.awake(policy, timer=timer, any_process=any_process):
                version = self.rollout.engine_version
                while True:
                    sampler.add(self._generate_and_score(batch, totals, timer, any_process))
                    if not cfg.dynamic_sampling or sampler.gen_batches >= cfg.max_num_gen_batches:
                        break
                    if not collectives.any_process(sampler.need_more, device):
                        break
                    next_batch = next_prompt_batch() if next_prompt_batch is not None else None
                    if collectives.any_process(next_batch is None, device):
                        break
                    assert next_batch is not None
                    batch = next_batch
        rollout, sampling_stats = sampler.batch()
        scored_rollout = self._rollout_end(rollout, version)
        if self.events is not None:
            self.events(ON_ROLLOUT_END, scored_rollout)

        engine_mask = rollout.completion_mask.to(device)  # [N, T] through the first EOS
        shaped = rollout.rewards.to(device)  # [N] weighted sum, NaN = unscored
        scored = ~torch.isnan(shaped)  # [N]
        extra: dict[str, tuple[Tensor, Tensor]] = {}  # metric -> (sum, count)
        if cfg.overlong_buffer > 0:
            penalty = overlong_penalty(engine_mask.sum(dim=1), cfg.max_new_tokens, cfg.overlong_buffer,
                                       cfg.overlong_penalty_factor)
            shaped = shaped + penalty
            extra["rewards/overlong_penalty/mean"] = (penalty.sum(), torch.tensor(float(len(penalty))))
        shaped = transform_rewards(shaped, cfg.reward_scale, cfg.reward_bias, cfg.reward_clip)
        experience = Experience(
            prompt_ids=rollout.prompt_ids.to(device),
            prompt_mask=rollout.prompt_mask.to(device),
            completion_ids=rollout.completion_ids.to(device),
            completion_mask=engine_mask * scored.unsqueeze(1),
            advantages=torch.zeros(len(rollout), device=device),
            sampler_logprobs=None if rollout.sampler_logprobs is None else rollout.sampler_logprobs.to(device),
        )
        with timer.span("logprobs_s"):
            shaped = self._behaviour_logprobs(experience, shaped, scored, extra, policy, ref, micro_batch_size,
                                              forward_context)
        if cfg.mask_truncated_completions:
            experience.completion_mask = experience.completion_mask * (~rollout.truncated.to(device)).unsqueeze(1)
        experience.advantages = F.group_advantages(
            shaped, cfg.num_generations, cfg.scale_rewards, cfg.advantage_eps, estimator=cfg.advantage_estimator,
            std_floor=cfg.advantage_std_floor, valid=scored, batch_std=self._batch_std(shaped, scored, collectives),
        )
        extra["reward_shaped"] = (shaped[scored].sum(), scored.sum().float())
        for key, (count, total) in self._outcomes.items():  # every process has the same keys (declared outcomes)
            extra[f"rewards/{key}"] = (torch.tensor(count), torch.tensor(total))
        experience.metrics = rollout_metrics(
            rollout, self.rewards.names, extra, totals, sampling_stats if cfg.dynamic_sampling else None,
            lambda tensor: collectives.reduce_sum(tensor.to(device)),
        )
        generation_s = timer.get("rollout_s") - rollout_s_before  # this rollout's generation time, all rounds
        if prefetched is not None:  # the engine's own time, not the wait for it
            generation_s = prefetched.generate_s
        experience.metrics["tokens_per_s"] = totals["generated_tokens"] / max(generation_s, 1e-9)
        staleness = float(self.rollout.weights_version - version)
        experience.metrics["rollout/staleness_mean"] = experience.metrics["rollout/staleness_max"] = staleness
        if any_process(self.rollout.stop.is_set()):  # stopped during the logprob passes: still discarded
            raise RolloutInterrupted("the rollout was stopped by a stop request (e.g. SIGTERM) before it finished")
        timer.add("generated_tokens", totals["generated_tokens"])
        timer.rollout_end()
        if self.events is not None:
            self.events(ON_EXPERIENCE, ExperienceReady(experience, scored_rollout, shaped))
        return experience

    def _rollout_end(self, rollout: ScoredRollout, weights_version: int) -> RolloutEnd:
        """The texts and scores of the rollout to be trained on (rows found by ``row_index``)."""
        rows = [self._texts[i] for i in rollout.row_index.tolist()] if rollout.row_index is not None else []
        names = sorted({k for _, _, columns in rows for k in columns})
        return RolloutEnd(
            prompts=[r[0] for r in rows], completions=[r[1] for r in rows], rewards=rollout.rewards,
            per_function=rollout.per_function, reward_names=list(self.rewards.names),
            lengths=rollout.completion_mask.sum(dim=1), truncated=rollout.truncated,
            columns={k: [r[2].get(k) for r in rows] for k in names}, num_generations=rollout.num_generations,
            weights_version=weights_version,
        )

    def _generate_and_score(self, batch: PromptBatch, totals: dict[str, float], timer: StepTimer,
                            any_process: Callable[[bool], bool]) -> ScoredRollout:
        """Generate G completions for each prompt of ``batch`` and score them (one generation round). A stopped
        round raises :class:`RolloutInterrupted` on every process together (``any_process``, so that no process
        is left waiting in a collective)."""
        if "prompt" not in batch:
            raise KeyError(f"prompt batches need a 'prompt' column, got columns {sorted(batch)}")
        engine = self.rollout.require_engine()
        with timer.span("rollout_s"):
            prompt_ids, num_truncated = self.rollout.tokenize(batch["prompt"])
            sampling = self._sampling()
            try:
                out: Optional[RolloutOutput] = engine.generate(prompt_ids, self.config.num_generations, sampling)
            except RolloutInterrupted:
                out = None
        return self._score(batch, out, num_truncated, int(engine.pad_token_id), totals, timer, any_process)

    def _sampling(self) -> SamplingConfig:
        """The rollouts' sampling settings, with a per-request seed base (:meth:`_request_seed`)."""
        cfg = self.config
        return SamplingConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p,
                              top_k=cfg.top_k, min_p=cfg.min_p, seed=self._request_seed())

    def _score(self, batch: PromptBatch, out: Optional[RolloutOutput], num_truncated: int, pad_token_id: int,
               totals: dict[str, float], timer: StepTimer, any_process: Callable[[bool], bool],
               started: Optional[StartedScores] = None) -> ScoredRollout:
        """Score one generation round's completions (``out`` None: it was interrupted, which every process then
        raises as :class:`RolloutInterrupted`); ``started``: its slow rewards, started when it was generated.
        Adds ``reward_<name>_s`` to ``timer`` and the pooled rewards' outcome counts to this rollout's."""
        g = self.config.num_generations
        prompts, columns = _expand(batch, g)
        if out is not None and not self.rollout.stop.is_set():
            with timer.span("scoring_s"):
                scores = self.rewards.score(prompts, out.completions, columns, group_size=g, started=started)
            for name, seconds in scores.seconds.items():
                timer.add(f"{REWARD_TIMING_PREFIX}{name}_s", seconds)
            for key, count in scores.outcomes.items():
                tally = self._outcomes.setdefault(key, [0.0, 0.0])
                tally[0] += count
                tally[1] += len(out.completions)
        if any_process(out is None or self.rollout.stop.is_set()):
            raise RolloutInterrupted("the rollout was stopped by a stop request (e.g. SIGTERM) before it finished")
        assert out is not None
        unscored = torch.isnan(scores.rewards).nonzero().flatten().tolist()
        if unscored:
            log.warning("every reward function returned None for completions %s: they get no loss", unscored)
        totals["prompts/truncated"] += num_truncated
        totals["generated_tokens"] += float(out.completion_mask.sum())
        offset = len(self._texts)
        self._texts.extend((p, c, {k: v[i] for k, v in columns.items()})
                           for i, (p, c) in enumerate(zip(prompts, out.completions, strict=True)))
        return ScoredRollout(
            prompt_ids=out.prompt_ids,
            prompt_mask=out.prompt_mask,
            completion_ids=out.completion_ids,
            completion_mask=out.completion_mask,
            truncated=out.truncated,
            per_function=scores.per_function,
            rewards=scores.rewards,
            num_generations=g,
            pad_token_id=pad_token_id,
            sampler_logprobs=out.sampler_logprobs,
            row_index=torch.arange(offset, len(self._texts)),
        )

    @torch.no_grad()
    def evaluate(self, batch: PromptBatch, policy: nn.Module, collectives: Collectives, device: torch.device,
                 accuracy: Optional[Callable[..., list]] = None) -> EvalBatch:
        """Greedy completions of a validation batch and, with ``eval_num_samples`` = n, n sampled ones per prompt
        (temperature ``eval_temperature``, torch's generator forked and seeded with ``shuffle_seed``, so every
        evaluation draws alike and training's random stream is untouched), scored by ``accuracy`` (default: the
        reward set's accuracy function). The engine gets the current weights first. Tensors on ``device``."""
        cfg, accuracy = self.config, accuracy or self.rewards.accuracy
        columns = {k: v for k, v in batch.items() if k != "prompt"}

        def score(prompts: list, completions: list[str], repeat: int) -> Tensor:
            cols = {k: [x for x in v for _ in range(repeat)] for k, v in columns.items()}
            values = accuracy(prompts, completions, **cols)
            return torch.tensor([float("nan") if s is None else float(s) for s in values], device=device)

        max_new = cfg.eval_max_new_tokens or cfg.max_new_tokens
        self.prefetcher.wait_idle()  # asynchronous rollouts: no sync while the engine generates
        with self.rollout.awake(policy, force_sync=True,
                                any_process=lambda flag: collectives.any_process(flag, device)):
            out = self.rollout.generate(batch["prompt"], 1, SamplingConfig(max_new_tokens=max_new, greedy=True))
            result = EvalBatch(score(batch["prompt"], out.completions, 1), out.completion_mask.sum(dim=1).to(device))
            n = cfg.eval_num_samples
            if n:
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(cfg.shuffle_seed)
                    sampling = SamplingConfig(max_new_tokens=max_new, temperature=cfg.eval_temperature)
                    sampled = self.rollout.generate(batch["prompt"], n, sampling)
                prompts = [p for p in batch["prompt"] for _ in range(n)]
                result.samples = score(prompts, sampled.completions, n).view(-1, n)
                keys = [answer_key(c) for c in sampled.completions]
                result.answers = [keys[i:i + n] for i in range(0, len(keys), n)]
        return result

    def _request_seed(self) -> Optional[int]:
        """A base for per-request seeds (vLLM, colocated or served), drawn from torch's global generator (restored on
        resume), offset by ``rank * 2**32`` (disjoint per process); None for the HF engine, which samples from that
        generator itself."""
        if self.config.rollout_engine == "hf":
            return None
        return int(torch.randint(0, 2**31 - 1, (1,)).item()) + self.rank * 2**32

    def _behaviour_logprobs(
        self,
        experience: Experience,
        shaped: Tensor,
        scored: Tensor,
        extra: dict[str, tuple[Tensor, Tensor]],
        policy: nn.Module,
        ref: Optional[nn.Module],
        micro_batch_size: int,
        forward_context: Callable[[], ContextManager],
    ) -> Tensor:
        """Old logprobs (needed when the rollout is reused or the KL goes in the reward) and reference logprobs
        (beta > 0) into ``experience``; with ``kl_in_reward`` the shaped rewards minus beta * sequence KL."""
        cfg = self.config
        n = len(experience)
        reused_later = cfg.num_iterations > 1 or (cfg.mini_batch_size or n) < n
        if reused_later or cfg.kl_in_reward:
            experience.old_logprobs = self.logprobs.batched(policy, experience, micro_batch_size, forward_context)
        if ref is not None:
            experience.ref_logprobs = self.logprobs.batched(ref, experience, micro_batch_size, forward_context)
        if not cfg.kl_in_reward:
            return shaped
        assert experience.old_logprobs is not None and experience.ref_logprobs is not None
        kl = sequence_kl(experience.old_logprobs, experience.ref_logprobs, experience.completion_mask,
                         cfg.kl_estimator)
        extra["kl"] = (kl.sum(), experience.completion_mask.sum().float())
        extra["rewards/kl_penalty/mean"] = (-cfg.beta * kl[scored].sum(), scored.sum().float())
        experience.ref_logprobs = None  # the KL is in the reward, not in the loss
        if not reused_later:
            experience.old_logprobs = None
        return shaped - cfg.beta * kl

    def _batch_std(self, rewards: Tensor, valid: Tensor, collectives: Collectives) -> Optional[float]:
        """The unbiased std of the valid rewards over every process (``scale_rewards="batch"``), else None."""
        if self.config.scale_rewards != "batch":
            return None
        values = rewards[valid].double()
        moments = torch.stack([values.new_tensor(float(values.numel())), values.sum(), values.square().sum()])
        count, total, squares = collectives.reduce_sum(moments.to(rewards.device)).tolist()
        if count < 2:
            return 0.0
        return max(squares - total * total / count, 0.0) ** 0.5 / (count - 1) ** 0.5


def _expand(batch: PromptBatch, g: int) -> tuple[list, dict[str, list]]:
    """A prompt batch's prompts and other columns, each entry repeated G times (prompt-major, as the completions)."""
    prompts = [p for p in batch["prompt"] for _ in range(g)]
    columns = {k: [v for v in values for _ in range(g)] for k, values in batch.items() if k != "prompt"}
    return prompts, columns
