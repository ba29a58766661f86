"""A Hugging Face Llama-family config -> a megatron-core ``GPTModel`` with the same architecture.

Supported: ``LlamaForCausalLM`` (Llama 2/3 without RoPE scaling, SmolLM2, TinyLlama, ...) and
``Qwen2ForCausalLM`` (qkv bias, no sliding window): pre-norm RMSNorm, SwiGLU MLP, RoPE (rotate-half, base
``rope_theta``), grouped-query attention, tied or untied embeddings; and the mixtures of experts
``Qwen3MoeForCausalLM`` (per-head q/k RMSNorm, top-k softmax routing) and ``MixtralForCausalLM``
(:mod:`lightning_grpo.strategies.megatron.experts`). Anything else raises a ``ValueError`` naming the field, rather
than building a model that silently computes something else.

The layer spec is megatron-core's local one (``get_gpt_layer_local_spec``: plain torch modules, runs on CPU
and GPU); :func:`build_gpt_model` uses the Transformer Engine spec only when asked to
(``use_transformer_engine=True``), which needs CUDA and ``transformer_engine``.

Pipeline parallelism (PP): :func:`stage_layout` splits the ``L`` layers evenly over the ``PP`` stages (stage ``s``
holds global layers ``[s L/PP, (s+1) L/PP)``, which megatron-core names ``decoder.layers.0 .. L/PP - 1`` locally);
the first stage also holds the embedding, the last the final norm and the output layer (with tied embeddings and
PP > 1 a copy of the embedding, kept equal by summing the two gradients, megatron-core's scheme).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from lightning_grpo.strategies.megatron.experts import (
    MOE_MODEL_TYPES,
    ExpertRanks,
    MoE,
    moe_from_hf_config,
    moe_layer_spec,
    moe_settings,
)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", *MOE_MODEL_TYPES)


@dataclass(frozen=True)
class Architecture:
    """The architecture numbers that the HF <-> megatron-core conversion needs.

    Attributes:
        model_type: "llama", "qwen2", "qwen3_moe" or "mixtral".
        vocab_size: rows of the embedding and the output layer (V).
        hidden_size: H.
        ffn_hidden_size: the SwiGLU inner size F (HF ``intermediate_size``).
        num_layers: transformer layers.
        num_attention_heads: query heads.
        num_query_groups: key/value heads (GQA groups; HF ``num_key_value_heads``).
        head_dim: per-head size d (HF ``head_dim``, default H / heads).
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: RoPE base.
        max_position_embeddings: the longest sequence the model is built for.
        tie_word_embeddings: the output layer reuses the input embedding.
        qkv_bias: q/k/v projections have biases (Qwen2).
        padding_idx: the HF embedding's ``padding_idx`` (``config.pad_token_id``): transformers builds
            ``nn.Embedding(V, H, padding_idx)``, whose row gets no gradient from input lookups (it still gets
            one through a tied output layer). None when the config has no pad token.
        qk_layernorm: RMSNorm over each query and key head before RoPE (Qwen3-MoE's ``q_norm``/``k_norm``).
        moe: the mixture of experts (Qwen3-MoE, Mixtral), or None for a dense model.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    padding_idx: Optional[int] = None
    qk_layernorm: bool = False
    moe: Optional[MoE] = None

    @property
    def heads_per_group(self) -> int:
        """Query heads per key/value head."""
        return self.num_attention_heads // self.num_query_groups

    @classmethod
    def from_hf_config(cls, config: Any) -> "Architecture":
        """Read a ``transformers`` ``LlamaConfig`` / ``Qwen2Config`` / ``Qwen3MoeConfig`` / ``MixtralConfig``.

        Raises:
            ValueError: an unsupported model type or feature (activation, RoPE scaling, sliding window,
                attention/MLP biases of Llama and Qwen3-MoE, see also
                :func:`~lightning_grpo.strategies.megatron.experts.moe_from_hf_config`), named with its value.
        """
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.model_type={model_type!r}: Megatron conversion supports {SUPPORTED_MODEL_TYPES}")
        if config.hidden_act != "silu":
            raise ValueError(f"config.hidden_act={config.hidden_act!r}: only 'silu' (SwiGLU) is supported")
        rope = getattr(config, "rope_parameters", None) or {}
        rope_theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        legacy_scaling = getattr(config, "rope_scaling", None)
        if rope_type != "default" or (legacy_scaling and legacy_scaling.get("rope_type", "default") != "default"):
            raise ValueError(
                f"config.rope_parameters={rope or legacy_scaling!r}: only unscaled RoPE ('default') is supported"
            )
        if rope_theta is None:
            raise ValueError(
                "config has no rope_theta (neither config.rope_parameters['rope_theta'] nor config.rope_theta)"
            )
        _check_attention(config, model_type)
        heads = int(config.num_attention_heads)
        groups = int(getattr(config, "num_key_value_heads", None) or heads)
        if heads % groups != 0:
            raise ValueError(f"config.num_attention_heads={heads} is not a multiple of num_key_value_heads={groups}")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            model_type=model_type,
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            ffn_hidden_size=int(config.intermediate_size),
            num_layers=int(config.num_hidden_layers),
            num_attention_heads=heads,
            num_query_groups=groups,
            head_dim=int(head_dim),
            rms_norm_eps=float(config.rms_norm_eps),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(config.max_position_embeddings),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
            padding_idx=getattr(config, "pad_token_id", None),
            qk_layernorm=model_type == "qwen3_moe",
            moe=moe_from_hf_config(config),
        )

    def check_pipeline_parallel(self, pipeline_model_parallel_size: int) -> None:
        """Raise ``ValueError`` unless the layers split evenly over the pipeline stages."""
        pp = pipeline_model_parallel_size
        if pp < 1:
            raise ValueError(f"pipeline_model_parallel_size={pp} must be >= 1")
        if self.num_layers % pp != 0:
            raise ValueError(f"config.num_hidden_layers={self.num_layers} is not divisible by "
                             f"pipeline_model_parallel_size={pp} (every stage holds the same number of layers)")

    def check_tensor_parallel(self, tensor_model_parallel_size: int) -> None:
        """Raise ``ValueError`` unless every split dimension divides by the tensor-parallel size: the vocabulary
        (V), the key/value heads (each rank holds whole query groups) and the MLP inner size (F). A mixture of
        experts takes TP = 1 only (:meth:`~lightning_grpo.strategies.megatron.experts.MoE.check_tensor_parallel`)."""
        tp = tensor_model_parallel_size
        if tp < 1:
            raise ValueError(f"tensor_model_parallel_size={tp} must be >= 1")
        if self.moe is not None:
            self.moe.check_tensor_parallel(tp)
        for name, value in (("vocab_size", self.vocab_size), ("num_key_value_heads", self.num_query_groups),
                            ("intermediate_size", self.ffn_hidden_size)):
            if value % tp != 0:
                raise ValueError(f"config.{name}={value} is not divisible by tensor_model_parallel_size={tp}")


