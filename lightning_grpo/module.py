"""GRPOModule: the LightningModule whose ``training_step`` is the GRPO loss on one experience micro-batch.

Rollouts (``make_experience``) are driven by :mod:`lightning_grpo.loop`; Lightning does backward, the optimizer
step, gradient clipping, accumulation, precision, logging and checkpointing.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import tempfile
import time
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import lightning as L
import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from lightning_grpo import functional as F
from lightning_grpo.algorithm import DynamicSampler, ObjectiveOutput, ScoredRollout, grpo_objective
from lightning_grpo.algorithm.shaping import overlong_penalty, sequence_kl, transform_rewards
from lightning_grpo.config import GRPOConfig
from lightning_grpo.experience import Experience, micro_batches
from lightning_grpo.loop import install_loop
from lightning_grpo.models import resolve_model_path
from lightning_grpo.packing import (
    merge_rows,
    pack_sequences,
    sequence_token_counts,
    shared_prefix_rows,
    token_budget_partition,
)
from lightning_grpo.rewards import resolve_reward_function
from lightning_grpo.rewards.scoring import reward_function_names, score_completions
from lightning_grpo.rollout.base import RolloutEngine, RolloutOutput, SamplingConfig
from lightning_grpo.rollout.hf import HFRolloutEngine
from lightning_grpo.rollout.prompts import encode_prompts

log = logging.getLogger(__name__)

RewardSpec = Union[str, Callable[..., list]]
_TIMING_KEYS = ("rollout_s", "scoring_s", "logprobs_s", "sync_s", "forward_s", "backward_s", "optimizer_s")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class GRPOModule(L.LightningModule):
    """GRPO (DeepSeekMath, arXiv:2402.03300, sec. 4) for a causal LM, as a LightningModule.

    Args:
        model: an HF model id, a local folder, an ``nn.Module`` (a transformers causal LM), or None / "embedded"
            for the embedded SmolLM2-135M-Instruct (:func:`lightning_grpo.models.default_model_path`).
        tokenizer: a tokenizer, or its id/folder; None loads it from ``model`` (required when ``model`` is a module).
        reward_funcs: reward functions ``fn(prompts, completions, **columns) -> list[float | None]``, or names
            registered in :data:`lightning_grpo.rewards.REWARD_FUNCTIONS`, or "module:function" import paths.
        reward_weights: one weight per reward function (default 1 each); the reward is the weighted sum.
        accuracy_reward: the reward function used for validation accuracy (``val/accuracy``); default: the first.
        config: the algorithm settings.
        learning_rate: AdamW peak learning rate.
        weight_decay: AdamW weight decay.
        adam_betas: AdamW betas.
        warmup_steps: linear warmup from 0 over this many optimizer steps, then constant.
        dtype: dtype the model weights are loaded in ("float32", "bfloat16", "float16").
        gradient_checkpointing: recompute activations in backward to save memory.
        export_dir: where the trained policy is saved with ``save_pretrained`` at the end of fit; default
            ``<trainer.log_dir or default_root_dir>/hf_model``; "" disables the export.
        tolerant_reward_funcs: names (as in ``rewards/<name>/mean``) of reward functions whose exceptions become
            missing rewards (logged as a warning) instead of stopping the run; any other reward function that
            raises stops the run with its name and the index of the failing sample.

    Raises:
        ValueError: a bad argument (named in the message).
    """

    def __init__(
        self,
        model: Union[str, nn.Module, None] = None,
        tokenizer: Union[str, PreTrainedTokenizerBase, None] = None,
        reward_funcs: Sequence[RewardSpec] = ("gsm8k_accuracy", "gsm8k_format"),
        reward_weights: Optional[Sequence[float]] = None,
        accuracy_reward: Optional[RewardSpec] = None,
        config: Union[GRPOConfig, dict, None] = None,
        learning_rate: float = 1e-6,
        weight_decay: float = 0.0,
        adam_betas: tuple[float, float] = (0.9, 0.99),
        warmup_steps: int = 0,
        dtype: str = "float32",
        gradient_checkpointing: bool = False,
        export_dir: Optional[str] = None,
        tolerant_reward_funcs: Sequence[str] = (),
    ) -> None:
        super().__init__()
        if isinstance(config, dict):
            config = GRPOConfig(**config)
        self.config = config if config is not None else GRPOConfig()
        # hyperparameters are stored as plain data so checkpoints load with torch.load(weights_only=True)
        self.save_hyperparameters(ignore=["model", "tokenizer", "reward_funcs", "accuracy_reward", "config"])
        self.hparams["config"] = dataclasses.asdict(self.config)
        self.hparams["model"] = model if isinstance(model, str) or model is None else type(model).__name__
        if learning_rate <= 0:
            raise ValueError(f"learning_rate={learning_rate} must be > 0")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps} must be >= 0")
        if dtype not in _DTYPES:
            raise ValueError(f"dtype={dtype!r}: choose one of {sorted(_DTYPES)}")
        if not reward_funcs:
            raise ValueError("reward_funcs is empty: GRPO needs at least one reward function")
        self.reward_funcs = [resolve_reward_function(f) for f in reward_funcs]
        self.reward_names = reward_function_names(self.reward_funcs)
        if reward_weights is not None and len(reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(reward_weights)} entries for {len(self.reward_funcs)} reward_funcs"
            )
        self.reward_weights = list(reward_weights) if reward_weights is not None else None
        unknown = sorted(set(tolerant_reward_funcs) - set(self.reward_names))
        if unknown:
            raise ValueError(f"tolerant_reward_funcs {unknown} are not reward functions; known: {self.reward_names}")
        self.tolerant_reward_funcs = list(tolerant_reward_funcs)
        primary = self.config.primary_reward
        if primary is not None and primary not in self.reward_names:
            raise ValueError(
                f"GRPOConfig.primary_reward={primary!r} is not a reward function; known: {self.reward_names}"
            )
        self.primary_reward_index = 0 if primary is None else self.reward_names.index(primary)
        self.accuracy_reward = (
            resolve_reward_function(accuracy_reward) if accuracy_reward is not None else self.reward_funcs[0]
        )

        if isinstance(model, nn.Module):
            if tokenizer is None:
                raise ValueError("tokenizer is required when model is an nn.Module")
            self.model_path: Optional[str] = getattr(getattr(model, "config", None), "_name_or_path", None) or None
            self.policy = model
        else:
            self.model_path = resolve_model_path(model)
            self.policy = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=_DTYPES[dtype])
            self.policy.train()  # from_pretrained returns eval mode; Lightning expects train mode at fit start
        if tokenizer is None or isinstance(tokenizer, str):
            tokenizer = AutoTokenizer.from_pretrained(tokenizer or self.model_path)
        self.tokenizer = tokenizer
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if gradient_checkpointing:
            self.policy.gradient_checkpointing_enable()
            self.policy.config.use_cache = False
        # The reference policy is kept out of the module tree: it is frozen, never checkpointed or optimized.
        self._ref: list[nn.Module] = []
        if self.config.beta > 0:
            ref = copy.deepcopy(self.policy).eval().requires_grad_(False)
            self._ref.append(ref)
        self.rollout_engine: Optional[RolloutEngine] = None
        self.val_accuracy = MeanMetric()
        self._step_sums: dict[str, Tensor] = {}
        self._step_maxima: dict[str, Tensor] = {}
        self._weights_version = 0
        self._engine_version = 0
        self._timing: dict[str, float] = {}
        self.resume_prompt_batches: Optional[int] = None  # prompt batches drawn in the epoch of a loaded checkpoint
        self._step_start_time: Optional[float] = None
        self._backward_start = 0.0
        self._backward_end: Optional[float] = None

    # ------------------------------------------------------------------ setup
    @property
    def ref_model(self) -> Optional[nn.Module]:
        """The frozen reference policy (beta > 0), else None."""
        return self._ref[0] if self._ref else None

    def setup(self, stage: str) -> None:
        if stage == "fit":
            install_loop(self.trainer)
        if self.rollout_engine is None:
            self.rollout_engine = self._make_engine()

    def _make_engine(self) -> RolloutEngine:
        if self.config.rollout_engine == "vllm":
            from lightning_grpo.rollout.vllm import VLLMRolloutEngine

            cfg = self.config
            path = self.model_path
            if path is None or not os.path.isdir(path):
                # an nn.Module (or hub id) given: vLLM loads from a folder, the real weights follow by sync_weights
                path = tempfile.mkdtemp(prefix="lightning_grpo_vllm_")
                self.policy.config.save_pretrained(path)
                self.policy.save_pretrained(path)
                self.tokenizer.save_pretrained(path)
            dtype = next(self.policy.parameters()).dtype
            engine = VLLMRolloutEngine(
                path,
                gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                kv_cache_space_gib=cfg.vllm_kv_cache_space_gib,
                max_model_len=cfg.max_prompt_length + max(cfg.max_new_tokens, cfg.eval_max_new_tokens or 0),
                enable_sleep_mode=cfg.vllm_enable_sleep_mode,
                dtype=str(dtype).removeprefix("torch."),
            )
            self._engine_version = -1  # push the module's weights before the first rollout (e.g. after a resume)
            return engine
        return HFRolloutEngine(self.policy, self.tokenizer)

    def configure_model(self) -> None:
        """Hook of Lightning's model-parallel strategies: shards the policy (and the reference policy) when the
        strategy is FSDP2 (``ModelParallelStrategy``); a no-op otherwise. See :mod:`lightning_grpo.strategies`."""
        from lightning_grpo.strategies import configure_sharding

        configure_sharding(self)

    def on_fit_start(self) -> None:
        if self.ref_model is not None:
            self.ref_model.to(self.device)

    def micro_batches_per_rollout(self) -> Optional[int]:
        """``training_step`` calls per rollout: num_iterations * mini-batches * accumulate_grad_batches; None with
        ``max_tokens_per_microbatch`` (the token budget decides, rollout by rollout).

        Raises:
            ValueError: the datamodule does not say how many prompts a rollout batch has (``prompts_per_step``).
        """
        if self.config.max_tokens_per_microbatch is not None:
            self.steps_per_rollout()  # checks the datamodule
            return None
        return self.steps_per_rollout() * self.trainer.accumulate_grad_batches

    def steps_per_rollout(self) -> int:
        """Optimizer steps per rollout: num_iterations * (rollout batch / mini_batch_size).

        Raises:
            ValueError: the datamodule does not say how many prompts a rollout batch has (``prompts_per_step``).
        """
        prompts = getattr(getattr(self.trainer, "datamodule", None), "prompts_per_step", None)
        if prompts is None:
            raise ValueError(
                "GRPO needs the datamodule's prompts_per_step (prompts per rollout batch): pass a "
                "lightning_grpo.data.PromptDataModule or a LightningDataModule with that attribute"
            )
        n = prompts * self.config.num_generations
        mini = self.config.mini_batch_size or n
        return self.config.num_iterations * (n // mini)

    # --------------------------------------------------------------- rollout
    def tokenize_prompts(self, prompts: Sequence[Any]) -> tuple[list[list[int]], int]:
        """Chat-template (message lists) or tokenize (strings) prompts; left-truncate to max_prompt_length.

        Returns:
            ``(ids, num_truncated)``.
        """
        return encode_prompts(self.tokenizer, prompts, self.config.max_prompt_length)

    def _sync_engine(self, force: bool = False) -> None:
        """Push the trained weights into the rollout engine every ``vllm_sync_every`` optimizer steps (always when
        ``force`` and they differ). A no-op for the HF engine, which generates with the policy itself."""
        assert self.rollout_engine is not None
        behind = self._weights_version - self._engine_version
        if behind >= self.config.vllm_sync_every or (force and behind > 0) or self._engine_version < 0:
            self.rollout_engine.sync_weights(self.policy)
            self._engine_version = self._weights_version

    def _wake_engine(self) -> None:
        wake_up = getattr(self.rollout_engine, "wake_up", None)
        if callable(wake_up):
            wake_up()

    def _sleep_engine(self) -> None:
        """Free the rollout engine's accelerator memory before training (vLLM sleep mode with
        ``vllm_enable_sleep_mode``, GPU only; engines without ``sleep`` keep nothing between rollouts)."""
        sleep = getattr(self.rollout_engine, "sleep", None)
        if callable(sleep):
            sleep(1)

    def generate(self, prompts: Sequence[Any], num_generations: int, sampling: SamplingConfig) -> RolloutOutput:
        """Rollout with the current policy: prompts (message lists or strings) -> ``RolloutOutput``."""
        ids, _ = self.tokenize_prompts(prompts)
        assert self.rollout_engine is not None
        return self.rollout_engine.generate(ids, num_generations, sampling)

    @torch.no_grad()
    def make_experience(
        self, batch: dict[str, list], next_prompt_batch: Optional[Callable[[], Optional[dict[str, list]]]] = None
    ) -> Experience:
        """One rollout batch: generate G completions per prompt, score them, shape the rewards, compute advantages
        and (when needed) the old and reference logprobs. Called by the loop; runs on this process's prompts only.

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
            next_prompt_batch: returns the next prompt batch, or None when the data is used up (dynamic sampling).

        Raises:
            KeyError: a prompt batch has no "prompt" column.
            ValueError, RuntimeError: a reward function misbehaves or raises (see
                :func:`lightning_grpo.rewards.scoring.score_completions`).
        """
        if "prompt" not in batch:
            raise KeyError(f"prompt batches need a 'prompt' column, got columns {sorted(batch)}")
        cfg = self.config
        g = cfg.num_generations
        sync_start = time.perf_counter()
        self._wake_engine()
        self._sync_engine()
        self._add_timing("sync_s", time.perf_counter() - sync_start)
        sampler = DynamicSampler(len(batch["prompt"]), self.primary_reward_index, cfg.dynamic_sampling)
        totals = {"timing/rollout_s": 0.0, "timing/scoring_s": 0.0, "prompts/truncated": 0.0, "generated_tokens": 0.0}
        while True:
            sampler.add(self._generate_and_score(batch, totals))
            if not cfg.dynamic_sampling or sampler.gen_batches >= cfg.max_num_gen_batches:
                break
            if not self._any_process(sampler.need_more):
                break
            next_batch = next_prompt_batch() if next_prompt_batch is not None else None
            if self._any_process(next_batch is None):
                break
            assert next_batch is not None
            batch = next_batch
        self._sleep_engine()  # the engine's KV cache (and weights) leave the accelerator while training
        rollout, sampling_stats = sampler.batch()

        device = self.device
        engine_mask = rollout.completion_mask.to(device)  # [N, T] through the first EOS
        lengths = engine_mask.sum(dim=1)  # [N]
        task_rewards = rollout.rewards.to(device)  # [N] weighted sum, NaN = unscored
        scored = ~torch.isnan(task_rewards)
        shaped = task_rewards
        extra: dict[str, tuple[Tensor, Tensor]] = {}  # metric -> (sum, count)
        if cfg.overlong_buffer > 0:
            penalty = overlong_penalty(lengths, cfg.max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty_factor)
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
        logprob_start = time.perf_counter()
        n = len(experience)
        reused_later = cfg.num_iterations > 1 or (cfg.mini_batch_size or n) < n
        if reused_later or cfg.kl_in_reward:
            experience.old_logprobs = self._batched_logprobs(self.policy, experience)
        if self.ref_model is not None:
            experience.ref_logprobs = self._batched_logprobs(self.ref_model, experience)
        if cfg.kl_in_reward:
            assert experience.old_logprobs is not None and experience.ref_logprobs is not None
            kl = sequence_kl(
                experience.old_logprobs, experience.ref_logprobs, experience.completion_mask, cfg.kl_estimator
            )
            shaped = shaped - cfg.beta * kl
            extra["kl"] = (kl.sum(), experience.completion_mask.sum().float())
            extra["rewards/kl_penalty/mean"] = (-cfg.beta * kl[scored].sum(), scored.sum().float())
            experience.ref_logprobs = None  # the KL is in the reward, not in the loss
            if not reused_later:
                experience.old_logprobs = None
        logprob_s = time.perf_counter() - logprob_start
        if cfg.mask_truncated_completions:
            experience.completion_mask = experience.completion_mask * (~rollout.truncated.to(device)).unsqueeze(1)
        experience.advantages = F.group_advantages(
            shaped, g, cfg.scale_rewards, cfg.advantage_eps, estimator=cfg.advantage_estimator,
            std_floor=cfg.advantage_std_floor, valid=scored, batch_std=self._batch_std(shaped, scored),
        )
        extra["reward_shaped"] = (shaped[scored].sum(), scored.sum().float())
        experience.metrics = self._rollout_metrics(rollout, scored, extra, totals, sampling_stats)
        experience.metrics.update(
            {
                "tokens_per_s": totals["generated_tokens"] / max(totals["timing/rollout_s"], 1e-9),
            }
        )
        self._add_timing("rollout_s", totals["timing/rollout_s"])
        self._add_timing("scoring_s", totals["timing/scoring_s"])
        self._add_timing("logprobs_s", logprob_s)
        self._add_timing("generated_tokens", totals["generated_tokens"])
        self._rollout_end = time.perf_counter()
        return experience

    def _generate_and_score(self, batch: dict[str, list], totals: dict[str, float]) -> ScoredRollout:
        """Generate G completions for each prompt of ``batch`` and score them (one generation round)."""
        if "prompt" not in batch:
            raise KeyError(f"prompt batches need a 'prompt' column, got columns {sorted(batch)}")
        cfg = self.config
        g = cfg.num_generations
        start = time.perf_counter()
        prompt_ids, num_truncated = self.tokenize_prompts(batch["prompt"])
        assert self.rollout_engine is not None
        out = self.rollout_engine.generate(
            prompt_ids,
            g,
            SamplingConfig(
                max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                min_p=cfg.min_p,
            ),
        )
        score_start = time.perf_counter()
        prompts = [p for p in batch["prompt"] for _ in range(g)]
        columns = {k: [v for v in values for _ in range(g)] for k, values in batch.items() if k != "prompt"}
        scores = score_completions(
            self.reward_funcs, prompts, out.completions, columns, self.reward_weights,
            tolerant=self.tolerant_reward_funcs,
        )
        unscored = torch.isnan(scores.rewards).nonzero().flatten().tolist()
        if unscored:
            log.warning("every reward function returned None for completions %s: they get no loss", unscored)
        totals["timing/rollout_s"] += score_start - start
        totals["timing/scoring_s"] += time.perf_counter() - score_start
        totals["prompts/truncated"] += num_truncated
        totals["generated_tokens"] += float(out.completion_mask.sum())
        pad = getattr(self.rollout_engine, "pad_token_id", None)
        return ScoredRollout(
            prompt_ids=out.prompt_ids,
            prompt_mask=out.prompt_mask,
            completion_ids=out.completion_ids,
            completion_mask=out.completion_mask,
            truncated=out.truncated,
            per_function=scores.per_function,
            rewards=scores.rewards,
            num_generations=g,
            pad_token_id=int(pad if pad is not None else self.tokenizer.pad_token_id),
            sampler_logprobs=out.sampler_logprobs,
        )

    def _any_process(self, flag: bool) -> bool:
        """Whether ``flag`` is True on any data-parallel process (a collective: every process must call it)."""
        return bool(self._all_reduce_sum(torch.tensor([float(flag)], device=self.device)).item() > 0)

    def _batch_std(self, rewards: Tensor, valid: Tensor) -> Optional[float]:
        """The unbiased std of the valid rewards over every process (``scale_rewards="batch"``), else None."""
        if self.config.scale_rewards != "batch":
            return None
        values = rewards[valid].double()
        moments = torch.stack([values.new_tensor(float(values.numel())), values.sum(), values.square().sum()])
        count, total, squares = self._all_reduce_sum(moments.to(self.device)).tolist()
        if count < 2:
            return 0.0
        return max(squares - total * total / count, 0.0) ** 0.5 / (count - 1) ** 0.5

    def _rollout_metrics(
        self,
        rollout: ScoredRollout,
        scored: Tensor,
        extra: dict[str, tuple[Tensor, Tensor]],
        totals: dict[str, float],
        sampling_stats: dict[str, float],
    ) -> dict[str, float]:
        """Rollout metrics, averaged over every process (``extra`` maps a metric to its (sum, count))."""
        g = self.config.num_generations
        lengths = rollout.completion_mask.sum(dim=1).float().cpu()
        rewards = rollout.rewards.cpu()
        valid = scored.cpu().view(-1, g)  # [P, G]
        grouped = torch.where(valid, rewards.view(-1, g), 0.0)
        count = valid.sum(dim=1)
        mean = grouped.sum(dim=1, keepdim=True) / count.clamp(min=1).unsqueeze(1)
        group_std = (torch.where(valid, grouped - mean, 0.0).square().sum(dim=1) / (count - 1).clamp(min=1)).sqrt()
        sums: dict[str, Tensor] = {
            "reward": grouped.sum(),
            "reward_std": group_std.sum(),  # mean of per-group stds, as TRL
            "frac_reward_zero_std": (group_std == 0).float().sum(),
            "frac_reward_unscored": (~valid).float().sum(),
            "completions/mean_length": lengths.sum(),
            "completions/clipped_ratio": rollout.truncated.float().cpu().sum(),
        }
        counts = {"reward": valid.sum(), "reward_std": len(group_std), "frac_reward_zero_std": len(group_std),
                  "frac_reward_unscored": lengths.numel(), "completions/mean_length": lengths.numel(),
                  "completions/clipped_ratio": lengths.numel()}
        for name, column in zip(self.reward_names, rollout.per_function.T):
            present = ~torch.isnan(column)
            sums[f"rewards/{name}/mean"] = torch.where(present, column, torch.zeros_like(column)).sum()
            counts[f"rewards/{name}/mean"] = present.sum()
        for key, (total, number) in extra.items():
            sums[key], counts[key] = total, number
        # summed over processes, reported as totals (count 1 per process, so "mean" keys are per-process means)
        summed = {"prompts/truncated": totals["prompts/truncated"]}
        if self.config.dynamic_sampling:
            summed.update({f"dynamic_sampling/{k}": v for k, v in sampling_stats.items() if k != "gen_batches"})
            sums["dynamic_sampling/gen_batches"] = torch.tensor(sampling_stats["gen_batches"])
            counts["dynamic_sampling/gen_batches"] = 1
        for key, value in summed.items():
            sums[key], counts[key] = torch.tensor(float(value)), 0
        keys = sorted(sums)
        values = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64).cpu() for k in keys])
        numbers = torch.tensor([float(counts[k]) for k in keys], dtype=torch.float64)
        reduced = self._all_reduce_sum(torch.cat([values, numbers]).to(self.device)).cpu()
        metrics = {}
        for i, key in enumerate(keys):
            total, number = float(reduced[i]), float(reduced[len(keys) + i])
            metrics[key] = total if key in summed else total / max(number, 1.0)
        metrics["completions/max_length"] = float(lengths.max())
        metrics["completions/min_length"] = float(lengths.min())
        return metrics

    def _all_reduce_sum(self, tensor: Tensor) -> Tensor:
        if self.trainer.world_size <= 1:
            return tensor
        return self.trainer.strategy.reduce(tensor, reduce_op="sum")

    def micro_batches(self, experience: Experience) -> Iterator[Experience]:
        """The loop's view of one rollout: shuffled mini-batches cut into micro-batches (see
        :func:`lightning_grpo.experience.micro_batches`)."""
        generator = torch.Generator().manual_seed(self.config.shuffle_seed + self.global_step)
        return micro_batches(
            experience,
            mini_batch_size=self.config.mini_batch_size or len(experience),
            accumulate_grad_batches=self.trainer.accumulate_grad_batches,
            num_iterations=self.config.num_iterations,
            loss_type=self.config.loss_type,
            max_new_tokens=self.config.max_new_tokens,
            # processes that hold different data (tensor-parallel ranks share theirs: MegatronStrategy)
            world_size=getattr(self.trainer.strategy, "data_parallel_size", self.trainer.world_size),
            generator=generator,
            all_reduce_sum=self._all_reduce_sum,
            max_tokens_per_microbatch=self.config.max_tokens_per_microbatch,
        )

    def _batched_logprobs(self, model: nn.Module, experience: Experience) -> Tensor:
        """Logprobs of the completions under ``model`` (no grad), in micro-batch-sized chunks (by token budget with
        ``max_tokens_per_microbatch``)."""
        budget = self.config.max_tokens_per_microbatch
        if budget is not None:
            counts = sequence_token_counts(experience.prompt_mask, experience.completion_mask).tolist()
            parts = [torch.tensor(p, dtype=torch.long) for p in token_budget_partition(counts, budget)]
        else:
            size = max(1, (self.config.mini_batch_size or len(experience)) // self.trainer.accumulate_grad_batches)
            parts = list(torch.arange(len(experience)).split(size))
        result = torch.zeros(experience.completion_ids.shape, device=experience.completion_ids.device)
        was_training = model.training
        model.eval()
        try:
            with self.trainer.precision_plugin.forward_context():
                for index in parts:
                    part = experience.select(index)
                    logprobs, _ = self.completion_logprobs(model, part)
                    result[index.to(result.device), : logprobs.shape[1]] = logprobs.float()
        finally:
            model.train(was_training)
        return result

    def completion_logprobs(
        self, model: nn.Module, batch: Experience, with_entropy: bool = False, entropy_grad: bool = False
    ) -> tuple[Tensor, Optional[Tensor]]:
        """Per-token logprobs ``(B, T)`` float32 of ``batch.completion_ids`` under ``model`` at the sampling
        temperature, and optionally the per-token entropy (with grad when ``entropy_grad``, for the entropy bonus).
        Only the completion positions' logits are computed.
        A ``model`` with its own ``completion_logprobs(batch, temperature, with_entropy)`` computes them itself
        (the Megatron policy does, vocab-parallel: :class:`lightning_grpo.megatron.policy.MegatronPolicy`).

        Raises:
            ValueError: ``entropy_grad`` or top-k / top-p / min-p truncation with a model that computes its own
                logprobs (no entropy gradient and no truncation there).
        """
        if callable(getattr(model, "completion_logprobs", None)):
            if entropy_grad:
                raise ValueError(
                    f"GRPOConfig.entropy_coef={self.config.entropy_coef} needs the entropy's gradient, which "
                    f"{type(model).__name__}.completion_logprobs does not provide: set entropy_coef=0"
                )
            cfg = self.config
            if cfg.top_k > 0 or cfg.top_p < 1 or cfg.min_p > 0:  # its vocab-parallel logprobs do not truncate
                raise ValueError(f"GRPOConfig top_k={cfg.top_k}, top_p={cfg.top_p}, min_p={cfg.min_p}: "
                                 f"{type(model).__name__} scores the untruncated distribution: "
                                 "set top_k=0, top_p=1.0, min_p=0")
            return model.completion_logprobs(batch, self.config.temperature, with_entropy=with_entropy)
        if self.config.padding_free:
            return self._packed_logprobs(model, batch, with_entropy, entropy_grad)
        return self._padded_logprobs(model, batch, with_entropy, entropy_grad)

    def _padded_logprobs(
        self, model: nn.Module, batch: Experience, with_entropy: bool, entropy_grad: bool
    ) -> tuple[Tensor, Optional[Tensor]]:
        """The padded path of :meth:`completion_logprobs`: ``(B, P + T)`` rows with an attention mask."""
        input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)  # [B, P+T]
        attention_mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)  # [B, P+T]
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # [B, P+T]
        t = batch.completion_ids.shape[1]
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    logits_to_keep=t + 1, use_cache=False)
        logits = out.logits[:, :-1]  # [B, T, V]: position j predicts completion token j
        return F.token_logprobs(
            logits, batch.completion_ids, self.config.temperature, with_entropy=with_entropy, entropy_grad=entropy_grad,
            top_k=self.config.top_k, top_p=self.config.top_p, min_p=self.config.min_p,
        )

    def _packed_logprobs(
        self, model: nn.Module, batch: Experience, with_entropy: bool, entropy_grad: bool
    ) -> tuple[Tensor, Optional[Tensor]]:
        """The padding-free path of :meth:`completion_logprobs`: the batch's real tokens packed into rows
        (:func:`lightning_grpo.packing.pack_sequences`, rows of ``packed_row_tokens``), one forward pass per row,
        logits only at the completion positions. Rows without loss tokens are not computed (their logprobs are 0)."""
        mask = batch.completion_mask
        shape = tuple(batch.completion_ids.shape)
        has_loss = mask.any(dim=1).nonzero().flatten()
        if has_loss.numel() == 0:
            # no loss token in the batch: the padded forward keeps the graph (and the collectives) as on other ranks
            return self._padded_logprobs(model, batch, with_entropy, entropy_grad)
        if self._shared_prefix(model):
            return self._shared_prefix_logprobs(model, batch, with_entropy, entropy_grad)
        counts = sequence_token_counts(batch.prompt_mask[has_loss], mask[has_loss]).tolist()
        passes = []
        for part in token_budget_partition(counts, self._row_tokens(model, counts)):
            rows = has_loss[torch.tensor(part, dtype=torch.long, device=has_loss.device)]
            packed = pack_sequences(batch.prompt_ids[rows], batch.prompt_mask[rows], batch.completion_ids[rows], mask[rows])
            inputs = dict(input_ids=packed.input_ids, position_ids=packed.position_ids, logits_to_keep=packed.logit_index)
            passes.append((inputs, packed.target_ids, (rows[packed.rows], packed.cols)))
        return self._forward_passes(model, passes, shape, with_entropy, entropy_grad)

    def _shared_prefix_logprobs(
        self, model: nn.Module, batch: Experience, with_entropy: bool, entropy_grad: bool
    ) -> tuple[Tensor, Optional[Tensor]]:
        """The padding-free path with ``shared_prefix``: each group of sequences sharing a prompt is one row, the
        prompt computed once (:func:`lightning_grpo.packing.shared_prefix_rows`, a custom 4-D attention mask); rows
        are merged into forward passes of ``packed_row_tokens`` (automatic: one pass per group, or one pass in all
        for an FSDP-sharded model, which all-gathers on every forward call)."""
        dtype = next(model.parameters()).dtype
        groups = shared_prefix_rows(batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
                                    dtype if dtype.is_floating_point else torch.float32)
        sizes = [g.input_ids.shape[1] for g in groups]
        passes = []
        for part in token_budget_partition(sizes, self._row_tokens(model, sizes)):
            row = merge_rows([groups[i] for i in part])
            inputs = dict(input_ids=row.input_ids, position_ids=row.position_ids, attention_mask=row.attention_mask,
                          logits_to_keep=row.logit_index)
            passes.append((inputs, row.target_ids, (row.rows, row.cols)))
        return self._forward_passes(model, passes, tuple(batch.completion_ids.shape), with_entropy, entropy_grad)

    def _row_tokens(self, model: nn.Module, sizes: list[int]) -> int:
        """Tokens per forward pass of the padding-free paths: ``packed_row_tokens``, or automatically all rows in
        one pass for varlen flash-attention kernels or an FSDP-sharded model (an all-gather per forward call), else
        one row per pass (sdpa/eager compute a combined row's attention densely)."""
        if self.config.packed_row_tokens is not None:
            return self.config.packed_row_tokens
        from lightning_grpo.strategies import is_sharded

        implementation = str(getattr(getattr(model, "config", None), "_attn_implementation", ""))
        return max(sum(sizes), 1) if "flash" in implementation or is_sharded(model) else 1

    def _forward_passes(
        self, model: nn.Module, passes: list, shape: tuple, with_entropy: bool, entropy_grad: bool
    ) -> tuple[Tensor, Optional[Tensor]]:
        """Run each ``(model inputs, target ids (1, K), (rows, cols) of the K targets)`` pass and scatter its
        per-token logprobs (and entropy) into zero ``shape`` tensors of the padded completion layout."""
        device = passes[0][1].device
        logprobs = torch.zeros(shape, device=device)
        entropy = torch.zeros(shape, device=device) if with_entropy else None
        for inputs, target_ids, index in passes:
            out = model(**inputs, use_cache=False)
            row_logprobs, row_entropy = F.token_logprobs(
                out.logits, target_ids, self.config.temperature, with_entropy=with_entropy, entropy_grad=entropy_grad,
                top_k=self.config.top_k, top_p=self.config.top_p, min_p=self.config.min_p,
            )
            logprobs = logprobs.index_put(index, row_logprobs.reshape(-1))
            if entropy is not None and row_entropy is not None:
                entropy = entropy.index_put(index, row_entropy.reshape(-1))
        return logprobs, entropy

    # -------------------------------------------------------------- training
    def training_step(self, batch: Experience, batch_idx: int) -> Tensor:
        """GRPO loss on one experience micro-batch (DeepSeekMath eq. 3 with the chosen variants; see
        :func:`lightning_grpo.algorithm.grpo_objective`).

        Returns the micro-batch's share of the step loss, scaled so that after Lightning's division by
        ``accumulate_grad_batches`` and data-parallel averaging the step's gradient is that of
        (summed loss / step normalizer).
        """
        forward_start = time.perf_counter()
        output = self.compute_loss(batch)
        self._add_timing("forward_s", time.perf_counter() - forward_start)
        self._add_timing("train_tokens", float(self.forward_token_count(batch)))
        self._accumulate(output)
        if batch.step_end:
            self._log_step(batch.metrics)
        return output.loss * batch.loss_scale

    def compute_loss(self, batch: Experience) -> ObjectiveOutput:
        """The policy's forward pass on ``batch`` and :func:`lightning_grpo.algorithm.grpo_objective` (the loss
        before ``batch.loss_scale``). Needs no Trainer.

        Raises:
            ValueError: ``batch`` is not ``on_policy`` but has no ``old_logprobs``; see also ``grpo_objective``.
        """
        cfg = self.config
        if not batch.on_policy and batch.old_logprobs is None:
            raise ValueError("an experience micro-batch after the rollout's first optimizer step needs old_logprobs")
        logprobs, entropy = self.completion_logprobs(
            self.policy, batch, with_entropy=True, entropy_grad=cfg.entropy_coef > 0
        )
        return grpo_objective(
            logprobs,
            batch.completion_mask,
            batch.advantages,
            cfg,
            old_logprobs=None if batch.on_policy else batch.old_logprobs,
            ref_logprobs=None if cfg.kl_in_reward else batch.ref_logprobs,
            sampler_logprobs=batch.sampler_logprobs,
            entropy=entropy,
            normalizer=batch.loss_normalizer,
        )

    def _accumulate(self, output: ObjectiveOutput) -> None:
        """Add a micro-batch's statistics to the step's sums (token-weighted) and maxima."""
        mask = output.mask

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
        if self.config.clip_ratio_c is not None:
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
        if self.config.importance_sampling_cap is not None:
            weights = output.importance_weights
            if weights is None:  # no sampler logprobs (HF engine): the weight is 1 exactly
                weights = torch.ones_like(clip.low, dtype=torch.float32)
            key = "sampling/importance_sampling_ratio"
            parts[f"{key}/mean"] = masked_sum(weights)
            maxima[f"{key}/max"] = masked_max(weights)
            maxima[f"{key}/min"] = masked_max(-weights)
        for key, value in parts.items():
            self._step_sums[key] = self._step_sums.get(key, torch.zeros((), device=value.device)) + value
        for key, value in maxima.items():
            previous = self._step_maxima.get(key)
            self._step_maxima[key] = value if previous is None else torch.maximum(previous, value)

    def _log_step(self, rollout_metrics: dict[str, float]) -> None:
        sums, self._step_sums = self._step_sums, {}
        maxima, self._step_maxima = self._step_maxima, {}
        keys = sorted(sums)
        reduced = self._all_reduce_sum(torch.stack([sums[k] for k in keys]))
        totals = dict(zip(keys, reduced.tolist()))
        tokens = max(totals.pop("tokens"), 1.0)
        metrics = {"loss": totals.pop("loss")}  # the step loss: sum over micro-batches and processes / normalizer
        metrics.update({k: v / tokens for k, v in totals.items()})
        if maxima:
            max_keys = sorted(maxima)
            stacked = torch.stack([maxima[k] for k in max_keys])
            if self.trainer.world_size > 1:
                stacked = self.trainer.strategy.reduce(stacked, reduce_op="max")
            for key, value in zip(max_keys, stacked.tolist()):
                if value != -float("inf"):  # a step without loss tokens has no extrema
                    metrics[key] = -value if key.endswith("/min") else value
        metrics.update(rollout_metrics)
        metrics["num_tokens"] = tokens
        shown = {k: metrics.pop(k) for k in ("loss", "reward") if k in metrics}
        self.log_dict(shown, prog_bar=True, on_step=True, on_epoch=False, batch_size=1)
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        from lightning_grpo.strategies import policy_grad_norm

        norm = policy_grad_norm(self)  # of the full gradient, also under FSDP1/FSDP2 (a collective there)
        if norm is not None:
            self.log("grad_norm", norm, on_step=True, on_epoch=False, batch_size=1)

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: Optional[Union[int, float]] = None, gradient_clip_algorithm: Optional[str] = None) -> None:
        """``Trainer(gradient_clip_val=...)``; by norm also under FSDP1/FSDP2 (the norm of the full gradient), see
        :func:`lightning_grpo.strategies.clip_gradients`."""
        from lightning_grpo.strategies import clip_gradients

        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        if self._backward_end is not None:  # clipping, grad-norm and the optimizer's step, after the last backward
            self._add_timing("optimizer_s", time.perf_counter() - self._backward_end)
        self._weights_version += 1

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        fetcher = getattr(getattr(self._trainer, "fit_loop", None), "_data_fetcher", None)
        drawn = getattr(fetcher, "prompt_batches_drawn", None)
        if drawn is not None:
            checkpoint["lightning_grpo_prompt_batches_drawn"] = int(drawn)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.resume_prompt_batches = checkpoint.get("lightning_grpo_prompt_batches_drawn")

    # ---------------------------------------------------------------- timing
    def _add_timing(self, key: str, value: float) -> None:
        self._timing[key] = self._timing.get(key, 0.0) + value

    def forward_token_count(self, batch: Experience) -> int:
        """Tokens the training forward pass of ``batch`` computes: with ``padding_free`` the real tokens of the rows
        with loss tokens (a prompt shared by a group once, with ``shared_prefix``), else the padded
        ``B * (P + T)``."""
        if not (self.config.padding_free and batch.completion_mask.any()):
            return int(batch.prompt_ids.numel() + batch.completion_ids.numel())
        has_loss = batch.completion_mask.any(dim=1)
        completion_tokens = int(batch.completion_mask.sum())
        if self._shared_prefix(self.policy):
            prompts = {tuple(ids[mask.bool()].tolist()) for ids, mask in zip(batch.prompt_ids[has_loss], batch.prompt_mask[has_loss])}
            return sum(len(p) for p in prompts) + completion_tokens
        return int(batch.prompt_mask[has_loss].sum()) + completion_tokens

    def _shared_prefix(self, model: nn.Module) -> bool:
        """Whether the padding-free forward of ``model`` uses shared-prefix rows (sdpa/eager attention)."""
        implementation = str(getattr(getattr(model, "config", None), "_attn_implementation", ""))
        return self.config.shared_prefix and implementation in ("sdpa", "eager")

    def on_train_start(self) -> None:
        self._step_start_time = time.perf_counter()
        self._timing = {}

    def on_before_backward(self, loss: Tensor) -> None:
        self._backward_start = time.perf_counter()

    def on_after_backward(self) -> None:
        self._backward_end = time.perf_counter()
        self._add_timing("backward_s", self._backward_end - self._backward_start)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """After an optimizer step, log where its wall time went (seconds): ``timing/rollout_s`` (generation),
        ``scoring_s`` (reward functions), ``logprobs_s`` (old/reference logprob passes), ``sync_s`` (weights into
        the rollout engine), ``forward_s`` (training forward + loss), ``backward_s``, ``optimizer_s`` (clipping,
        grad norm, optimizer step), ``step_s`` (the whole step, from the end of the previous one) and ``other_s``
        (the rest: Lightning, logging, callbacks such as checkpointing, validation run before the step), and
        ``train_s`` (from the end of the rollout, or of the previous step, to the end of this one). Also
        ``generated_tokens`` and ``train_tokens`` (tokens the training forward passes computed)."""
        if not isinstance(batch, Experience) or not batch.step_end:
            return
        now = time.perf_counter()
        timing, self._timing = self._timing, {}
        start, self._step_start_time = self._step_start_time, now
        self._backward_end = None
        metrics = {f"timing/{k}": timing.get(k, 0.0) for k in _TIMING_KEYS}
        if start is not None:
            metrics["timing/step_s"] = now - start
            metrics["timing/other_s"] = metrics["timing/step_s"] - sum(metrics[f"timing/{k}"] for k in _TIMING_KEYS)
        metrics["timing/train_s"] = now - getattr(self, "_rollout_end", now)
        self._rollout_end = now  # the next step of the same rollout counts from here
        metrics["generated_tokens"] = timing.get("generated_tokens", 0.0)
        metrics["train_tokens"] = timing.get("train_tokens", 0.0)
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    def configure_optimizers(self) -> Any:
        params = [p for p in self.policy.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            params, lr=self.hparams.learning_rate, weight_decay=self.hparams.weight_decay, betas=tuple(self.hparams.adam_betas)
        )
        warmup = self.hparams.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)) if warmup else 1.0)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ------------------------------------------------------------ validation
    def validation_step(self, batch: dict[str, list], batch_idx: int) -> None:
        """Greedy accuracy (``val/accuracy``, a torchmetrics MeanMetric over all processes)."""
        self._wake_engine()
        self._sync_engine(force=True)
        cfg = self.config
        sampling = SamplingConfig(max_new_tokens=cfg.eval_max_new_tokens or cfg.max_new_tokens, greedy=True)
        out = self.generate(batch["prompt"], 1, sampling)
        self._sleep_engine()
        columns = {k: v for k, v in batch.items() if k != "prompt"}
        scores = self.accuracy_reward(batch["prompt"], out.completions, **columns)
        values = torch.tensor([float("nan") if s is None else float(s) for s in scores], device=self.device)
        self.val_accuracy.update(values[~torch.isnan(values)])
        self.log("val/accuracy", self.val_accuracy, on_step=False, on_epoch=True, prog_bar=True, batch_size=len(scores))
        self.log("val/mean_length", out.completion_mask.sum(dim=1).float().mean(), on_epoch=True, batch_size=len(scores), sync_dist=True)

    # ---------------------------------------------------------------- export
    def on_fit_end(self) -> None:
        path = self.export_path()
        if not path:
            return
        from lightning_grpo.strategies import policy_state_dict_for_export

        state_dict = policy_state_dict_for_export(self)  # under FSDP a collective: every rank gathers
        if self.trainer.is_global_zero:
            os.makedirs(path, exist_ok=True)
            self.policy.save_pretrained(path, state_dict=state_dict)
            self.tokenizer.save_pretrained(path)
            log.info("saved the trained policy to %s", path)

    def export_path(self) -> Optional[str]:
        """The HF export folder (see ``export_dir``), or None when disabled."""
        export_dir = self.hparams.export_dir
        if export_dir == "":
            return None
        if export_dir is not None:
            return export_dir
        root = self.trainer.log_dir or self.trainer.default_root_dir
        return os.path.join(root, "hf_model")
