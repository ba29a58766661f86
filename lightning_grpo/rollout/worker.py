"""The rollout worker: owns the rollout engine, the prompt encoding and the weight versions.

The trainer's weights change at every optimizer step (:meth:`RolloutWorker.mark_stale`); the engine gets them at
the next :meth:`RolloutWorker.awake` when ``vllm_sync_every`` steps have passed (always when forced, e.g. before
validation). The HF engine generates with the policy itself, so its sync is a no-op.

The worker's :class:`~lightning_grpo.rollout.base.StopFlag` (``stop``) is polled by its engine while it generates
(preemption: ``GRPOModule`` sets it to watch ``trainer.received_sigterm``), and the policy's weights are checked for
NaN/inf before every rollout (:func:`lightning_grpo.training.nonfinite.check_finite_parameters`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from typing import Any, Iterator, Optional, Sequence

from torch import nn
from transformers import PreTrainedTokenizerBase

from lightning_grpo.config import GRPOConfig
from lightning_grpo.events import ON_WEIGHTS_SYNCED, EventSink
from lightning_grpo.rollout.base import RolloutEngine, RolloutOutput, SamplingConfig, StopFlag
from lightning_grpo.rollout.engines.hf import HFRolloutEngine
from lightning_grpo.rollout.engines.hf_weights import merged_state_dict
from lightning_grpo.rollout.engines.kv_cache import rollout_kv_cache_bytes
from lightning_grpo.rollout.engines.remote import VLLMServerEngine
from lightning_grpo.rollout.engines.vllm import VLLMRolloutEngine
from lightning_grpo.rollout.prompts import encode_prompts
from lightning_grpo.training.nonfinite import AnyProcess, check_finite_parameters

log = logging.getLogger(__name__)


def make_engine(config: GRPOConfig, policy: nn.Module, tokenizer: PreTrainedTokenizerBase,
                model_path: Optional[str], stop: Optional[StopFlag] = None,
                rollout_prompts: Optional[int] = None) -> RolloutEngine:
    """The rollout engine ``config.rollout_engine`` names: ``"hf"`` (generates with ``policy``; with a PEFT policy,
    with its transformers model, whose layers carry the adapters), ``"vllm"`` (a colocated engine loaded from
    ``model_path``; an ``nn.Module`` given without a folder is saved to a temporary one first, LoRA merged: its
    weights follow by ``sync_weights``) or ``"vllm_server"`` (the rollout servers at ``vllm_server_urls``, which
    get the weights by ``sync_weights``); both sample with per-request seeds. ``stop``: the flag the engine polls
    while it generates; ``rollout_prompts``: prompts per rollout (sizes ``vllm_kv_cache_space_gib="auto"``)."""
    model = policy.get_base_model() if callable(getattr(policy, "get_base_model", None)) else policy
    if config.rollout_engine == "vllm_server":
        return VLLMServerEngine(config.vllm_server_urls, tokenizer, timeout_s=config.vllm_server_timeout,
                                group_host=config.vllm_server_group_host, group_port=config.vllm_server_group_port,
                                weight_sync_check=config.weight_sync_check, stop=stop)
    if config.rollout_engine != "vllm":
        return HFRolloutEngine(model, tokenizer, stop=stop)
    path = model_path
    if path is None or not os.path.isdir(path):
        path = tempfile.mkdtemp(prefix="lightning_grpo_vllm_")
        model.config.save_pretrained(path)
        model.save_pretrained(path, state_dict=merged_state_dict(policy) if model is not policy else None)
        tokenizer.save_pretrained(path)
    dtype = next(policy.parameters()).dtype
    return VLLMRolloutEngine(
        path,
        gpu_memory_utilization=config.vllm_gpu_memory_utilization,
        kv_cache_space_gib=kv_cache_space_gib(config, model.config, dtype.itemsize, rollout_prompts),
        max_model_len=config.max_prompt_length + max(config.max_new_tokens, config.eval_max_new_tokens or 0),
        enable_sleep_mode=config.vllm_enable_sleep_mode,
        dtype=str(dtype).removeprefix("torch."),
        stop=stop,
    )


def kv_cache_space_gib(config: GRPOConfig, model_config: Any, dtype_bytes: int,
                       rollout_prompts: Optional[int]) -> float:
    """``vllm_kv_cache_space_gib``; "auto": one rollout's sequences at their longest
    (:func:`lightning_grpo.rollout.engines.kv_cache.rollout_kv_cache_bytes`), 2 GiB when the prompts per rollout are
    unknown."""
    if config.vllm_kv_cache_space_gib != "auto":
        return float(config.vllm_kv_cache_space_gib)
    if rollout_prompts is None:
        log.info("vllm_kv_cache_space_gib='auto' without the prompts per rollout: 2 GiB")
        return 2.0
    tokens = config.max_prompt_length + max(config.max_new_tokens, config.eval_max_new_tokens or 0)
    size = rollout_kv_cache_bytes(model_config, dtype_bytes, rollout_prompts * config.num_generations, tokens) / 2**30
    log.info("vllm_kv_cache_space_gib='auto': %.3f GiB for %d sequences of %d tokens", size,
             rollout_prompts * config.num_generations, tokens)
    return size


class RolloutWorker:
    """The engine's lifecycle (make, wake, sync, sleep), prompt encoding and weight versions.

    Args:
        config: the algorithm settings (``rollout_engine``, ``max_prompt_length``, ``vllm_sync_every``, ...).
        tokenizer: the policy's tokenizer (chat template for message-list prompts).
        events: called as ``events("on_weights_synced", weights_version)`` after each sync
            (:mod:`lightning_grpo.events`).

    Attributes:
        engine: the rollout engine, None before :meth:`start` (a backend may replace it with a wrapper).
        weights_version: optimizer steps taken so far (the trainer's ``global_step``; ``GRPOModule`` sets it when
            training starts, also after a resume).
        engine_version: the ``weights_version`` the engine generates with (-1: not yet synced).
        stop: the stop request the engine polls while generating (a stopped rollout raises
            :class:`~lightning_grpo.rollout.base.RolloutInterrupted`).
    """

    def __init__(self, config: GRPOConfig, tokenizer: PreTrainedTokenizerBase,
                 events: Optional[EventSink] = None) -> None:
        self.config = config
        self.events = events
        self.tokenizer = tokenizer
        self.engine: Optional[RolloutEngine] = None
        self.weights_version = 0
        self.engine_version = 0
        self.stop = StopFlag()

    def start(self, policy: nn.Module, model_path: Optional[str], rollout_prompts: Optional[int] = None) -> None:
        """Make the engine once (idempotent). A vLLM engine gets the policy's weights before its first rollout
        (they may differ from ``model_path``'s, e.g. after a resume). ``rollout_prompts``: see :func:`make_engine`."""
        if self.engine is None:
            self.engine = make_engine(self.config, policy, self.tokenizer, model_path, stop=self.stop,
                                      rollout_prompts=rollout_prompts)
            if self.config.rollout_engine in ("vllm", "vllm_server"):
                self.engine_version = -1

    def tokenize(self, prompts: Sequence[Any]) -> tuple[list[list[int]], int]:
        """Encode prompts (:func:`lightning_grpo.rollout.prompts.encode_prompts`: chat template for message lists,
        exactly one BOS where the tokenizer uses one, left truncation to ``max_prompt_length``).

        Returns:
            ``(ids, num_truncated)``.
        """
        return encode_prompts(self.tokenizer, prompts, self.config.max_prompt_length)

    def generate(self, prompts: Sequence[Any], num_generations: int, sampling: SamplingConfig) -> RolloutOutput:
        """Rollout with the engine's current weights: prompts (message lists or strings) -> ``RolloutOutput``."""
        ids, _ = self.tokenize(prompts)
        return self.require_engine().generate(ids, num_generations, sampling)

    def require_engine(self) -> RolloutEngine:
        if self.engine is None:
            raise RuntimeError("the rollout engine is not started: call RolloutWorker.start (GRPOModule.setup)")
        return self.engine

    def sync(self, policy: nn.Module, force: bool = False) -> None:
        """Push ``policy``'s weights into the engine every ``vllm_sync_every`` optimizer steps (always when
        ``force`` and they differ, and before the first rollout of a vLLM engine)."""
        engine = self.require_engine()
        behind = self.weights_version - self.engine_version
        if behind >= self.config.vllm_sync_every or (force and behind > 0) or self.engine_version < 0:
            engine.sync_weights(policy)
            self.engine_version = self.weights_version
            if self.events is not None:
                self.events(ON_WEIGHTS_SYNCED, self.engine_version)

    @contextlib.contextmanager
    def awake(self, policy: nn.Module, force_sync: bool = False, timer: Any = None,
              any_process: Optional[AnyProcess] = None) -> Iterator[RolloutEngine]:
        """Wake the engine and sync its weights when due (:meth:`sync`); put it to sleep on exit, so its
        accelerator memory is free while training (vLLM sleep mode, GPU only). With a ``timer``
        (:class:`lightning_grpo.training.metrics.StepTimer`) the wake-up and sync count as ``sync_s``.

        Raises:
            NonFiniteError: ``policy`` has a NaN or infinite weight (on any process, with ``any_process``, the
                data-parallel agreement): nothing is sampled from it.
        """
        engine = self.require_engine()
        check_finite_parameters(policy, "sampling a rollout", any_process)
        with timer.span("sync_s") if timer is not None else contextlib.nullcontext():
            engine.wake_up()
            self.sync(policy, force_sync)
        try:
            yield engine
        finally:
            engine.sleep(1)

    def mark_stale(self) -> None:
        """The trainer took an optimizer step: the engine's weights are one version older."""
        self.weights_version += 1
