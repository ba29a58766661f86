"""The rollout worker: owns the rollout engine, the rollout path (prompt encoding and sampler) and the weight versions.

The trainer's weights change at every optimizer step (:meth:`RolloutWorker.mark_stale`); the engine gets them at
the next :meth:`RolloutWorker.awake` when ``engine.sync_every`` steps have passed (always when forced, e.g. before
validation), as the stream the trainer's backend makes of them (:attr:`RolloutWorker.weights`, a
:class:`~lightning_grpo.protocols.weights.PolicyWeights`). An engine that generates with the policy's own parameters
(HF, ``uses_policy_parameters``) needs no sync: its ``sync_weights`` is never called and no view of the weights is
made for it.

The engine the worker made (:meth:`RolloutWorker.start`) or was given lives across stages: a backend wraps it for a
stage (:meth:`RolloutWorker.attach`) and the wrapper goes at the stage's end (:meth:`RolloutWorker.detach`), so a
validation before a fit hands its engine to the fit, and the end of a fit (:meth:`RolloutWorker.end_stage`) or
:meth:`RolloutWorker.close` releases an engine it made.

Every rollout goes through the :class:`~lightning_grpo.protocols.sampler.PromptEncoder` and
:class:`~lightning_grpo.protocols.sampler.Sampler` the worker is made with: single-turn (the chat template, one
``engine.generate``) and multi-turn (the prompts with their tools, the turn loop of
:class:`~lightning_grpo.episodes.turn_loop.EpisodeRunner`) alike.

The worker's :class:`~lightning_grpo.protocols.rollout.StopFlag` (``stop``) is polled by its engine while it generates
(preemption: ``GRPOModule`` sets it to watch ``trainer.received_sigterm``), and the policy's weights are checked for
NaN/inf before every rollout (:func:`lightning_grpo.training.nonfinite.check_finite_parameters`).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Callable, ContextManager, Iterator, Mapping, Optional, Sequence

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from lightning_grpo.config import GRPOConfig, ResolvedConfig
from lightning_grpo.events import ON_WEIGHTS_SYNCED, EventSink
from lightning_grpo.protocols.collectives import Collectives
from lightning_grpo.protocols.engine import RolloutEngine, check_images_accepted
from lightning_grpo.protocols.rollout import RolloutOutput, StopFlag
from lightning_grpo.protocols.routing import RoutingRecorder
from lightning_grpo.protocols.sampler import EncodedPrompts, ImagePromptEncoder, PromptEncoder, Sampler
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.protocols.streaming import StreamingEngine, WeightUpdate
from lightning_grpo.protocols.weights import PolicyWeights
from lightning_grpo.rollout.adapter import as_rollout_engine
from lightning_grpo.rollout.engine_registry import EngineSpec, make_engine
from lightning_grpo.rollout.prompts import TemplatePrompts, refuse_images
from lightning_grpo.rollout.single_turn import SingleTurnSampler
from lightning_grpo.rollout.streaming.streaming_engine import StreamingRolloutEngine, make_streaming_engine
from lightning_grpo.strategies.module_weights import ModuleWeights
from lightning_grpo.training.metrics import StepTimer
from lightning_grpo.training.nonfinite import check_finite_parameters


def prompt_rows(batch: Any) -> list[dict[str, Any]]:
    """A prompt batch (a dict of equal-length lists) as one dict per prompt, every column included (the rows the
    environments of multi-turn episodes are reset with)."""
    n = len(batch["prompt"])
    return [{k: v[i] for k, v in batch.items()} for i in range(n)]


class RolloutWorker:
    """The engine's lifecycle (make, wake, sync, sleep), the rollout path and weight versions.

    Args:
        config: the algorithm settings (``engine``, ``max_prompt_length``, ``engine.sync_every``, ...).
        tokenizer: the policy's tokenizer (the engine's; the default prompt encoding's).
        events: called as ``events("on_weights_synced", weights_version)`` after each sync
            (:mod:`lightning_grpo.events`).
        prompts: how prompts become token ids; default :class:`~lightning_grpo.rollout.prompts.TemplatePrompts`
            (the tokenizer's chat template).
        sampler: how token ids become a rollout; default
            :class:`~lightning_grpo.rollout.single_turn.SingleTurnSampler` (one ``engine.generate``). Multi-turn:
            the :class:`~lightning_grpo.episodes.turn_loop.EpisodeRunner` is both (``lightning_grpo.episodes.build``).
        stop: the stop flag (default a new one); the sampler's, when it polls one, is this one.
        images: a vision-language policy's prompt encoding with images
            (:class:`~lightning_grpo.protocols.sampler.ImagePromptEncoder`, ``lightning_grpo.episodes.build``):
            :meth:`encode` gives the prompts' images with their ids and :attr:`banned_token_ids` its placeholders;
            None for a causal LM.
        routing: a mixture-of-experts policy's routing recorder, for the engine the worker makes when routing replay
            replays the sampler's routing (``GRPOConfig.routing_replay="R3"``); None otherwise.

    Attributes:
        engine: the rollout engine, None before :meth:`start` (during a stage, the backend's wrapper of it).
        weights: the policy's weights as the trainer's backend streams them to the engine (:meth:`attach`); None:
            the policy module's own, as the single-process backend gives them
            (:class:`~lightning_grpo.strategies.module_weights.ModuleWeights` of the policy :meth:`sync` is given).
        weights_version: optimizer steps taken so far (the trainer's ``global_step``; restored from a checkpoint by
            :meth:`load_state_dict`).
        engine_version: the ``weights_version`` the engine generates with (-1: not yet synced).
        stop: the stop request the engine and the sampler poll (a stopped rollout raises
            :class:`~lightning_grpo.protocols.rollout.RolloutInterrupted`).
        prompts, sampler, images: the rollout path (see the arguments).
        last_update: streaming rollouts: what the last weight update took (:class:`WeightUpdate`), else None.
    """

    def __init__(self, config: GRPOConfig, tokenizer: PreTrainedTokenizerBase, events: Optional[EventSink] = None, *,
                 prompts: Optional[PromptEncoder] = None, sampler: Optional[Sampler] = None,
                 stop: Optional[StopFlag] = None, images: Optional[ImagePromptEncoder] = None,
                 routing: Optional[RoutingRecorder] = None) -> None:
        self.config = config
        self.routing = routing
        self.events = events
        self.tokenizer = tokenizer
        self.prompts: PromptEncoder = prompts if prompts is not None else TemplatePrompts(tokenizer)
        self.sampler: Sampler = sampler if sampler is not None else SingleTurnSampler()
        self.images = images
        self._engine_type = "None"
        self._own: Optional[RolloutEngine] = None  # the engine as made or given (kept across stages)
        self._engine: Optional[RolloutEngine] = None  # the stage's: the backend's wrapper of _own, or _own
        self._made: Optional[RolloutEngine] = None  # the engine start() made, which close() releases
        self._streaming: Optional[StreamingRolloutEngine] = None  # streaming rollouts: the engine as a rollout engine
        self.last_update: Optional[WeightUpdate] = None
        self.weights: Optional[PolicyWeights] = None
        self.engine_name = config.engine.name  # "auto" until start() is given the resolved name
        self.weights_version = 0
        self.engine_version = 0
        self.stop = stop if stop is not None else StopFlag()

    @property
    def engine(self) -> Optional[RolloutEngine]:
        """The rollout engine (None before :meth:`start`; during a stage, the backend's wrapper of it)."""
        return self._engine

    @engine.setter
    def engine(self, engine: Any) -> None:
        """Give the worker an engine (the caller's: kept, never closed by the worker): a
        :class:`~lightning_grpo.protocols.engine.RolloutEngine`, or a user engine with only some of its members
        (adapted by :func:`~lightning_grpo.rollout.adapter.as_rollout_engine`, which honours each capability it
        declares; a TypeError names a core member it lacks). An engine with its own weights gets the policy's before
        its first rollout."""
        if engine is not None and self.config.streaming.enabled:
            raise ValueError("GRPOConfig.streaming.enabled=True samples with a StreamingEngine: give one as "
                             "GRPOModule.streaming_engine (RolloutWorker.streaming_engine), not as a rollout engine")
        self._streaming = None
        self._set_own(None if engine is None else as_rollout_engine(engine), type(engine).__name__)

    @property
    def streaming_engine(self) -> Optional[StreamingRolloutEngine]:
        """Streaming rollouts: the streaming engine as a rollout engine (its ``streaming`` engine and event ``loop``);
        None otherwise."""
        return self._streaming

    @streaming_engine.setter
    def streaming_engine(self, engine: Optional[StreamingEngine]) -> None:
        """Give the worker a :class:`~lightning_grpo.protocols.streaming.StreamingEngine` (the caller's: kept, never
        closed by the worker) for streaming rollouts; it is also the worker's rollout engine (validation and other
        one-off rollouts sample on it)."""
        self._streaming = None if engine is None else self._streaming_adapter(engine)
        self._set_own(self._streaming, None if engine is None else type(engine).__name__)

    def _streaming_adapter(self, engine: StreamingEngine) -> StreamingRolloutEngine:
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        return StreamingRolloutEngine(engine, self.tokenizer, int(pad))

    def _set_own(self, engine: Optional[RolloutEngine], name: Optional[str] = None) -> None:
        self._engine_type = name or type(engine).__name__  # the engine as given, not its adapter
        if engine is not None:
            self._check_capabilities(engine)
        self._engine_type = name or type(engine).__name__  # the engine as given, not its adapter
        self._own = self._engine = engine
        if engine is not None and not engine.capabilities.uses_policy_parameters:
            self.engine_version = -1

    @property
    def own_engine(self) -> Optional[RolloutEngine]:
        """The engine as it was made or given, without a backend's wrapper (what a backend wraps)."""
        return self._own

    def start(self, model: nn.Module, checkpoint: Callable[[], str], resolved: ResolvedConfig,
              rollout_prompts: Optional[int] = None, compute_dtype: Optional[torch.dtype] = None,
              forward_context: Callable[[], ContextManager] = contextlib.nullcontext) -> ResolvedConfig:
        """Make the engine ``resolved.engine_name`` names, once (an engine made or given is kept, across stages
        too; :func:`~lightning_grpo.rollout.engine_registry.make_engine`). An engine with its own weights gets the
        policy's before its first rollout (they may differ from the checkpoint's, e.g. after a resume).

        Args:
            model: the policy's transformers model (a PEFT policy's base model).
            checkpoint: returns the folder an engine with its own weights is loaded from.
            resolved: the run's resolved settings (the engine's name).
            rollout_prompts: prompts per rollout on this process, if known (sizes ``engine.kv_cache_space_gib=
                "auto"``).
            compute_dtype: the dtype the trainer computes the policy in (resolves ``engine.dtype="auto"``); None:
                the policy's parameter dtype.
            forward_context: the trainer's precision context, which an engine that generates with the policy's
                parameters (HF) enters around its forward passes.

        Returns:
            ``resolved`` with what making the engine resolved (the KV-cache size, the engine's dtype); unchanged
            when an engine exists.

        Raises:
            ValueError: ``max_staleness > 0`` with an engine that generates with the policy's own parameters;
                ``routing_replay="R3"`` with an engine whose rollouts do not carry the routed experts.
        """
        self.engine_name = resolved.engine_name
        if self._own is not None:
            return resolved
        spec = EngineSpec(self.config, model, self.tokenizer, checkpoint, self.stop, resolved.engine_name,
                          rollout_prompts, routing=self.routing, compute_dtype=compute_dtype,
                          forward_context=forward_context)
        if self.config.streaming.enabled:  # the rollout servers' pool (or a registered streaming engine)
            streaming = make_streaming_engine(spec)
            self._streaming = engine = self._streaming_adapter(streaming)
            self._set_own(engine, type(streaming).__name__)
        else:
            made = make_engine(spec)
            engine = as_rollout_engine(made)
            self._set_own(engine, type(made).__name__)
        self._made = engine
        return resolved.replace(**spec.resolved)

    def attach(self, engine: Optional[RolloutEngine], weights: Optional[PolicyWeights]) -> None:
        """For a stage: the trainer's backend's view of the engine (:attr:`own_engine`, or a wrapper of it) and the
        stream of the policy's weights it syncs from (``GRPOModels.engine``, ``GRPOModels.weights``)."""
        self._engine = engine if engine is not None else self._own
        self.weights = weights

    def detach(self) -> None:
        """The end of a stage: the backend's wrapper goes, the engine stays (for the next stage)."""
        self._engine = self._own

    def end_stage(self, stage: str) -> None:
        """The end of a stage (fit, validate, test): :meth:`detach`, and at the end of a fit :meth:`close` (an engine
        the worker made; a validation or test keeps it for a following stage)."""
        self.detach()
        if stage == "fit":
            self.close()

    def close(self) -> None:
        """Release the engine :meth:`start` made (``engine.close()``: vLLM's KV cache and weights, the
        ``torch.distributed`` default group vLLM's in-process worker created, the rollout server's weight-sync
        group); the next :meth:`start` makes a new one, which gets the policy's weights before its first rollout.
        An engine given to the worker (the ``engine`` setter, ``GRPOModule.rollout_engine = ...``) is the caller's:
        it is kept and not closed. Idempotent."""
        made, self._made = self._made, None
        if made is None:
            return
        if self._own is made:
            self._own = self._engine = self._streaming = None
        made.close()

    @property
    def made_engine(self) -> bool:
        """Whether the worker holds an engine it made (which :meth:`close` releases)."""
        return self._made is not None

    def state_dict(self) -> dict[str, int]:
        """What a checkpoint keeps of the worker: ``weights_version``."""
        return {"weights_version": self.weights_version}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore :meth:`state_dict` (the engine gets the weights before its next rollout when they differ)."""
        self.weights_version = int(state["weights_version"])

    def _check_capabilities(self, engine: RolloutEngine) -> None:
        if self.config.routing_replay == "R3" and not engine.capabilities.returns_routed_experts:
            raise ValueError(
                f"GRPOConfig.routing_replay='R3' replays the experts the rollout engine routed each token to, but the "
                f"engine {self._engine_type} (engine.name={self.engine_name!r}) does not return them (its capabilities "
                "say returns_routed_experts=False): use the 'hf' engine with a mixture-of-experts policy, or "
                "routing_replay='R2' (the old policy's routing) or 'off'")
        if self.config.max_staleness > 0 and engine.capabilities.uses_policy_parameters:
            raise ValueError(
                f"GRPOConfig.max_staleness={self.config.max_staleness} needs a rollout engine with its own copy of "
                f"the weights (engine.name='vllm' or 'vllm_server'): engine.name={self.engine_name!r} "
                "generates with the training model itself, so it cannot generate while the trainer trains; use "
                "max_staleness=0")

    @property
    def banned_token_ids(self) -> tuple[int, ...]:
        """Tokens the engine may never sample: a vision-language policy's image placeholders
        (:attr:`images`); none for a text model."""
        return () if self.images is None else self.images.banned_token_ids

    def check_image_column(self, image_field: Optional[str]) -> None:
        """Refuse a datamodule whose prompts hold images (``image_field``: its image column,
        :attr:`~lightning_grpo.data.source.DataPlan.image_field`) for a policy that is not a vision-language model
        (no :attr:`images`): checked at setup, before anything is sampled.

        Raises:
            ValueError: ``image_field`` is set and the policy has no image encoder (the column named).
        """
        if image_field is not None and self.images is None:
            raise ValueError(
                f"the datamodule's image column {image_field!r} (PromptDataModule(image_field={image_field!r})) puts "
                "images into the prompts, but the policy is not a vision-language model (it has no image processor): "
                "its images would be dropped. Train a vision-language checkpoint (docs/vision.md) or set "
                "image_field=None")

    def encode(self, prompts: Sequence[Any], rows: Optional[Sequence[Mapping[str, Any]]] = None) -> EncodedPrompts:
        """The prompts as one record: their ids and, with a vision-language policy's encoder, their images (never
        truncated through one; else :meth:`encode_prompts` with no images), and ``rows``, each prompt's dataset row
        (default an empty row per prompt).

        Raises:
            ValueError: as the encoder (a prompt that does not fit without cutting an image); without an image
                encoder (a causal LM), a prompt with an image part
                (:func:`~lightning_grpo.rollout.prompts.refuse_images`): its images would be dropped; ``rows`` not one
                per prompt.
        """
        if self.images is not None:
            encoded = self.images.encode_image_prompts(prompts, self.config.max_prompt_length)
            return EncodedPrompts.of(encoded.ids, rows, encoded.images, encoded.num_truncated)
        refuse_images(prompts)
        ids, truncated = self.encode_prompts(prompts)
        return EncodedPrompts.of(ids, rows, num_truncated=truncated)

    def encode_prompts(self, prompts: Sequence[Any]) -> tuple[list[list[int]], int]:
        """The prompts' token ids (:attr:`prompts`; single-turn: :func:`lightning_grpo.rollout.prompts.encode_prompts`,
        the chat template for message lists, exactly one BOS where the tokenizer uses one, left truncation to
        ``max_prompt_length``).

        Returns:
            ``(ids, num_truncated)``.
        """
        return self.prompts.encode_prompts(prompts, self.config.max_prompt_length)

    def sample(self, engine: RolloutEngine, prompts: EncodedPrompts, num_generations: int, sampling: SamplingConfig,
               collectives: Optional[Collectives] = None) -> RolloutOutput:
        """``num_generations`` completions of each of the encoded prompts (:meth:`encode`) by :attr:`sampler` (one
        ``engine.generate``, or the episodes of the turn loop); ``collectives``: the processes' agreement, on the
        trainer's thread only.

        Raises:
            ValueError: images for an engine that does not declare ``accepts_images`` (it would drop them; the engine
                named as it was given), before anything is sampled.
        """
        check_images_accepted(engine.capabilities.accepts_images, self._engine_type, prompts.images, len(prompts))
        any_process = None if collectives is None else collectives.any_process
        return self.sampler.sample(engine, prompts, num_generations, sampling, any_process)

    def sample_prompts(self, prompts: Sequence[Any], num_generations: int, sampling: SamplingConfig,
                       rows: Optional[Sequence[dict[str, Any]]] = None,
                       collectives: Optional[Collectives] = None) -> RolloutOutput:
        """Rollout from raw prompts (message lists or strings) with the engine's current weights: :meth:`encode`
        (``rows``: default, an empty row per prompt), then :meth:`sample`."""
        encoded = self.encode(prompts, rows)
        sampling = replace(sampling, banned_token_ids=tuple(sorted({*sampling.banned_token_ids,
                                                                     *self.banned_token_ids})))
        return self.sample(self.require_engine(), encoded, num_generations, sampling, collectives)

    def require_engine(self) -> RolloutEngine:
        if self.engine is None:
            raise RuntimeError("the rollout engine is not started: call RolloutWorker.start (GRPOModule.setup)")
        return self.engine

    def sync(self, policy: nn.Module, force: bool = False) -> None:
        """Push the policy's weights (:attr:`weights`, else ``policy``'s own) into the engine every
        ``engine.sync_every`` optimizer steps (always when ``force`` and they differ, and before the first rollout of
        an engine with its own weights). An engine whose ``capabilities.uses_policy_parameters`` (HF ``generate``, and
        the backends' wrappers of it, which refresh their own copy in ``wake_up``) generates with the current weights:
        nothing is pushed and no view of the weights is made (no LoRA merge, no gather), only the version moves. A
        streaming engine gets them in flight, stamped with the trainer's optimizer steps
        (``StreamingEngine.update_weights(weights, version=weights_version)``, :attr:`last_update`), so each token's
        version is the optimizer step whose weights sampled it."""
        engine = self.require_engine()
        behind = self.weights_version - self.engine_version
        if behind >= self.config.engine.sync_every or (force and behind > 0) or self.engine_version < 0:
            weights = self.weights if self.weights is not None else ModuleWeights(policy)
            if self._streaming is not None:
                self.last_update = self._streaming.streaming.update_weights(weights, version=self.weights_version)
            elif not engine.capabilities.uses_policy_parameters:
                engine.sync_weights(weights)
            self.engine_version = self.weights_version
            if self.events is not None:
                self.events(ON_WEIGHTS_SYNCED, self.engine_version)

    def prepare(self, policy: nn.Module, force_sync: bool = False, timer: Optional[StepTimer] = None,
                collectives: Optional[Collectives] = None) -> RolloutEngine:
        """Before a rollout: check ``policy``'s weights, wake the engine and sync its weights when due
        (:meth:`sync`); the wake-up and sync count as ``sync_s`` on ``timer``. Returns the engine.

        Raises:
            NonFiniteError: ``policy`` has a NaN or infinite weight (on any process, with ``collectives``, the
                data-parallel agreement): nothing is sampled from it.
        """
        engine = self.require_engine()
        check_finite_parameters(policy, "sampling a rollout", collectives)
        with (timer or StepTimer()).span("sync_s"):
            engine.wake_up()
            self.sync(policy, force_sync)
        return engine

    @contextlib.contextmanager
    def awake(self, policy: nn.Module, force_sync: bool = False, timer: Optional[StepTimer] = None,
              collectives: Optional[Collectives] = None) -> Iterator[RolloutEngine]:
        """:meth:`prepare` the engine, and put it to sleep on exit, so its accelerator memory is free while
        training (vLLM sleep mode, GPU only). Raises as :meth:`prepare`."""
        engine = self.prepare(policy, force_sync, timer, collectives)
        try:
            yield engine
        finally:
            engine.sleep(1)

    def mark_stale(self) -> None:
        """The trainer took an optimizer step: the engine's weights are one version older."""
        self.weights_version += 1