def _check_attention(config: Any, model_type: str) -> None:
    """Raise ``ValueError`` for projection biases (Llama, Qwen3-MoE) or sliding-window attention, named."""
    if model_type in ("llama", "qwen3_moe"):
        for field in ("attention_bias", "mlp_bias"):
            if getattr(config, field, False):
                raise ValueError(f"config.{field}=True: {model_type} projections with biases are not supported")
    if model_type in ("qwen2", "qwen3_moe") and getattr(config, "use_sliding_window", False):
        raise ValueError("config.use_sliding_window=True: sliding-window attention is not supported")
    if model_type == "mixtral" and getattr(config, "sliding_window", None) is not None:
        raise ValueError(f"config.sliding_window={config.sliding_window}: sliding-window attention is not "
                         "supported (set it to None)")


def recompute_settings(enabled: bool) -> dict[str, Any]:
    """``TransformerConfig`` fields of activation checkpointing: every transformer layer's activations recomputed in
    backward from its input (``recompute_granularity="full"``, ``recompute_method="uniform"``, one layer per
    checkpoint), the counterpart of transformers' per-decoder-layer gradient checkpointing; {} when disabled."""
    if not enabled:
        return {}
    return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
@dataclass(frozen=True)
class StageLayout:
    """What one pipeline stage holds.

    Attributes:
        pp_rank: the stage (0-based); pp_size: the number of stages.
        first_layer: the global index of its first transformer layer; num_layers: how many it holds.
        pre_process: it holds the embedding (the first stage).
        post_process: it holds the final norm and the output layer (the last stage).
    """

    pp_rank: int
    pp_size: int
    first_layer: int
    num_layers: int

    @property
    def pre_process(self) -> bool:
        return self.pp_rank == 0

    @property
    def post_process(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def layers(self) -> range:
        """The global indices of its layers."""
        return range(self.first_layer, self.first_layer + self.num_layers)


def stage_layout(arch: Architecture, pp_size: int = 1, pp_rank: int = 0) -> StageLayout:
    """Stage ``pp_rank`` of ``pp_size`` (even split, see the module docstring).

    Raises:
        ValueError: the layers do not split evenly, or ``pp_rank`` is not in ``[0, pp_size)``.
    """
    arch.check_pipeline_parallel(pp_size)
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pipeline stage {pp_rank} is not in [0, {pp_size})")
    per_stage = arch.num_layers // pp_size
    return StageLayout(pp_rank, pp_size, pp_rank * per_stage, per_stage)


def transformer_config(
    arch: Architecture,
    tensor_model_parallel_size: int = 1,
    params_dtype: torch.dtype = torch.float32,
    pipeline_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int = 1,
    **overrides: Any,
) -> Any:
    """The megatron-core ``TransformerConfig`` of ``arch``: no dropout, no fused kernels (exact on CPU and
    GPU), weights created on CPU without random initialisation (they are loaded from the HF checkpoint).
    Micro-batches of any shape go through the pipeline schedules (``variable_seq_lengths``: each stage sends
    the shape before the activations, as GRPO micro-batches are trimmed to their own longest rows). A mixture of
    experts gets :func:`~lightning_grpo.strategies.megatron.experts.moe_settings`.

    Args:
        arch: the architecture.
        tensor_model_parallel_size: TP size.
        params_dtype: dtype of the parameters (float32, bfloat16 or float16); also the dtype of the activations
            sent between pipeline stages.
        pipeline_model_parallel_size: PP size.
        expert_model_parallel_size, expert_tensor_parallel_size: EP and ETP sizes (a mixture of experts only).
        overrides: other ``TransformerConfig`` fields (e.g. ``recompute_granularity="full"``).

    Raises:
        ValueError: EP or ETP > 1 for a dense model, or sizes that do not divide the experts.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields: dict[str, Any] = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=True,
        perform_initialization=False,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        pipeline_dtype=params_dtype,
        variable_seq_lengths=True,
        # megatron-core 0.16 rejects variable_seq_lengths with its default MoE dispatcher even for dense models
        moe_token_dispatcher_type="alltoall",
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
    )
    fields.update(moe_settings(arch.moe, expert_model_parallel_size, expert_tensor_parallel_size))
    fields.update(overrides)
    return TransformerConfig(**fields)


def build_gpt_model(
    arch: Architecture,
    tensor_model_parallel_size: int = 1,
    params_dtype: torch.dtype = torch.float32,
    use_transformer_engine: bool = False,
    stage: Optional[StageLayout] = None,
    experts: Optional[ExpertRanks] = None,
    **overrides: Any,
) -> Any:
    """Build this rank's megatron-core ``GPTModel`` for ``arch`` (uninitialised weights: load them with
    :func:`lightning_grpo.strategies.megatron.convert.load_hf_state_dict`).

    ``megatron.core.parallel_state.initialize_model_parallel`` must have been called with the same TP, PP, EP and
    ETP sizes. The last stage returns vocab-parallel logits ``(B, S, V / TP)`` (``parallel_output=True``), the
    others hidden states ``(S, B, H)``. A mixture of experts is built from megatron-core's local MoE block spec
    (:func:`~lightning_grpo.strategies.megatron.experts.moe_layer_spec`).

    Args:
        stage: this rank's pipeline stage (:func:`stage_layout`); None = the whole model (PP = 1).
        experts: this rank's expert-parallel place (default: megatron-core's ``parallel_state``).

    Raises:
        ValueError: the TP, PP, EP or ETP size does not divide the model (see
            :meth:`Architecture.check_tensor_parallel`, :func:`stage_layout`, :func:`transformer_config`),
            ``use_transformer_engine`` without ``transformer_engine`` installed, or with a mixture of experts (the
            conversion maps the local ``SequentialMLP`` experts).
    """
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel

    arch.check_tensor_parallel(tensor_model_parallel_size)
    if use_transformer_engine and arch.moe is not None:
        raise ValueError("use_transformer_engine=True with a mixture of experts: the conversion maps megatron-core's "
                         "local SequentialMLP experts, not Transformer Engine's grouped ones; leave it False")
    if use_transformer_engine:
        try:
            import transformer_engine  # noqa: F401
        except ImportError as error:
            raise ValueError("use_transformer_engine=True but transformer_engine is not installed") from error
        spec = get_gpt_layer_with_transformer_engine_spec()
    else:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    stage = stage or stage_layout(arch)
    experts = experts or ExpertRanks.current()
    config = transformer_config(arch, tensor_model_parallel_size, params_dtype, stage.pp_size, experts.ep_size,
                                experts.etp_size, **overrides)
    if arch.moe is not None:
        spec = moe_layer_spec(config, stage.pp_rank)
    with _no_initial_embedding_sync():
        model = GPTModel(
            config,
            spec,
            vocab_size=arch.vocab_size,
            max_sequence_length=arch.max_position_embeddings,
            pre_process=stage.pre_process,
            post_process=stage.post_process,
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=arch.rope_theta,
            rotary_percent=1.0,
            parallel_output=True,
        )
    layers = len(model.decoder.layers)
    if layers != stage.num_layers:
        raise RuntimeError(f"megatron-core built {layers} layers on pipeline stage {stage.pp_rank}, "
                           f"the conversion expects {stage.num_layers}")
    return model


@contextlib.contextmanager
def _no_initial_embedding_sync() -> Iterator[None]:
    """Skip megatron-core's all-reduce that copies the first stage's embedding into the last stage's output layer
    when the embeddings are tied and PP > 1 (``LanguageModule.setup_embeddings_and_output_layer``, which also
    moves that weight with ``.cuda()``): both are loaded from the HF checkpoint right after construction. The
    ``shared``/``shared_embedding`` marks it sets are kept."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    original = LanguageModule._is_in_embd_group
    LanguageModule._is_in_embd_group = lambda self: False  # type: ignore[method-assign]
    try:
        yield
    finally:
        LanguageModule._is_in_embd_group = original  # type: ignore[method-assign]

