"""Rollouts for a Megatron policy (tensor- and pipeline-parallel shards): generate on the first rank of each
model-parallel group, share the result with the group's other ranks.

The rollout engines take HF-format weights. :class:`TensorParallelRolloutEngine` feeds each kind of engine the
policy's weights gathered from the shards one tensor at a time
(:meth:`lightning_grpo.strategies.megatron.policy.MegatronPolicy.iter_hf_weights`, a collective over the
model-parallel group):

- HF ``generate`` (:class:`~lightning_grpo.rollout.engines.hf.HFRolloutEngine`): the policy's HF copy is refreshed
  from the gathered weights whenever they changed (:meth:`MegatronPolicy.sync_hf_model`; only the generating rank
  keeps them) and generates.
- colocated vLLM (:class:`~lightning_grpo.rollout.engines.vllm.VLLMRolloutEngine`): the generating rank's engine
  loads the gathered tensors as they come (``reload_weights``; the tied ``lm_head`` included); the other ranks of
  the group take part in the gathers only. Their engines (made by ``GRPOModule.setup`` on every rank, before the
  backend converts the policy) stay idle: closing a colocated vLLM engine mid-run would destroy the trainer's
  process groups (vLLM's shutdown tears down ``torch.distributed``).
- rollout servers (:class:`~lightning_grpo.rollout.engines.remote.VLLMServerEngine`): every rank calls its
  ``sync_weights`` with the policy (global rank 0 streams the gathered tensors to the servers while the others
  gather along; the post-sync probe is scored by the shards).

- any other engine: the HF copy is refreshed as for HF ``generate`` (every rank) and handed to its
  ``sync_weights`` on the generating rank.

Which path an engine takes is read from its declared capabilities (``uses_policy_parameters``: the HF copy;
``sync_is_collective``: every rank syncs; ``reads_weight_sources``: the generating rank's engine gets the policy, an
:class:`~lightning_grpo.protocols.weights.HFWeightSource` whose tensors are gathered as they are read, which
it reads to the end while the other ranks gather along; else the HF copy).

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
from lightning_grpo.protocols.multimodal import has_images
from lightning_grpo.protocols.rollout import RolloutOutput
from lightning_grpo.protocols.sampling import SamplingConfig
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
    def sync_weights(self, model: torch.nn.Module) -> None:
        """Push the trained weights into the engine (see the module docstring). A collective over the
        model-parallel group (every rank, for the rollout servers)."""
        if self.engine.uses_policy_parameters:  # HF generate: it generates with the refreshed HF copy
            self._sync_hf_model()
        elif self.engine.sync_is_collective:  # the rollout servers: rank 0 streams, the others gather along
            self.engine.sync_weights(self.policy)
        elif self.engine.reads_weight_sources:  # colocated vLLM: the policy as an HFWeightSource, read to the end
            if self.generates:
                self.engine.sync_weights(self.policy)
            else:
                for _ in self.policy.iter_hf_weights():  # the gathers are collectives
                    pass
        else:  # another engine: the refreshed HF copy (a collective), handed to it on the generating rank
            self._sync_hf_model()
            if self.generates:
                assert self.policy.hf_model is not None
                self.engine.sync_weights(self.policy.hf_model)

    def wake_up(self) -> None:
        """Refresh the HF copy if the weights changed (HF engine; a collective over the model-parallel group), then
        the wrapped engine's ``wake_up``."""
        if self.engine.uses_policy_parameters and self._any_stale():
            self._sync_hf_model()
        self.engine.wake_up()

    # ------------------------------------------------------------------ generation
    def generate(
        self, prompt_ids: Sequence[Sequence[int]], num_generations: int, sampling: SamplingConfig,
        images: Optional[Sequence[Any]] = None,
    ) -> RolloutOutput:
        """Generate on the group's first rank and broadcast the result over the group. A collective over the
        model-parallel group: every rank calls it with the same prompts. On the trainer's thread the HF copy is
        refreshed first if the weights changed (HF engine).

        Raises:
            ValueError: prompts with images (Megatron trains text models only).
        """
        if has_images(images):
            raise ValueError("MegatronStrategy trains text-only models: prompts with images need the HF policy on one "
                             "device, DDP or FSDP2")
        on_main = threading.current_thread() is threading.main_thread()
        if on_main and self.engine.uses_policy_parameters and self._any_stale():
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
