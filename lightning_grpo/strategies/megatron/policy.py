"""The policy as a megatron-core ``GPTModel``, wrapped with the interface :class:`lightning_grpo.GRPOModule` uses.

:class:`MegatronPolicy` replaces ``GRPOModule.policy`` under
:class:`lightning_grpo.strategies.megatron.strategy.MegatronStrategy`: ``GRPOModule.completion_logprobs`` dispatches to
:meth:`MegatronPolicy.completion_logprobs` (vocab-parallel, no full-vocabulary gather; with pipeline parallelism a
forward-only pipeline schedule whose result every stage gets), and the HF model it was converted from is kept
(outside the module tree, so neither optimized nor checkpointed twice) as the rollout/export copy that
:meth:`MegatronPolicy.sync_hf_model` refreshes from the trained weights. :class:`MegatronWeights` streams its weights
in HF names to the engines that load them by name (colocated vLLM, the rollout servers), gathered one tensor at a
time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence, cast

import torch
from torch import Tensor, nn

from lightning_grpo.models.hf_weights import lora_layers
from lightning_grpo.protocols.weights import PolicyWeights
from lightning_grpo.strategies.megatron.convert import current_stage, iter_hf_weights, load_hf_state_dict, param_maps
from lightning_grpo.strategies.megatron.experts import ExpertRanks
from lightning_grpo.strategies.megatron.model import Architecture, StageLayout, build_gpt_model
from lightning_grpo.strategies.megatron.pipeline import causal_mask, run_schedule, stage_forward
from lightning_grpo.strategies.megatron.replay import RoutingReplay
from lightning_grpo.strategies.megatron.vocab_parallel import vocab_parallel_logprobs


def _padding_idx_hook(padding_idx: int) -> Any:
    """A forward hook for megatron-core's ``VocabParallelEmbedding`` that gives its ``padding_idx`` row no gradient
    from input lookups, as ``nn.Embedding(padding_idx=...)`` in the HF model does (SmolLM2's pad token is its
    ``<|im_end|>``, which also occurs inside prompts). Output ``(B, S, H)`` is unchanged in value."""

    def hook(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        is_pad = (args[0] == padding_idx).unsqueeze(-1)  # [B, S, 1]
        return torch.where(is_pad, output.detach(), output)

    return hook


def _mark_tensor_parallel(model: nn.Module, arch: Architecture, stage: StageLayout, experts: ExpertRanks) -> None:
    """Set megatron-core's ``tensor_model_parallel`` / ``partition_dim`` attributes on every parameter (megatron-core
    only sets them when it initialises the weights itself, which :func:`build_gpt_model` skips): True for
    parameters split over TP ranks (expert-TP ranks for an expert), False for replicated ones (the RMSNorm weights,
    the router). An expert's weights get megatron-core's ``allreduce = False`` when the experts are split over ranks
    (EP x ETP > 1): their gradients are reduced over the expert-data-parallel group, not the data-parallel one
    (megatron-core sets it itself only for EP > 1)."""
    params = dict(model.named_parameters())
    transformer_engine = any(name.endswith("layer_norm_weight") for name in params)
    for pm in param_maps(arch, transformer_engine, stage):
        for name, _ in pm.local(experts):
            param = params[name]
            param.tensor_model_parallel = pm.kind != "replicated"
            param.partition_dim = 1 if pm.kind == "row" else 0 if pm.kind != "replicated" else -1
            param.partition_stride = 1
            if pm.experts:
                param.allreduce = not experts.partitioned


class MegatronPolicy(nn.Module):
    """A megatron-core ``GPTModel`` (this rank's tensor-parallel shard of its pipeline stage) converted from an HF
    causal LM.

    Args:
        model: the ``GPTModel`` (see :func:`lightning_grpo.strategies.megatron.model.build_gpt_model`).
        arch: its architecture.
        hf_model: the HF model it mirrors (rollouts, export); not registered as a submodule.
        stage: the pipeline stage ``model`` is (default: megatron-core's ``parallel_state``).
        replay_routing: replay the routing a batch carries (a mixture of experts: the rollout's
            ``prompt_routed_experts`` / ``completion_routed_experts``, :mod:`~lightning_grpo.strategies.megatron.
            replay`); False routes live.
        experts: where this rank is among the expert-parallel ranks (default: megatron-core's ``parallel_state``).

    Attributes:
        ddp: megatron-core's ``DistributedDataParallel`` wrapper of ``model`` (its gradient buffers, for the
            distributed optimizer), or None; outside the module tree. The training schedule runs through it.
        replay: the routers' :class:`~lightning_grpo.strategies.megatron.replay.RoutingReplay` (a mixture of experts
            with ``replay_routing``), else None.

    Use :meth:`from_hf` to build one.
    """

    def __init__(self, model: nn.Module, arch: Architecture, hf_model: Optional[nn.Module] = None,
                 stage: Optional[StageLayout] = None, replay_routing: bool = False,
                 experts: Optional[ExpertRanks] = None) -> None:
        super().__init__()
        self.model = model
        self.arch = arch
        self.stage = stage or current_stage(arch)
        self.experts = experts or ExpertRanks.current()
        self.replay: Optional[RoutingReplay] = None
        if replay_routing and arch.moe is not None:
            self.replay = RoutingReplay(model, arch, self.stage, model.config.recompute_granularity == "full")
        self._hf: list[nn.Module] = [hf_model] if hf_model is not None else []
        self._ddp: list[nn.Module] = []
        self._updates = 0  # optimizer steps taken (MegatronStrategy counts them: see mark_updated)
        self._hf_fingerprint: Optional[int] = self._fingerprint() if hf_model is not None else None
        self._hf_loaded = hf_model is not None
        if arch.padding_idx is not None and self.stage.pre_process:
            model.embedding.word_embeddings.register_forward_hook(_padding_idx_hook(arch.padding_idx))
        _mark_tensor_parallel(model, arch, self.stage, self.experts)

    @classmethod
    def from_hf(
        cls,
        hf_model: nn.Module,
        tensor_model_parallel_size: int = 1,
        params_dtype: Optional[torch.dtype] = None,
        use_transformer_engine: bool = False,
        replay_routing: bool = False,
        **config_overrides: Any,
    ) -> "MegatronPolicy":
        """Build this rank's ``GPTModel`` for ``hf_model.config`` and load its weights (on CPU).

        ``megatron.core.parallel_state`` must be initialised with the same TP size (and EP, ETP sizes for a mixture
        of experts); on CPU the :mod:`lightning_grpo.strategies.megatron.cpu_shims` must be applied.

        Args:
            hf_model: a transformers Llama / Qwen2 / Qwen3-MoE / Mixtral causal LM.
            tensor_model_parallel_size: TP size.
            params_dtype: dtype of the megatron-core weights (default: the HF model's).
            use_transformer_engine: use the Transformer Engine layer spec (CUDA only).
            replay_routing: replay the routing the scored batches carry (see the class).
            config_overrides: other ``TransformerConfig`` fields.

        Raises:
            ValueError: unsupported architecture or TP size (see
                :meth:`lightning_grpo.strategies.megatron.model.Architecture.from_hf_config`); a PEFT LoRA model
                (``GRPOModule(lora=...)`` under ``MegatronStrategy``).
        """
        if lora_layers(hf_model):
            raise ValueError("GRPOModule(lora=...) is not supported with MegatronStrategy: the policy is converted to "
                             "megatron-core layers, which carry no PEFT adapters; use strategy='grpo_fsdp2', 'ddp' "
                             "or a single device")
        arch = Architecture.from_hf_config(hf_model.config)
        dtype = params_dtype or next(hf_model.parameters()).dtype
        stage, experts = current_stage(arch), ExpertRanks.current()
        model = build_gpt_model(arch, tensor_model_parallel_size, dtype, use_transformer_engine, stage=stage,
                                experts=experts, **config_overrides)
        load_hf_state_dict(model, hf_model.state_dict(), arch, stage=stage, experts=experts)
        return cls(model, arch, hf_model, stage, replay_routing, experts)

    @property
    def ddp(self) -> Optional[nn.Module]:
        return self._ddp[0] if self._ddp else None

    def set_ddp(self, wrapper: Optional[nn.Module]) -> None:
        """Set :attr:`ddp` (kept outside the module tree: ``nn.Module.__setattr__`` would register it)."""
        self._ddp = [wrapper] if wrapper is not None else []

    @property
    def schedule_model(self) -> nn.Module:
        """What the forward-backward schedules run: the DDP wrapper when there is one, else the ``GPTModel``."""
        return self.ddp if self.ddp is not None else self.model

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: Tensor) -> Tensor:
        """Vocab-parallel logits of unpadded causal sequences.

        Args:
            input_ids: ``(B, S)`` long token ids (every row a real sequence from position 0).

        Returns:
            ``(B, S, V / TP)`` logits of this rank's vocabulary slice (dtype of the weights).
        """
        return self.model(input_ids, None, causal_mask(input_ids.shape[1], input_ids.device))

    def completion_logprobs(
        self, batch: Any, temperature: float = 1.0, with_entropy: bool = False
    ) -> tuple[Tensor, Optional[Tensor]]:
        """Per-token logprobs of ``batch.completion_ids`` (as ``GRPOModule.completion_logprobs``).

        Each row's prompt (left-padded in ``batch``) is moved to start at position 0, followed by its
        completion, so positions and the causal mask are those of the unpadded sequence, as in the HF path
        with ``position_ids = cumsum(attention_mask) - 1`` (:func:`~lightning_grpo.strategies.megatron.pipeline.
        sequence_layout`). Only the hidden states of the positions that predict completion tokens go through the
        output layer. With pipeline parallelism (PP > 1) this is a forward-only pipeline schedule (no grad; the
        training step goes through ``MegatronStrategy.train_step``) whose result every stage returns: a
        collective over the model-parallel group (and the expert groups for a mixture of experts, whose routers
        replay the batch's recorded routing when :attr:`replay` is set).

        Args:
            batch: an :class:`lightning_grpo.training.experience.Experience` (``prompt_ids``/``prompt_mask`` ``(B, P)``,
                left-padded; ``completion_ids`` ``(B, T)``).
            temperature: the sampling temperature.
            with_entropy: also return the per-token entropy (no grad).

        Returns:
            ``(B, T)`` float32 logprobs and ``(B, T)`` float32 entropy or None; positions after a row's EOS
            hold values for the padding tokens there (masked by the caller).

        Raises:
            ValueError: a row has an empty prompt.
            RuntimeError: PP > 1 with grad enabled.
        """
        if self.stage.pp_size > 1:
            if torch.is_grad_enabled():
                raise RuntimeError("MegatronPolicy.completion_logprobs with pipeline parallelism runs forward only "
                                   "(no grad): train through MegatronStrategy.train_step")
            (payload,) = run_schedule(self.model, [batch], temperature, with_entropy=with_entropy,
                                      replay=self.replay)
            return payload["logprobs"], payload["entropy"]
        if self.replay is not None:
            self.replay.clear()
        logits = stage_forward(self.model, batch, self.replay)  # [B, T, V/TP]
        return vocab_parallel_logprobs(logits, batch.completion_ids, temperature, with_entropy=with_entropy)

    @torch.no_grad()
    def teacher_forced_logprobs(self, sequences: Sequence[Sequence[int]]) -> Tensor:
        """``(S, L - 1)`` float32 CPU logprobs of each token of the ``S`` equal-length sequences given the ones
        before it (temperature 1, untruncated, the full vocabulary): the rollout server's post-sync probe, scored
        by the trained shards. A collective over the model-parallel group."""
        device = next(self.model.parameters()).device
        ids = torch.tensor([list(s) for s in sequences], dtype=torch.long, device=device)  # [S, L]
        probe = _Probe(ids[:, :1], torch.ones_like(ids[:, :1]), ids[:, 1:])
        was_training = self.model.training
        self.model.eval()
        try:
            logprobs, _ = self.completion_logprobs(probe, temperature=1.0)
        finally:
            self.model.train(was_training)
        return logprobs.float().cpu()

    # ------------------------------------------------------------- HF weights
    @property
    def hf_model(self) -> Optional[nn.Module]:
        """The HF model this policy mirrors (rollouts, export), or None."""
        return self._hf[0] if self._hf else None

    @property
    def config(self) -> Any:
        """The HF config (``None`` without an HF model)."""
        return getattr(self.hf_model, "config", None)

    def iter_hf_weights(self) -> Iterator[tuple[str, Tensor]]:
        """``(hf_name, full_tensor)`` pairs of the current weights, ``lm_head.weight`` (the embedding's value) last
        when the embeddings are tied (a model-parallel collective, see
        :func:`lightning_grpo.strategies.megatron.convert.iter_hf_weights`)."""
        return iter_hf_weights(self.model, self.arch)

    @torch.no_grad()
    def sync_hf_model(self, load: bool = True) -> None:
        """Gather the current weights into HF format and copy them into :attr:`hf_model`, one parameter at a
        time. A collective over the TP group: every TP rank must call it; with ``load=False`` this rank takes
        part in the gathers but does not update its HF model (e.g. a TP rank that does not generate); the
        weights then count as synced for :meth:`hf_model_is_current` but :meth:`save_pretrained` refuses.

        Raises:
            RuntimeError: there is no HF model.
        """
        hf = self.hf_model
        if hf is None:
            raise RuntimeError("MegatronPolicy has no HF model to sync into")
        target = hf.state_dict()
        for name, value in self.iter_hf_weights():
            if load and name in target:
                target[name].copy_(value)
        self._hf_fingerprint = self._fingerprint()
        self._hf_loaded = load

    def hf_model_holds_weights(self) -> bool:
        """Whether :attr:`hf_model` holds the current weights on this rank (:meth:`hf_model_is_current` and loaded
        by the last :meth:`sync_hf_model`): it can be exported and handed back."""
        return self.hf_model_is_current() and self._hf_loaded

    def hf_model_is_current(self) -> bool:
        """Whether :attr:`hf_model` holds the current weights (no in-place update of any megatron-core
        parameter since the last :meth:`sync_hf_model`)."""
        return self._hf_fingerprint is not None and self._hf_fingerprint == self._fingerprint()

    def save_pretrained(self, path: str, **kwargs: Any) -> None:
        """Save :attr:`hf_model` with ``save_pretrained`` (called by ``GRPOModule.on_fit_end`` on rank 0).

        Raises:
            RuntimeError: the HF model is stale: :meth:`sync_hf_model` (a collective) was not called on every
                rank after the last weight update. ``MegatronStrategy.on_train_end`` calls it.
        """
        if not self.hf_model_holds_weights():
            raise RuntimeError(
                "MegatronPolicy.hf_model is stale: call sync_hf_model() on every rank before save_pretrained"
            )
        assert self.hf_model is not None
        self.hf_model.save_pretrained(path, **kwargs)

    def mark_updated(self) -> None:
        """An optimizer step changed the weights (also those written into by collectives, which leave the
        parameters' version counters alone: the distributed optimizer's all-gather)."""
        self._updates += 1

    def _fingerprint(self) -> int:
        """Sum of the parameters' in-place version counters (optimizers update weights in place) and of the steps
        counted by :meth:`mark_updated`."""
        return sum(p._version for p in self.model.parameters()) + self._updates


class MegatronWeights(PolicyWeights):
    """A :class:`MegatronPolicy`'s weights as the engines read them: HF names, gathered from its tensor- and
    pipeline-parallel shards one tensor at a time (a mixture's experts over the expert-TP and expert-parallel groups
    into transformers' stacked ``mlp.experts.*`` tensors) (:meth:`MegatronPolicy.iter_hf_weights`; ``lm_head.weight``
    with the embedding's value when tied), and the probe scored by the shards (:meth:`MegatronPolicy.
    teacher_forced_logprobs`). Both are collectives over the policy's model-parallel group (and its expert groups):
    every rank reads them.
    """

    def __init__(self, policy: MegatronPolicy) -> None:
        self.policy = policy

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        return self.policy.iter_hf_weights()

    def probe_logprobs(self, sequences: Sequence[Sequence[int]]) -> Tensor:
        return self.policy.teacher_forced_logprobs(sequences)

    @property
    def vocab_size(self) -> int:
        return self.policy.arch.vocab_size

    @property
    def separate_head(self) -> bool:
        """An untied checkpoint's ``output_layer`` is the policy's own head."""
        return not self.policy.arch.tie_word_embeddings

    @property
    def collective(self) -> bool:
        return True

    @property
    def device(self) -> torch.device:
        return next(self.policy.model.parameters()).device


def score_completions(model: nn.Module, batch: Any, temperature: float,
                      with_entropy: bool) -> tuple[Tensor, Optional[Tensor]]:
    """The Megatron backend's :class:`~lightning_grpo.training.logprobs.CompletionScorer`: ``model`` (the policy, the
    reference policy or the distillation teacher, each a :class:`MegatronPolicy`) scores the completions itself,
    vocab-parallel (:meth:`MegatronPolicy.completion_logprobs`)."""
    return cast(MegatronPolicy, model).completion_logprobs(batch, temperature, with_entropy=with_entropy)


@dataclass
class _Probe:
    """The fields of an Experience that :meth:`MegatronPolicy.completion_logprobs` reads."""

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor

    def __len__(self) -> int:
        return self.completion_ids.shape[0]
