"""The policy as a megatron-core ``GPTModel``, wrapped with the interface :class:`lightning_grpo.GRPOModule` uses.

:class:`MegatronPolicy` replaces ``GRPOModule.policy`` under
:class:`lightning_grpo.strategies.megatron.strategy.MegatronStrategy`: ``GRPOModule.completion_logprobs`` dispatches to
:meth:`MegatronPolicy.completion_logprobs` (vocab-parallel, no full-vocabulary gather), and the HF model it
was converted from is kept (outside the module tree, so neither optimized nor checkpointed twice) as the
rollout/export copy that :meth:`MegatronPolicy.sync_hf_model` refreshes from the trained weights.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
from torch import Tensor, nn

from lightning_grpo.rollout.engines.hf_weights import lora_layers
from lightning_grpo.strategies.megatron.convert import iter_hf_weights, load_hf_state_dict, param_maps
from lightning_grpo.strategies.megatron.logprobs import vocab_parallel_logprobs
from lightning_grpo.strategies.megatron.model import Architecture, build_gpt_model


def causal_mask(length: int, device: torch.device) -> Tensor:
    """megatron-core's attention mask for a causal sequence: ``(1, 1, S, S)`` bool, True where a query may
    NOT attend (keys after it)."""
    return torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), diagonal=1)[None, None]


def _padding_idx_hook(padding_idx: int) -> Any:
    """A forward hook for megatron-core's ``VocabParallelEmbedding`` that gives its ``padding_idx`` row no gradient
    from input lookups, as ``nn.Embedding(padding_idx=...)`` in the HF model does (SmolLM2's pad token is its
    ``<|im_end|>``, which also occurs inside prompts). Output ``(B, S, H)`` is unchanged in value."""

    def hook(module: nn.Module, args: tuple, output: Tensor) -> Tensor:
        is_pad = (args[0] == padding_idx).unsqueeze(-1)  # [B, S, 1]
        return torch.where(is_pad, output.detach(), output)

    return hook


def _mark_tensor_parallel(model: nn.Module, arch: Architecture) -> None:
    """Set megatron-core's ``tensor_model_parallel`` / ``partition_dim`` attributes on every parameter (megatron-core
    only sets them when it initialises the weights itself, which :func:`build_gpt_model` skips): True for
    parameters split over TP ranks, False for replicated ones (the RMSNorm weights)."""
    params = dict(model.named_parameters())
    transformer_engine = any(name.endswith("layer_norm_weight") for name in params)
    for pm in param_maps(arch, transformer_engine):
        param = params[pm.mcore]
        param.tensor_model_parallel = pm.kind != "replicated"
        param.partition_dim = 1 if pm.kind == "row" else 0 if pm.kind != "replicated" else -1
        param.partition_stride = 1


class MegatronPolicy(nn.Module):
    """A megatron-core ``GPTModel`` (this rank's tensor-parallel shard) converted from an HF causal LM.

    Args:
        model: the ``GPTModel`` (see :func:`lightning_grpo.strategies.megatron.model.build_gpt_model`).
        arch: its architecture.
        hf_model: the HF model it mirrors (rollouts, export); not registered as a submodule.

    Use :meth:`from_hf` to build one.
    """

    def __init__(self, model: nn.Module, arch: Architecture, hf_model: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.model = model
        self.arch = arch
        self._hf: list[nn.Module] = [hf_model] if hf_model is not None else []
        self._hf_fingerprint: Optional[int] = self._fingerprint() if hf_model is not None else None
        self._hf_loaded = hf_model is not None
        if arch.padding_idx is not None:
            model.embedding.word_embeddings.register_forward_hook(_padding_idx_hook(arch.padding_idx))
        _mark_tensor_parallel(model, arch)

    @classmethod
    def from_hf(
        cls,
        hf_model: nn.Module,
        tensor_model_parallel_size: int = 1,
        params_dtype: Optional[torch.dtype] = None,
        use_transformer_engine: bool = False,
        **config_overrides: Any,
    ) -> "MegatronPolicy":
        """Build this rank's ``GPTModel`` for ``hf_model.config`` and load its weights (on CPU).

        ``megatron.core.parallel_state`` must be initialised with the same TP size; on CPU the
        :mod:`lightning_grpo.strategies.megatron.cpu_shims` must be applied.

        Args:
            hf_model: a transformers Llama / Qwen2 causal LM.
            tensor_model_parallel_size: TP size.
            params_dtype: dtype of the megatron-core weights (default: the HF model's).
            use_transformer_engine: use the Transformer Engine layer spec (CUDA only).
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
        model = build_gpt_model(arch, tensor_model_parallel_size, dtype, use_transformer_engine, **config_overrides)
        load_hf_state_dict(model, hf_model.state_dict(), arch)
        return cls(model, arch, hf_model)

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
        with ``position_ids = cumsum(attention_mask) - 1``. Only the hidden states of the positions that
        predict completion tokens go through the output layer.

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
        """
        prompt_ids, prompt_mask, completion_ids = batch.prompt_ids, batch.prompt_mask, batch.completion_ids
        b, p = prompt_ids.shape
        t = completion_ids.shape[1]
        prompt_lengths = prompt_mask.sum(dim=1)  # [B]
        if (prompt_lengths == 0).any():
            raise ValueError(f"rows {(prompt_lengths == 0).nonzero().flatten().tolist()} have an empty prompt")
        combined = torch.cat([prompt_ids, completion_ids], dim=1)  # [B, P+T]
        offset = (p - prompt_lengths).unsqueeze(1)  # [B, 1] left padding of each row
        source = (torch.arange(p + t, device=combined.device).unsqueeze(0) + offset).clamp(max=p + t - 1)
        tokens = combined.gather(1, source)  # [B, P+T]: prompt from position 0, then completion, then filler
        predicting = (prompt_lengths - 1).unsqueeze(1) + torch.arange(t, device=combined.device)  # [B, T]

        def keep_predicting_positions(module: nn.Module, args: tuple) -> tuple:
            hidden = args[0]  # [S, B, H]
            index = predicting.t().unsqueeze(-1).expand(t, b, hidden.shape[-1])  # [T, B, H]
            return (hidden.gather(0, index),) + tuple(args[1:])

        handle = self.model.output_layer.register_forward_pre_hook(keep_predicting_positions)
        try:
            logits = self.forward(tokens)  # [B, T, V/TP]
        finally:
            handle.remove()
        return vocab_parallel_logprobs(logits, completion_ids, temperature, with_entropy=with_entropy)

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
        """``(hf_name, full_tensor)`` pairs of the current weights (a TP collective, see
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
        if not (self.hf_model_is_current() and self._hf_loaded):
            raise RuntimeError(
                "MegatronPolicy.hf_model is stale: call sync_hf_model() on every rank before save_pretrained"
            )
        assert self.hf_model is not None
        self.hf_model.save_pretrained(path, **kwargs)

    def _fingerprint(self) -> int:
        """Sum of the parameters' in-place version counters (optimizers update weights in place)."""
        return sum(p._version for p in self.model.parameters())
