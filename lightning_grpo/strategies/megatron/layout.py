"""The process layout of ``MegatronStrategy``: ``world_size = TP x PP x DP`` processes in megatron-core's rank order
(tp-dp-pp: TP ranks are adjacent, then DP replicas, then stages), its process groups and the reductions over them.
A mixture of experts' expert-parallel (EP) and expert-tensor-parallel (ETP) groups are carved out of the DP replicas
(megatron-core's order tp-ep-dp-pp for the experts, with ETP in place of TP): ``ETP x EP`` must divide ``TP x DP``.

:class:`MegatronLayout` (the base of :class:`~lightning_grpo.strategies.megatron.strategy.MegatronStrategy`) sets up
Lightning's DDP process group (NCCL on GPU, gloo on CPU, the :mod:`~lightning_grpo.strategies.megatron.cpu_shims`
applied on CPU for the run), then ``parallel_state.initialize_model_parallel(TP, PP, EP, ETP)`` and one more group per
model-parallel group for the rollouts (so a background rollout's broadcast, ``max_staleness > 0``, never interleaves
with the training collectives). Each DP replica gets its own prompts (the ``DistributedSampler`` is keyed by DP rank)
and ``reduce`` runs over the DP group. Teardown destroys megatron-core's model-parallel state and the groups it
created (the default group stays, as with ``DDPStrategy``).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional, Union

import torch
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor

from lightning_grpo.protocols.collectives import Collectives
from lightning_grpo.strategies.megatron import cpu_shims


class MegatronLayout(DDPStrategy):
    """``DDPStrategy`` with megatron-core's tensor, pipeline and data parallel groups (see the module docstring).

    Args:
        tensor_model_parallel_size, pipeline_model_parallel_size, virtual_pipeline_model_parallel_size,
        expert_model_parallel_size, expert_tensor_parallel_size, seed: as
            :class:`~lightning_grpo.strategies.megatron.strategy.MegatronStrategy`.
        kwargs: ``DDPStrategy`` arguments.

    Raises:
        ValueError: a size below 1 or ``virtual_pipeline_model_parallel_size`` (at construction); a world size that
            TP x PP does not divide, or a DP size that ETP x EP does not divide (at setup).
    """

    def __init__(self, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                 virtual_pipeline_model_parallel_size: Optional[int] = None, expert_model_parallel_size: int = 1,
                 expert_tensor_parallel_size: int = 1, seed: int = 1234,
                 timeout: Optional[timedelta] = timedelta(minutes=30), **kwargs: Any) -> None:
        for name, value in (("tensor_model_parallel_size", tensor_model_parallel_size),
                            ("pipeline_model_parallel_size", pipeline_model_parallel_size),
                            ("expert_model_parallel_size", expert_model_parallel_size),
                            ("expert_tensor_parallel_size", expert_tensor_parallel_size)):
            if value < 1:
                raise ValueError(f"MegatronStrategy({name}={value}) must be >= 1")
        if virtual_pipeline_model_parallel_size is not None:
            raise ValueError(
                f"MegatronStrategy(virtual_pipeline_model_parallel_size={virtual_pipeline_model_parallel_size}): the "
                "interleaved pipeline schedule is not supported; leave it None (the 1F1B schedule)")
        super().__init__(timeout=timeout, **kwargs)
        self.tensor_model_parallel_size = tensor_model_parallel_size
        self.pipeline_model_parallel_size = pipeline_model_parallel_size
        self.expert_model_parallel_size = expert_model_parallel_size
        self.expert_tensor_parallel_size = expert_tensor_parallel_size
        self.seed = seed
        self._shims_applied = False
        self._model_parallel_groups: list[Any] = []
        self._rollout_group: Any = None

    # ------------------------------------------------------------------ environment
    @property
    def model_parallel_size(self) -> int:
        """Processes that hold one copy of the model: TP x PP."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    @property
    def data_parallel_size(self) -> int:
        """Processes with different data: ``world_size / (TP x PP)``."""
        return self.world_size // self.model_parallel_size

    @property
    def data_parallel_rank(self) -> int:
        """This process's data-parallel replica (its TP and PP ranks share it; megatron-core's order tp-dp-pp)."""
        return (self.global_rank // self.tensor_model_parallel_size) % self.data_parallel_size

    @property
    def tensor_model_parallel_rank(self) -> int:
        return self.global_rank % self.tensor_model_parallel_size

    @property
    def pipeline_model_parallel_rank(self) -> int:
        return self.global_rank // (self.tensor_model_parallel_size * self.data_parallel_size)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    def model_parallel_ranks(self, data_parallel_rank: int) -> list[int]:
        """The global ranks of replica ``data_parallel_rank``'s model-parallel group (TP x PP), sorted."""
        tp, dp = self.tensor_model_parallel_size, self.data_parallel_size
        return sorted(t + tp * (data_parallel_rank + dp * p) for p in range(self.pipeline_model_parallel_size)
                      for t in range(tp))

    def setup_environment(self) -> None:
        if self.world_size % self.model_parallel_size != 0:
            raise ValueError(
                f"MegatronStrategy(tensor_model_parallel_size={self.tensor_model_parallel_size}, "
                f"pipeline_model_parallel_size={self.pipeline_model_parallel_size}): TP x PP = "
                f"{self.model_parallel_size} must divide the number of processes (world size {self.world_size})"
            )
        experts = self.expert_model_parallel_size * self.expert_tensor_parallel_size
        if (self.tensor_model_parallel_size * self.data_parallel_size) % experts != 0:
            raise ValueError(
                f"MegatronStrategy(expert_model_parallel_size={self.expert_model_parallel_size}, "
                f"expert_tensor_parallel_size={self.expert_tensor_parallel_size}): EP x ETP = {experts} must divide "
                f"TP x DP = {self.tensor_model_parallel_size * self.data_parallel_size} (the expert groups are carved "
                f"out of the data-parallel replicas; world size {self.world_size})"
            )
        if self.root_device.type == "cpu" and not self._shims_applied:
            cpu_shims.apply()
            self._shims_applied = True
        super().setup_environment()  # accelerator device setup + process group (DDPStrategy.setup_distributed)
        from megatron.core import parallel_state, tensor_parallel

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        existing = set(_process_groups())
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.pipeline_model_parallel_size,
            expert_model_parallel_size=self.expert_model_parallel_size,
            expert_tensor_parallel_size=self.expert_tensor_parallel_size,
            create_gloo_process_groups=self.root_device.type == "cpu",
        )
        groups = [torch.distributed.new_group(self.model_parallel_ranks(d)) for d in range(self.data_parallel_size)]
        self._rollout_group = groups[self.data_parallel_rank]
        mine = torch.distributed.get_process_group_ranks(parallel_state.get_model_parallel_group())
        if sorted(mine) != self.model_parallel_ranks(self.data_parallel_rank):
            raise RuntimeError(f"megatron-core's model-parallel group {sorted(mine)} is not the expected "
                               f"{self.model_parallel_ranks(self.data_parallel_rank)} (rank order tp-dp-pp)")
        self._model_parallel_groups = [g for g in _process_groups() if g not in existing]
        if self.root_device.type == "cuda":
            tensor_parallel.model_parallel_cuda_manual_seed(self.seed)

    # --------------------------------------------------------------- communication
    def reduce(
        self, tensor: Tensor, group: Optional[Any] = None, reduce_op: Optional[Union[Any, str]] = "mean"
    ) -> Tensor:
        """Reduce over the data-parallel group by default (TP and PP ranks hold copies of the same values)."""
        if group is None and torch.distributed.is_initialized():
            from megatron.core import parallel_state

            if parallel_state.model_parallel_is_initialized():
                group = parallel_state.get_data_parallel_group()
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        flag = torch.tensor(int(decision), device=self.root_device)
        total = super().reduce(flag, reduce_op="sum")  # over every process
        return bool(total == self.world_size) if all else bool(total)

    def reduce_sum(self, tensor: Tensor) -> Tensor:
        """Summed over the data-parallel group (:meth:`reduce`)."""
        return tensor if self.world_size <= 1 else self.reduce(tensor, reduce_op="sum")

    def reduce_max(self, tensor: Tensor) -> Tensor:
        """Maximum over the data-parallel group (:meth:`reduce`)."""
        return tensor if self.world_size <= 1 else self.reduce(tensor, reduce_op="max")

    def collectives(self, device: torch.device) -> Collectives:
        """:meth:`reduce_sum` and :meth:`reduce_max` over the data-parallel group, flags on ``device``."""
        return Collectives(self.reduce_sum, self.reduce_max, device)

    def teardown(self) -> None:
        """Lightning's teardown, then destroy megatron-core's model-parallel state and the process groups it created,
        and remove the CPU shims. The default process group is Lightning's and lives as long as the process (as with
        ``DDPStrategy``), so a later ``fit`` can reuse it."""
        super().teardown()
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if torch.distributed.is_initialized():
            for group in self._model_parallel_groups:
                if group in _process_groups():  # some are aliases of one another
                    torch.distributed.destroy_process_group(group)
        self._model_parallel_groups = []
        if self._shims_applied:
            cpu_shims.remove()
            self._shims_applied = False


def _process_groups() -> list[Any]:
    """Every process group torch knows in this process (the default one and all subgroups)."""
    if not torch.distributed.is_initialized():
        return []
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_map)
