"""Mixtures of experts in megatron-core: what an HF MoE config says, the megatron-core settings and layer specs that
compute the same thing, and where each expert lives (expert parallelism).

Supported: Qwen3-MoE (``Qwen3MoeForCausalLM``: every layer, or those ``decoder_sparse_step`` / ``mlp_only_layers``
pick, a mixture of ``num_experts`` SwiGLU experts with top-``num_experts_per_tok`` routing; ``norm_topk_prob``) and
Mixtral (``MixtralForCausalLM``: every layer a mixture, the top-k weights always renormalized). HF's router takes the
softmax of the router logits over all experts and keeps the top k, renormalized to sum 1 when ``norm_topk_prob``
(Qwen3-MoE's ``Qwen3MoeTopKRouter``, Mixtral's ``MixtralTopKRouter``); megatron-core's ``TopKRouter`` with
``moe_router_pre_softmax=True`` computes exactly the un-renormalized form, and with ``False`` the softmax of the top-k
logits, which is the renormalized form (softmax is monotone, so the same experts are picked, and ``e^{z_i} / sum_{j in
top-k} e^{z_j}`` is the renormalized probability). No auxiliary load-balancing loss is added (GRPO's objective has
none: ``moe_router_load_balancing_type="none"``), and no token is dropped (no expert capacity).

The layers are megatron-core's local ones (no Transformer Engine, so they run on CPU too): ``SequentialMLP`` experts
(``moe_grouped_gemm=False``: one ``MLP`` per local expert, ``mlp.experts.local_experts.{j}.linear_fc1/linear_fc2``)
and the all-to-all token dispatcher (``moe_token_dispatcher_type="alltoall"``: the only one that takes micro-batches
of varying length, ``variable_seq_lengths``; its all-to-all runs on gloo too). Expert parallelism (EP) splits the
``E`` experts of every MoE layer over the ``EP`` ranks of an expert-parallel group (rank ``r`` holds experts
``[r E/EP, (r+1) E/EP)``); expert tensor parallelism (ETP) splits each expert's matrices over ``ETP`` ranks as tensor
parallelism splits the dense MLP. Both groups are carved out of the data-parallel replicas (megatron-core's
"MoE parallel folding": rank order tp-ep-dp-pp for the experts), so the attention and the router stay replicated over
them and each rank still trains on its own data.

Tensor parallelism of the attention (TP > 1) is refused for a mixture of experts: megatron-core's MoE layer trains with
TP only under sequence parallelism (``MoELayer.forward`` raises otherwise), which ``MegatronStrategy`` does not offer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

#: HF ``model_type`` values whose mixture of experts converts.
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral")


@dataclass(frozen=True)
class MoE:
    """The mixture of experts of an architecture.

    Attributes:
        num_experts: experts per MoE layer (E).
        ffn_hidden_size: each expert's SwiGLU inner size (HF Qwen3-MoE ``moe_intermediate_size``, Mixtral
            ``intermediate_size``).
        topk: experts each token is routed to (HF ``num_experts_per_tok``).
        norm_topk_prob: the top-k routing weights are renormalized to sum 1.
        layers: one flag per transformer layer: a mixture of experts (True) or a dense MLP (False).
    """

    num_experts: int
    ffn_hidden_size: int
    topk: int
    norm_topk_prob: bool
    layers: tuple[bool, ...]

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The global indices of the MoE layers, in order (the ``moe_layers`` dimension of routed experts)."""
        return tuple(i for i, moe in enumerate(self.layers) if moe)

    def check_tensor_parallel(self, tensor_model_parallel_size: int) -> None:
        """Raise ``ValueError`` for TP > 1 (see the module docstring)."""
        if tensor_model_parallel_size > 1:
            raise ValueError(
                f"tensor_model_parallel_size={tensor_model_parallel_size} with a mixture of experts: megatron-core's "
                "MoE layer trains with tensor parallelism only under sequence parallelism, which MegatronStrategy "
                "does not offer; keep TP=1 and split the experts with expert_model_parallel_size (and each expert "
                "with expert_tensor_parallel_size)")

    def check_expert_parallel(self, expert_model_parallel_size: int, expert_tensor_parallel_size: int) -> None:
        """Raise ``ValueError`` unless the experts split evenly over the EP ranks and each expert's inner size over
        the ETP ranks."""
        ep, etp = expert_model_parallel_size, expert_tensor_parallel_size
        if self.num_experts % ep != 0:
            raise ValueError(f"config num_experts={self.num_experts} is not divisible by "
                             f"expert_model_parallel_size={ep} (every rank holds the same number of experts)")
        if self.ffn_hidden_size % etp != 0:
            raise ValueError(f"the experts' inner size {self.ffn_hidden_size} is not divisible by "
                             f"expert_tensor_parallel_size={etp}")


