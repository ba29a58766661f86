"""How a :class:`~lightning_grpo.module.GRPOModule` enters and leaves each stage (fit, validate, test): the
datamodule read into a :class:`~lightning_grpo.data.source.DataPlan` (and the rollout schedule the loop asks for from
it), the rollout engine made once and kept across stages (closed at the end of a fit, after a failed run, or by
:meth:`RunLifecycle.close_rollout_engine`), the trainer's backend and what it says of the models
(:class:`~lightning_grpo.strategies.base.GRPOModels`), the experience maker's context, the "auto" values resolved into
:class:`~lightning_grpo.config.ResolvedConfig`, the validation and test steps (the evaluation rollouts, per dataset),
and the HF export at the end of a fit.

:class:`RunLifecycle` holds these Lightning hooks of ``GRPOModule`` (it is its base, and uses the components
``GRPOModule.__init__`` makes); ``module.py`` holds the construction, the experience, the training step and the
optimizer's hooks.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Optional

import lightning as L
from torch import nn
from typing_extensions import override

from lightning_grpo.callbacks.base import EventRoute
from lightning_grpo.data.source import EVAL_INDEX, DataPlan
from lightning_grpo.evaluation.evaluator import counted_rows
from lightning_grpo.experience_maker import RolloutContext
from lightning_grpo.loop.fit_loop import install_loop
from lightning_grpo.models.dropout import warn_dropout_with_reused_rollouts
from lightning_grpo.models.lora import check_quantized_engine, check_tied_head, engine_checkpoint, export_policy
from lightning_grpo.protocols import Collectives, RolloutEngine
from lightning_grpo.runtime.checkpointing import use_atomic_checkpoint_io
from lightning_grpo.runtime.cleanup import install
from lightning_grpo.strategies import backend_for
from lightning_grpo.strategies.base import GRPOModels
from lightning_grpo.strategies.local import LocalBackend
from lightning_grpo.training import schedule
from lightning_grpo.training.experience import Experience
from lightning_grpo.training.token_budget import fit_token_budget

log = logging.getLogger(__name__)


class RunLifecycle(L.LightningModule):
    """The stage hooks of :class:`~lightning_grpo.module.GRPOModule` (see the module docstring)."""

    def _record_resolved(self) -> None:
        """The resolved values into the hyperparameters (beside the config as given) and the log."""
        self.hparams["resolved"] = self.resolved.as_dict()
        log.info("resolved settings: %s", self.resolved.as_dict())

    @property
    def token_budget(self) -> Optional[int]:
        """The micro-batch token budget in effect (``resolved.max_tokens_per_microbatch``), None without one."""
        return self.resolved.max_tokens_per_microbatch

    @property
    def rollout_engine(self) -> Optional[RolloutEngine]:
        """The rollout engine (made in ``setup``; a backend may wrap it)."""
        return self.rollout.engine

    @rollout_engine.setter
    def rollout_engine(self, engine: Optional[RolloutEngine]) -> None:
        self.rollout.engine = engine

    @override
    def setup(self, stage: str) -> None:
        """Read the datamodule (:class:`~lightning_grpo.data.source.DataPlan`); make the rollout engine, once: a
        validation before the fit hands its engine to the fit (it is closed when the fit ends, when a run fails, or
        by :meth:`close_rollout_engine`)."""
        if stage == "fit":
            install_loop(self.trainer)
        self.data_plan = prompts = DataPlan.of(self.trainer.datamodule)
        self.rollout.check_image_column(prompts.image_field)  # images for a causal LM: refused before any rollout
        self._events = EventRoute.of(self.trainer)  # the trainer's GRPOCallbacks
        if stage == "fit" and prompts.prompts_per_step is not None:
            self.rollouts_ahead()  # a max_staleness that cannot run ahead is refused before an engine is built
        self.make_rollout_engine(prompts.prompts_per_step)
        install(self.trainer, self._release_on_exception)  # no teardown runs after a failure
        check_quantized_engine(self._lora_settings, self.rollout.require_engine())
        self.rewards.setup(self.trainer.strategy.root_device)  # e.g. a reward model's device="auto": this rank's
        check_tied_head(self.policy, self._loaded.base, self.rollout.require_engine())
        if stage == "fit":
            updates = self.steps_per_rollout() if prompts.prompts_per_step is not None else 1
            warn_dropout_with_reused_rollouts(self.policy, max(updates, self.config.num_iterations))
        self.preemption.attach(self.trainer)
        use_atomic_checkpoint_io(self.trainer.strategy)

    def make_rollout_engine(self, rollout_prompts: Optional[int] = None) -> RolloutEngine:
        """Make the rollout engine ``config.engine`` names, once (``setup`` does; a made or given engine is kept),
        resolving its "auto" settings into :attr:`resolved`. ``rollout_prompts``: prompts per rollout on this
        process, when known (sizes ``engine.kv_cache_space_gib="auto"``). Returns the engine."""
        images = self.rollout.images  # a vision-language policy's: its image processor goes with a saved checkpoint
        save_processor = None if images is None else images.save_processor
        checkpoint = functools.partial(engine_checkpoint, self._loaded, save_processor)
        self.resolved = self.rollout.start(self._loaded.base, checkpoint, self.resolved, rollout_prompts)
        self._record_resolved()
        return self.rollout.require_engine()

    @property
    def hf_model(self) -> nn.Module:
        """The policy's transformers model: a PEFT policy's base model (whose layers carry the adapters), else the
        policy (what the HF engine generates with)."""
        return self._loaded.base

    @override
    def configure_model(self) -> None:
        """The trainer's backend shards or converts the policy, reference, teacher and engine
        (``strategies.backend_for``)."""
        self.backend = backend_for(self.trainer.strategy)
        self._set_models(self.backend.configure(self._models()))

    def _models(self) -> GRPOModels:
        """The module's models for a backend: the engine as it was made or given, the policy's kind, the
        distillation teacher's model."""
        return GRPOModels(self.policy, self.ref_model, self.rollout.own_engine, lora=self._loaded.lora,
                          teacher=self.teacher_model)

    @property
    def teacher_model(self) -> Optional[nn.Module]:
        """On-policy distillation's frozen teacher model (``config.distillation.teacher``) as the backend made it,
        else None (no teacher, or a served one)."""
        return None if self.teacher is None else self.teacher.model

    @property
    def collectives(self) -> Collectives:
        """The trainer's data-parallel reductions (the backend's), flags on this module's device."""
        return self.backend.collectives(self.device)

    def _bind_context(self) -> None:
        """The experience maker's :class:`~lightning_grpo.experience_maker.RolloutContext` for this run (the
        backend, device and trainer settings are final once the fit, validation or test starts; the token budget
        once training starts)."""
        self.experience_maker.bind(RolloutContext(
            collectives=self.collectives, timer=self.timer,
            forward_context=self.trainer.precision_plugin.forward_context,
            micro_batches_per_step=self.trainer.accumulate_grad_batches, rank=self.global_rank,
            token_budget=self.resolved.max_tokens_per_microbatch,
        ))

    def _set_models(self, models: GRPOModels) -> None:
        """Take what the backend made: the models, the engine's wrapper and weights, the scorer and layout."""
        self.policy, self._reference.model = models.policy, models.ref
        if self.teacher is not None and self.teacher.model is not None:  # sharded or converted like the reference
            self.teacher.model = models.teacher
        self.rollout.attach(models.engine, models.weights)
        self.logprobs.use(models.scorer, models.sharded)

    @override
    def teardown(self, stage: str) -> None:
        """Stop background rollouts; plain HF models again (Megatron converts back); a finished module holds no
        trainer's backend. The rollout engine stays for the next stage, except at the end of a fit, which closes an
        engine the module made from ``config.engine`` (a given engine is the caller's, kept)."""
        self.experience_maker.close()
        restored = self.backend.restore(GRPOModels(self.policy, self.ref_model, teacher=self.teacher_model))
        self.rollout.detach()
        self.backend = LocalBackend()
        self._set_models(self.backend.configure(dataclasses.replace(self._models(), policy=restored.policy,
                                                                    ref=restored.ref, teacher=restored.teacher)))
        if stage == "fit":
            self.rollout.close()

    def release(self) -> None:
        """Stop background rollouts and close the rollout engine the module made (what a failed run leaves:
        :class:`~lightning_grpo.runtime.cleanup.ReleaseOnException`). Idempotent."""
        self.experience_maker.close()
        self.rollout.close()

    def close_rollout_engine(self) -> None:
        """Close the rollout engine the module made (a validation or test keeps it for a following stage; the end
        of a fit closes it itself); the next stage makes a new one. A given engine is kept. Idempotent."""
        self.rollout.close()

    @override
    def on_fit_start(self) -> None:
        for frozen in (self.ref_model, self.teacher_model):
            if frozen is not None:
                frozen.to(self.device)
        self._bind_context()

    @override
    def on_validation_start(self) -> None:
        self._bind_context()

    @override
    def on_test_start(self) -> None:
        self._bind_context()

    @override
    def on_train_start(self) -> None:
        if self.config.max_tokens_per_microbatch == "auto" and self.resolved.max_tokens_per_microbatch is None:
            self._fit_token_budget()
        self.timer.start()

    def _fit_token_budget(self) -> None:
        """Choose ``max_tokens_per_microbatch="auto"`` from probe steps (the smallest over processes,
        :func:`~lightning_grpo.training.token_budget.fit_token_budget`) into :attr:`resolved`; log it as
        ``token_budget``. Raises MemoryError as that function."""

        def train_step(batch: Experience) -> None:
            with self.trainer.precision_plugin.forward_context():
                loss = self.compute_loss(batch).loss
            loss.backward()
            self.policy.zero_grad(set_to_none=True)

        sequences = self.config.mini_batch_size or (self.data_plan.prompts_per_step or 1) * self.config.num_generations
        tokens = fit_token_budget(train_step, self.config, int(self.policy.config.vocab_size), self.device, sequences,
                                  self.trainer.optimizers, self.backend.reduce_max)
        self.resolved = self.resolved.replace(max_tokens_per_microbatch=tokens)
        self._record_resolved()
        self._bind_context()  # the old/ref logprob passes take the budget too
        for logger in self.trainer.loggers:
            logger.log_metrics({"token_budget": float(tokens)}, step=self.global_step)

    @override
    def on_fit_end(self) -> None:
        path = self.export_path()
        if path:
            state_dict = self.backend.export_state_dict(self.policy)  # when sharded a collective: every rank gathers
            if self.trainer.is_global_zero:
                export_policy(self.policy, self.tokenizer, path, state_dict, merged=self.hparams.export_merged)

    def export_path(self) -> Optional[str]:
        """The HF export folder (see ``export_dir``), or None when disabled."""
        export_dir = self.hparams.export_dir
        if export_dir is not None:
            return export_dir or None
        return os.path.join(self.trainer.log_dir or self.trainer.default_root_dir, "hf_model")

    def micro_batches_per_rollout(self) -> Optional[int]:
        """``training_step`` calls per rollout (:func:`lightning_grpo.training.schedule.micro_batches_per_rollout`).
        Raises as :meth:`steps_per_rollout`."""
        return schedule.micro_batches_per_rollout(self.config, self.data_plan.prompts_per_step,
                                                  self.trainer.accumulate_grad_batches)

    def steps_per_rollout(self) -> int:
        """Optimizer steps per rollout (:func:`lightning_grpo.training.schedule.steps_per_rollout`). Raises
        ValueError when the datamodule does not say how many prompts a rollout batch has (``prompts_per_step``)."""
        return schedule.steps_per_rollout(self.config, self.data_plan.prompts_per_step)

    def rollouts_ahead(self, prompt_batches: Optional[int] = None) -> int:
        """Rollouts generated in the background ahead of the one being trained
        (:func:`lightning_grpo.training.schedule.rollouts_ahead`; ``prompt_batches``: the loop's loader length, None
        when unknown); 0 = synchronous rollouts. Raises ValueError as that function."""
        return schedule.rollouts_ahead(self.config, self.data_plan.prompts_per_step, prompt_batches)

    @override
    def validation_step(self, batch: dict[str, list], batch_idx: int, dataloader_idx: int = 0) -> None:
        """Greedy accuracy, and pass@k / maj@k / mean@k with ``eval.num_samples``, per dataset (torchmetrics
        over all processes; names in :class:`lightning_grpo.evaluation.evaluator.Evaluator`)."""
        self._evaluate(batch, dataloader_idx, "val")

    @override
    def test_step(self, batch: dict[str, list], batch_idx: int, dataloader_idx: int = 0) -> None:
        """As :meth:`validation_step`, logged as ``test/...``."""
        self._evaluate(batch, dataloader_idx, "test")

    def _evaluate(self, batch: dict[str, list], dataloader_idx: int, stage: str) -> None:
        dataset, check = self.data_plan.evaluated(dataloader_idx)  # the first is the training one: the module's
        with self.preemption.exit_on_stop():
            out = self.experience_maker.evaluate(batch, self.policy, accuracy=self.rewards.accuracy_for(check))
        if EVAL_INDEX in batch:  # count each prompt once over the processes (a distributed sampler pads)
            sampler = self.trainer.distributed_sampler_kwargs or {}
            out.counted = counted_rows(batch[EVAL_INDEX], sampler.get("num_replicas", 1), sampler.get("rank", 0))
        for key, (metric, size, attribute) in self.evaluator.update(stage, dataset, out).items():
            self.log(key, metric, on_step=False, on_epoch=True, prog_bar=key.endswith("/accuracy"), batch_size=size,
                     add_dataloader_idx=False, metric_attribute=f"evaluator.{attribute}")
