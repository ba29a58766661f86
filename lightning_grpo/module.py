"""GRPOModule: the LightningModule whose ``training_step`` is the GRPO loss on one experience micro-batch.

Rollouts (``make_experience``) are driven by :mod:`lightning_grpo.loop`; Lightning does backward, the optimizer
step, gradient clipping, accumulation, precision, logging and checkpointing.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import time
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import lightning as L
import torch
from torch import Tensor, nn
from torchmetrics import MeanMetric
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from lightning_grpo import functional as F
from lightning_grpo.config import GRPOConfig
from lightning_grpo.experience import Experience, micro_batches
from lightning_grpo.loop import install_loop
from lightning_grpo.models import resolve_model_path
from lightning_grpo.rewards import resolve_reward_function
from lightning_grpo.rewards.scoring import reward_function_names, score_completions
from lightning_grpo.rollout.base import RolloutEngine, RolloutOutput, SamplingConfig
from lightning_grpo.rollout.hf import HFRolloutEngine

log = logging.getLogger(__name__)

RewardSpec = Union[str, Callable[..., list]]
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
        self._weights_version = 0
        self._engine_version = 0

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

            return VLLMRolloutEngine.from_module(self.policy, self.tokenizer, self.model_path, self.config)
        return HFRolloutEngine(self.policy, self.tokenizer)

    def configure_model(self) -> None:
        """Hook of Lightning's model-parallel strategies: shards the policy (and the reference policy) when the
        strategy is FSDP2 (``ModelParallelStrategy``); a no-op otherwise. See :mod:`lightning_grpo.strategies`."""
        from lightning_grpo.strategies import configure_sharding

        configure_sharding(self)

    def on_fit_start(self) -> None:
        if self.ref_model is not None:
            self.ref_model.to(self.device)

    def micro_batches_per_rollout(self) -> int:
        """``training_step`` calls per rollout: num_iterations * mini-batches * accumulate_grad_batches.

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
        return self.config.num_iterations * (n // mini) * self.trainer.accumulate_grad_batches

    # --------------------------------------------------------------- rollout
    def tokenize_prompts(self, prompts: Sequence[Any]) -> tuple[list[list[int]], int]:
        """Chat-template (message lists) or tokenize (strings) prompts; left-truncate to max_prompt_length.

        Returns:
            ``(ids, num_truncated)``.
        """
        ids: list[list[int]] = []
        truncated = 0
        for prompt in prompts:
            if isinstance(prompt, str):
                tokens = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            else:
                tokens = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
                if isinstance(tokens, dict) or hasattr(tokens, "keys"):
                    tokens = tokens["input_ids"]
            tokens = list(tokens)
            if len(tokens) > self.config.max_prompt_length:
                tokens = tokens[-self.config.max_prompt_length :]
                truncated += 1
            ids.append(tokens)
        return ids, truncated

    def _sync_engine(self, force: bool = False) -> None:
        """Push the trained weights into the rollout engine every ``vllm_sync_every`` optimizer steps (always when
        ``force`` and they differ). A no-op for the HF engine, which generates with the policy itself."""
        assert self.rollout_engine is not None
        behind = self._weights_version - self._engine_version
        if behind >= self.config.vllm_sync_every or (force and behind > 0):
            self.rollout_engine.sync_weights(self.policy)
            self._engine_version = self._weights_version

    def generate(self, prompts: Sequence[Any], num_generations: int, sampling: SamplingConfig) -> RolloutOutput:
        """Rollout with the current policy: prompts (message lists or strings) -> ``RolloutOutput``."""
        ids, _ = self.tokenize_prompts(prompts)
        assert self.rollout_engine is not None
        return self.rollout_engine.generate(ids, num_generations, sampling)

    @torch.no_grad()
    def make_experience(self, batch: dict[str, list]) -> Experience:
        """One rollout: generate G completions per prompt, score them, compute advantages and (when needed) the
        old and reference logprobs. Called by the loop; runs on this process's prompts only.

        Args:
            batch: a prompt batch, a dict of equal-length lists with a "prompt" key (message lists or strings)
                and the dataset's other columns (passed to the reward functions).

        Raises:
            KeyError: the batch has no "prompt" column.
            ValueError: a reward function misbehaves (see :func:`lightning_grpo.rewards.scoring.score_completions`),
                or every reward of a completion is missing.
        """
        if "prompt" not in batch:
            raise KeyError(f"prompt batches need a 'prompt' column, got columns {sorted(batch)}")
        cfg = self.config
        g = cfg.num_generations
        self._sync_engine()
        start = time.perf_counter()
        prompt_ids, num_truncated = self.tokenize_prompts(batch["prompt"])
        assert self.rollout_engine is not None
        out = self.rollout_engine.generate(
            prompt_ids,
            g,
            SamplingConfig(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k),
        )
        rollout_s = time.perf_counter() - start

        score_start = time.perf_counter()
        prompts = [p for p in batch["prompt"] for _ in range(g)]
        columns = {k: [v for v in values for _ in range(g)] for k, values in batch.items() if k != "prompt"}
        scores = score_completions(self.reward_funcs, prompts, out.completions, columns, self.reward_weights)
        rewards = scores.rewards
        if torch.isnan(rewards).any():
            bad = torch.isnan(rewards).nonzero().flatten().tolist()
            raise ValueError(f"every reward function returned None for completions {bad}: no reward to learn from")
        advantages = F.group_advantages(rewards, g, cfg.scale_rewards, cfg.advantage_eps)
        scoring_s = time.perf_counter() - score_start

        device = self.device
        experience = Experience(
            prompt_ids=out.prompt_ids.to(device),
            prompt_mask=out.prompt_mask.to(device),
            completion_ids=out.completion_ids.to(device),
            completion_mask=out.completion_mask.to(device),
            advantages=advantages.to(device),
            sampler_logprobs=None if out.sampler_logprobs is None else out.sampler_logprobs.to(device),
        )
        logprob_start = time.perf_counter()
        n = len(experience)
        mini = cfg.mini_batch_size or n
        if cfg.num_iterations > 1 or mini < n:
            experience.old_logprobs = self._batched_logprobs(self.policy, experience)
        if self.ref_model is not None:
            experience.ref_logprobs = self._batched_logprobs(self.ref_model, experience)
        logprob_s = time.perf_counter() - logprob_start
        experience.metrics = self._rollout_metrics(out, scores, rewards, num_truncated, len(batch["prompt"]))
        experience.metrics.update(
            {
                "timing/rollout_s": rollout_s,
                "timing/scoring_s": scoring_s,
                "timing/logprobs_s": logprob_s,
                "tokens_per_s": float(out.completion_mask.sum()) / max(rollout_s, 1e-9),
            }
        )
        self._rollout_end = time.perf_counter()
        return experience

    def _rollout_metrics(self, out: RolloutOutput, scores: Any, rewards: Tensor, num_truncated: int, num_prompts: int) -> dict[str, float]:
        g = self.config.num_generations
        lengths = out.completion_mask.sum(dim=1).float().cpu()
        grouped = rewards.view(-1, g)
        sums = {
            "reward": rewards.sum(),
            "reward_std": grouped.std(dim=1).sum(),  # mean of per-group stds, as TRL
            "frac_reward_zero_std": (grouped.std(dim=1) == 0).float().sum(),
            "completions/mean_length": lengths.sum(),
            "completions/clipped_ratio": out.truncated.float().cpu().sum(),
            "prompts/truncated": torch.tensor(float(num_truncated)),
        }
        counts = {"reward": rewards.numel(), "reward_std": grouped.shape[0], "frac_reward_zero_std": grouped.shape[0],
                  "completions/mean_length": lengths.numel(), "completions/clipped_ratio": lengths.numel(),
                  "prompts/truncated": 1}
        for name, column in zip(scores.names, scores.per_function.T):
            valid = ~torch.isnan(column)
            sums[f"rewards/{name}/mean"] = torch.where(valid, column, torch.zeros_like(column)).sum()
            counts[f"rewards/{name}/mean"] = int(valid.sum())
        keys = sorted(sums)
        values = torch.stack([torch.as_tensor(sums[k], dtype=torch.float64) for k in keys])
        totals = torch.tensor([float(counts[k]) for k in keys], dtype=torch.float64)
        reduced = self._all_reduce_sum(torch.cat([values, totals]).to(self.device)).cpu()
        metrics = {k: float(reduced[i] / max(reduced[len(keys) + i], 1.0)) for i, k in enumerate(keys)}
        metrics["prompts/truncated"] = float(reduced[keys.index("prompts/truncated")])
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
            world_size=self.trainer.world_size,
            generator=generator,
            all_reduce_sum=self._all_reduce_sum,
        )

    def _batched_logprobs(self, model: nn.Module, experience: Experience) -> Tensor:
        """Logprobs of the completions under ``model`` (no grad), in micro-batch-sized chunks."""
        size = max(1, (self.config.mini_batch_size or len(experience)) // self.trainer.accumulate_grad_batches)
        chunks = []
        was_training = model.training
        model.eval()
        try:
            with self.trainer.precision_plugin.forward_context():
                for start in range(0, len(experience), size):
                    index = torch.arange(start, min(start + size, len(experience)))
                    part = experience.select(index)
                    logprobs, _ = self.completion_logprobs(model, part)
                    padded = logprobs.new_zeros((len(index), experience.completion_ids.shape[1]))
                    padded[:, : logprobs.shape[1]] = logprobs
                    chunks.append(padded)
        finally:
            model.train(was_training)
        return torch.cat(chunks)

    def completion_logprobs(self, model: nn.Module, batch: Experience, with_entropy: bool = False) -> tuple[Tensor, Optional[Tensor]]:
        """Per-token logprobs ``(B, T)`` float32 of ``batch.completion_ids`` under ``model`` at the sampling
        temperature, and optionally the per-token entropy. Only the completion positions' logits are computed."""
        input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)  # [B, P+T]
        attention_mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)  # [B, P+T]
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # [B, P+T]
        t = batch.completion_ids.shape[1]
        out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                    logits_to_keep=t + 1, use_cache=False)
        logits = out.logits[:, :-1]  # [B, T, V]: position j predicts completion token j
        return F.token_logprobs(logits, batch.completion_ids, self.config.temperature, with_entropy=with_entropy)

    # -------------------------------------------------------------- training
    def training_step(self, batch: Experience, batch_idx: int) -> Tensor:
        """GRPO loss on one experience micro-batch (DeepSeekMath eq. 3 with the chosen ``loss_type``).

        Returns the micro-batch's share of the step loss, scaled so that after Lightning's division by
        ``accumulate_grad_batches`` and data-parallel averaging the step's gradient is that of
        (summed loss / step normalizer).
        """
        cfg = self.config
        mask = batch.completion_mask.bool()
        logprobs, entropy = self.completion_logprobs(self.policy, batch, with_entropy=True)
        logprobs = torch.where(mask, logprobs, logprobs.detach())
        old = batch.old_logprobs if batch.old_logprobs is not None else logprobs.detach()
        old = torch.where(mask, old, logprobs.detach())
        advantages = torch.nan_to_num(batch.advantages, nan=0.0)
        per_token, clip = F.policy_loss(logprobs, old, advantages, cfg.epsilon_low, cfg.epsilon_high, cfg.clip_ratio_c, cfg.delta)
        kl = None
        if batch.ref_logprobs is not None:
            ref = torch.where(mask, batch.ref_logprobs, logprobs.detach())
            kl = F.kl_penalty(logprobs, ref, cfg.kl_estimator)
            per_token = per_token + cfg.beta * kl
        loss = F.aggregate_loss(per_token, mask, cfg.loss_type, cfg.max_new_tokens, batch.loss_normalizer)
        self._accumulate(loss.detach(), mask, clip, entropy, kl)
        if batch.step_end:
            self._log_step(batch.metrics)
        return loss * batch.loss_scale

    def _accumulate(self, loss: Tensor, mask: Tensor, clip: F.ClipStats, entropy: Optional[Tensor], kl: Optional[Tensor]) -> None:
        def masked_sum(values: Tensor) -> Tensor:
            return torch.where(mask, values.float(), torch.zeros_like(values, dtype=torch.float32)).sum()

        parts = {
            "loss": loss.float(),
            "tokens": mask.sum().float(),
            "clip_ratio/low_mean": masked_sum(clip.low),
            "clip_ratio/high_mean": masked_sum(clip.high),
            "clip_ratio/region_mean": masked_sum(clip.region),
        }
        if entropy is not None:
            parts["entropy"] = masked_sum(entropy)
        if kl is not None:
            parts["kl"] = masked_sum(kl.detach())
        for key, value in parts.items():
            self._step_sums[key] = self._step_sums.get(key, torch.zeros((), device=value.device)) + value

    def _log_step(self, rollout_metrics: dict[str, float]) -> None:
        sums, self._step_sums = self._step_sums, {}
        keys = sorted(sums)
        reduced = self._all_reduce_sum(torch.stack([sums[k] for k in keys]))
        totals = dict(zip(keys, reduced.tolist()))
        tokens = max(totals.pop("tokens"), 1.0)
        metrics = {"loss": totals.pop("loss")}  # the step loss: sum over micro-batches and processes / normalizer
        metrics.update({k: v / tokens for k, v in totals.items()})
        metrics.update(rollout_metrics)
        metrics["timing/train_s"] = time.perf_counter() - getattr(self, "_rollout_end", time.perf_counter())
        metrics["num_tokens"] = tokens
        shown = {k: metrics.pop(k) for k in ("loss", "reward") if k in metrics}
        self.log_dict(shown, prog_bar=True, on_step=True, on_epoch=False, batch_size=1)
        self.log_dict(metrics, on_step=True, on_epoch=False, batch_size=1)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for p in self.policy.parameters() if p.grad is not None]
        if grads:
            norms = [g.full_tensor().float().norm() if hasattr(g, "full_tensor") else g.float().norm() for g in grads]
            self.log("grad_norm", torch.stack(norms).norm(), on_step=True, on_epoch=False, batch_size=1)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        super().optimizer_step(*args, **kwargs)
        self._weights_version += 1

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
        self._sync_engine(force=True)
        cfg = self.config
        sampling = SamplingConfig(max_new_tokens=cfg.eval_max_new_tokens or cfg.max_new_tokens, greedy=True)
        out = self.generate(batch["prompt"], 1, sampling)
        columns = {k: v for k, v in batch.items() if k != "prompt"}
        scores = self.accuracy_reward(batch["prompt"], out.completions, **columns)
        values = torch.tensor([float("nan") if s is None else float(s) for s in scores], device=self.device)
        self.val_accuracy.update(values[~torch.isnan(values)])
        self.log("val/accuracy", self.val_accuracy, on_step=False, on_epoch=True, prog_bar=True, batch_size=len(scores))
        self.log("val/mean_length", out.completion_mask.sum(dim=1).float().mean(), on_epoch=True, batch_size=len(scores), sync_dist=True)

    # ---------------------------------------------------------------- export
    def on_fit_end(self) -> None:
        path = self.export_path()
        if path and self.trainer.is_global_zero:
            os.makedirs(path, exist_ok=True)
            self.policy.save_pretrained(path)
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
