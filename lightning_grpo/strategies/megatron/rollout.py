"""Rollouts for a tensor-parallel Megatron policy: generate with an HF-format engine on TP rank 0, share the
result with the other TP ranks.

The rollout engines take HF-format weights (the HF engine generates with an HF model; vLLM loads
``(hf_name, tensor)`` pairs). :class:`TensorParallelRolloutEngine` keeps the policy's HF copy current by
gathering the megatron-core shards into it
(:meth:`lightning_grpo.strategies.megatron.policy.MegatronPolicy.sync_hf_model`,
the same path a vLLM weight sync uses), runs the wrapped engine on tensor-parallel rank 0 of each data-parallel
group and broadcasts its :class:`~lightning_grpo.rollout.base.RolloutOutput` to the group's other TP ranks, so
every TP rank trains on the same completions. Data-parallel groups generate on their own prompts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from lightning_grpo.rollout.base import EngineWrapper, RolloutEngine, RolloutOutput, SamplingConfig
from lightning_grpo.strategies.megatron.policy import MegatronPolicy


class TensorParallelRolloutEngine(EngineWrapper):
    """Wraps a rollout engine for a :class:`MegatronPolicy` (see the module docstring). ``wake_up``, ``sleep``,
    ``close`` and ``pad_token_id`` are the wrapped engine's (:class:`~lightning_grpo.rollout.base.EngineWrapper`).

    Args:
        engine: the HF-format engine (its model is ``policy.hf_model`` for the HF engine).
        policy: the Megatron policy whose weights the engine samples from.
    """

    def __init__(self, engine: RolloutEngine, policy: MegatronPolicy) -> None:
        super().__init__(engine)
        self.policy = policy

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Gather the trained weights into the HF copy (a TP collective) and push them into the wrapped engine
        (a no-op for the HF engine, which generates with that copy)."""
        self._sync_hf_model()
        if self._tp_rank() == 0:
            assert self.policy.hf_model is not None
            self.engine.sync_weights(self.policy.hf_model)

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], num_generations: int, sampling: SamplingConfig
    ) -> RolloutOutput:
        """Generate on TP rank 0 (after refreshing the HF copy if the weights changed, for the HF engine) and
        broadcast the result over the TP group. A TP collective: every TP rank calls it with the same prompts."""
        if self.engine.uses_policy_parameters and self._any_stale():
            self._sync_hf_model()
        from megatron.core import parallel_state

        out = self.engine.generate(prompt_ids, num_generations, sampling) if self._tp_rank() == 0 else None
        if parallel_state.get_tensor_model_parallel_world_size() == 1:
            assert out is not None
            return out
        if out is not None:  # CUDA tensors would be unpickled onto the sender's device: send them on CPU
            out = dataclasses.replace(out, **{f.name: getattr(out, f.name).cpu() for f in dataclasses.fields(out)
                                              if isinstance(getattr(out, f.name), torch.Tensor)})
        box = [out]
        torch.distributed.broadcast_object_list(
            box, src=parallel_state.get_tensor_model_parallel_src_rank(),
            group=parallel_state.get_tensor_model_parallel_group(),
        )
        return box[0]

    def _sync_hf_model(self) -> None:
        self.policy.sync_hf_model(load=self._tp_rank() == 0)

    def _any_stale(self) -> bool:
        """Whether any TP rank sees weights newer than the HF copy (agreed over the TP group, so that either all
        or none take part in the gathering collective)."""
        from megatron.core import parallel_state

        stale = torch.tensor([0.0 if self.policy.hf_model_is_current() else 1.0])
        if parallel_state.get_tensor_model_parallel_world_size() > 1:
            group = parallel_state.get_tensor_model_parallel_group()
            stale = stale.to(_group_device(group))
            torch.distributed.all_reduce(stale, op=torch.distributed.ReduceOp.MAX, group=group)
        return bool(stale.item() > 0)

    @staticmethod
    def _tp_rank() -> int:
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_rank()


def _group_device(group: Any) -> torch.device:
    """The device collectives on ``group`` use: the current CUDA device for NCCL, else CPU."""
    if torch.distributed.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
