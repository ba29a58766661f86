"""Rollouts for a Megatron policy (tensor- and pipeline-parallel shards): generate on the first rank of each
model-parallel group, share the result with the group's other ranks.

The rollout engines take HF-format weights. Every rank's engine is synced with the backend's
:class:`~lightning_grpo.strategies.megatron.policy.MegatronWeights`, the policy's weights gathered from the shards one
tensor at a time (a collective over the model-parallel group, so every rank reads them, in the same order, and scores
the post-sync probe along), except an engine that generates with the policy's parameters:

- HF ``generate`` (``uses_policy_parameters``): the policy's HF copy is refreshed from the gathered weights whenever
  they changed (:meth:`MegatronPolicy.sync_hf_model`; only the generating rank keeps them) and generates.
- any other engine (colocated vLLM, the rollout servers, a user's): ``engine.sync_weights(weights)`` on every rank.
  Colocated vLLM engines exist on every rank (``GRPOModule.setup`` makes one per process, before the backend
  converts the policy; closing one mid-run would destroy the trainer's process groups): each loads the weights, and
  only the first rank's generates. The rollout servers' client streams from global rank 0 while the other ranks
  gather along.

The generating rank's :class:`~lightning_grpo.protocols.rollout.RolloutOutput` is broadcast over a process group of the
model-parallel group's ranks made for rollouts only, so every rank trains on the same completions; data-parallel
replicas generate on their own prompts. With asynchronous rollouts (``max_staleness > 0``) ``generate`` runs on a
background thread: it then only generates and broadcasts (on that dedicated group, never interleaved with the
training collectives); the HF copy is refreshed in :meth:`TensorParallelRolloutEngine.wake_up`, which the rollout
worker calls on the trainer's thread before each rollout.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Optional, Sequence

import torch

from lightning_grpo.protocols.engine import EngineWrapper, RolloutEngine
from lightning_grpo.protocols.rollout import RolloutOutput
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.protocols.vision import RowImages
from lightning_grpo.protocols.weights import PolicyWeights
from lightning_grpo.strategies.megatron.policy import MegatronPolicy


class TensorParallelRolloutEngine(EngineWrapper):
    """Wraps a rollout engine for a :class:`MegatronPolicy` (see the module docstring). ``pad_token_id`` is the
    wrapped engine's.

    Args:
        engine: the HF-format engine (its model is ``policy.hf_model`` for the HF engine).
        policy: the Megatron policy whose weights the engine samples from.
        group: the process group of this rank's model-parallel group for the rollout broadcasts; None = megatron-core's
            model-parallel group (then asynchronous rollouts must not be used).
    """

    def __init__(self, engine: RolloutEngine, policy: MegatronPolicy, group: Any = None) -> None:
        super().__init__(engine)
        self.policy = policy
        self.group = group
        self.generates = self._group_rank() == 0

    # ------------------------------------------------------------------ weights
    def sync_weights(self, weights: PolicyWeights) -> None:
        """Push the trained weights into the engine (see the module docstring). A collective over the
        model-parallel group: every rank calls it."""
        if self.engine.capabilities.uses_policy_parameters:  # HF generate: it generates with the HF copy, refreshed
            if self._any_stale():  # when stale
                self._sync_hf_model()
        else:  # every rank's engine reads the gathered stream (the gathers and the probe are collectives)
            self.engine.sync_weights(weights)

    def wake_up(self) -> None:
        """Refresh the HF copy if the weights changed (HF engine; a collective over the model-parallel group), then
        the wrapped engine's ``wake_up``."""
        if self.engine.capabilities.uses_policy_parameters and self._any_stale():
            self._sync_hf_model()
        self.engine.wake_up()

    # ------------------------------------------------------------------ generation
    def generate(
        self, prompt_ids: Sequence[Sequence[int]], num_generations: int, sampling: SamplingConfig,
        images: Sequence[RowImages] = (),
    ) -> RolloutOutput:
        """Generate on the group's first rank and broadcast the result over the group. A collective over the
        model-parallel group: every rank calls it with the same prompts. On the trainer's thread the HF copy is
        refreshed first if the weights changed (HF engine).

        Raises:
            ValueError: prompts with images (Megatron trains text models only).
        """
        if any(images):
            raise ValueError("MegatronStrategy trains text-only models: prompts with images need the HF policy on one "
                             "device, DDP or FSDP2")
        on_main = threading.current_thread() is threading.main_thread()
        if on_main and self.engine.capabilities.uses_policy_parameters and self._any_stale():
            self._sync_hf_model()
        out = self.engine.generate(prompt_ids, num_generations, sampling) if self.generates else None
        if self._group_size() == 1:
            assert out is not None
            return out
        if out is not None:  # CUDA tensors would be unpickled onto the sender's device: send them on CPU
            out = dataclasses.replace(out, **{f.name: getattr(out, f.name).cpu() for f in dataclasses.fields(out)
                                              if isinstance(getattr(out, f.name), torch.Tensor)})
        box = [out]
        group = self._group()
        torch.distributed.broadcast_object_list(box, src=torch.distributed.get_process_group_ranks(group)[0],
                                                group=group)
        return box[0]

    # ------------------------------------------------------------------ helpers
    def _sync_hf_model(self) -> None:
        self.policy.sync_hf_model(load=self.generates)

    def _any_stale(self) -> bool:
        """Whether any rank of the group sees weights newer than the HF copy (agreed over the group, so that either
        all or none take part in the gathering collective)."""
        stale = torch.tensor([0.0 if self.policy.hf_model_is_current() else 1.0])
        if self._group_size() > 1:
            group = self._group()
            stale = stale.to(_group_device(group))
            torch.distributed.all_reduce(stale, op=torch.distributed.ReduceOp.MAX, group=group)
        return bool(stale.item() > 0)

    def _group(self) -> Any:
        if self.group is not None:
            return self.group
        from megatron.core import parallel_state

        return parallel_state.get_model_parallel_group()

    def _group_size(self) -> int:
        if not torch.distributed.is_initialized():
            return 1
        return torch.distributed.get_world_size(self._group())

    def _group_rank(self) -> int:
        if not torch.distributed.is_initialized():
            return 0
        return torch.distributed.get_rank(self._group())


def _group_device(group: Optional[Any]) -> torch.device:
    """The device collectives on ``group`` use: the current CUDA device for NCCL, else CPU."""
    if torch.distributed.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