def moe_from_hf_config(config: Any) -> Optional[MoE]:
    """The mixture of experts of a ``transformers`` ``Qwen3MoeConfig`` / ``MixtralConfig``; None for another
    ``model_type`` (a dense model).

    Raises:
        ValueError: a router setting megatron-core's router does not compute (Mixtral's ``router_jitter_noise``),
            named with its value.
    """
    model_type = config.model_type
    if model_type == "qwen3_moe":
        sparse = [i not in config.mlp_only_layers and (i + 1) % config.decoder_sparse_step == 0
                  for i in range(config.num_hidden_layers)]
        return MoE(int(config.num_experts), int(config.moe_intermediate_size), int(config.num_experts_per_tok),
                   bool(config.norm_topk_prob), tuple(sparse))
    if model_type == "mixtral":
        if config.router_jitter_noise:
            raise ValueError(f"config.router_jitter_noise={config.router_jitter_noise}: megatron-core's router adds "
                             "no such noise; set it to 0")
        return MoE(int(config.num_local_experts), int(config.intermediate_size), int(config.num_experts_per_tok),
                   True, (True,) * int(config.num_hidden_layers))
    return None


def moe_settings(moe: Optional[MoE], expert_model_parallel_size: int = 1,
                 expert_tensor_parallel_size: int = 1) -> dict[str, Any]:
    """``TransformerConfig`` fields of ``moe`` (see the module docstring); {} for a dense model (whatever the expert
    sizes: megatron-core's expert-TP size defaults to the TP size, and a dense model has no expert to split).

    Raises:
        ValueError: sizes that do not divide (:meth:`MoE.check_expert_parallel`).
    """
    ep, etp = expert_model_parallel_size, expert_tensor_parallel_size
    if moe is None:
        return {}
    moe.check_expert_parallel(ep, etp)
    return dict(
        num_moe_experts=moe.num_experts,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_topk=moe.topk,
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_grouped_gemm=False,
        moe_layer_freq=[int(flag) for flag in moe.layers],
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )


def check_dense_layout(moe: Optional[MoE], expert_model_parallel_size: int, expert_tensor_parallel_size: int) -> None:
    """Raise ``ValueError`` for expert parallelism asked of a dense model (``moe`` None)."""
    ep, etp = expert_model_parallel_size, expert_tensor_parallel_size
    if moe is None and ep * etp > 1:
        raise ValueError(f"MegatronStrategy(expert_model_parallel_size={ep}, expert_tensor_parallel_size={etp}): the "
                         "model is dense (no mixture of experts to split); leave both 1")


def moe_layer_spec(config: Any, pp_rank: int) -> Any:
    """megatron-core's local (non-Transformer-Engine) block spec of pipeline stage ``pp_rank`` for ``config`` (a
    ``TransformerConfig`` with :func:`moe_settings`): each layer a ``SequentialMLP`` mixture or a dense ``MLP`` as
    ``moe_layer_freq`` says, RMSNorm, q/k RMSNorm when ``config.qk_layernorm``."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        # megatron-core 0.16.1 imports te_general_gemm only with Transformer Engine, yet its router's linear
        # (RouterGatingLinearFunction) reads it unconditionally: a NameError without TE. None is its own "no TE"
        # value there (the torch.mm path).
        moe_utils.te_general_gemm = None
    return get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm", pp_rank=pp_rank)


@dataclass(frozen=True)
class ExpertRanks:
    """This rank's place among the expert-parallel ranks: EP rank and size, expert-TP rank and size."""

    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1

    @classmethod
    def current(cls) -> "ExpertRanks":
        """From megatron-core's ``parallel_state`` (EP = ETP = 1 when it is not initialised)."""
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return cls()
        return cls(ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size(),
                   ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size())

    @property
    def partitioned(self) -> bool:
        """The experts' weights differ between the ranks of the expert groups (EP x ETP > 1)."""
        return self.ep_size * self.etp_size > 1

    def local_experts(self, num_experts: int) -> range:
        """The global indices of the experts this rank holds, in local order."""
        per_rank = num_experts // self.ep_size
        return range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)
