"""Full parameters of a sharded model, for both FSDP flavours: what :mod:`lightning_grpo.strategies.fsdp` (FSDP2)
and :mod:`lightning_grpo.strategies.fsdp1` (FSDP1) share.

* :func:`gathered_parameters`: the full parameters for a block of no-grad forwards (rollouts, weight sync);
* :class:`GatheredGenerationEngine`: an engine that generates with the policy, inside that block;
* :func:`full_state_dict`: the whole unsharded state dict (HF export).

``torch.distributed.fsdp`` is imported where it is used: it needs a torch build with distributed support.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

from torch import Tensor, nn

from lightning_grpo.protocols.engine import EngineWrapper, RolloutEngine
from lightning_grpo.protocols.rollout import RolloutOutput
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.protocols.vision import RowImages

#: Attribute set on every module :func:`lightning_grpo.strategies.fsdp.shard_model` shards: its
#: ``reshard_after_forward`` (restored after a rollout).
RESHARD_ATTR = "_lightning_grpo_reshard_after_forward"


def is_fsdp2(model: nn.Module) -> bool:
    """Whether ``model`` (or one of its submodules) was sharded with ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def is_fsdp1(model: nn.Module) -> bool:
    """Whether ``model`` is (or contains) a ``torch.distributed.fsdp.FullyShardedDataParallel`` module."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is sharded by FSDP2 (``fully_shard``) or wrapped by FSDP1, itself or inside a wrapper (a
    PEFT model, the LoRA reference policy): each forward call then all-gathers the parameters, so callers should
    make few, large forward calls."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return any(isinstance(m, (FullyShardedDataParallel, FSDPModule)) for m in model.modules())


@contextlib.contextmanager
def summoned_parameters(model: nn.Module) -> Iterator[nn.Module]:
    """The full parameters of an FSDP1 ``model`` for the block (``summon_full_params``, ``writeback=False``,
    ``recurse=True``: changes inside are discarded). A collective: every rank must enter. Memory: the full
    model on every rank while inside."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(model, writeback=False, recurse=True):
        yield model


@contextlib.contextmanager
def gathered_parameters(model: nn.Module) -> Iterator[nn.Module]:
    """Hold the full (unsharded) parameters of a sharded ``model`` for the duration of the block.

    FSDP2: each ``fully_shard`` group of ``model`` is all-gathered once on entry (``FSDPModule.unshard``, in the
    ``MixedPrecisionPolicy``'s ``param_dtype``) and kept through every forward inside the block
    (``set_reshard_after_forward(False)``); on exit every group is resharded (``FSDPModule.reshard``, freeing the
    full parameters) and its ``reshard_after_forward`` restored. Inside, forwards run no collective, so ranks may
    run different numbers of forwards (different completion lengths).
    FSDP1: ``summon_full_params(writeback=False)`` (:func:`summoned_parameters`). Otherwise a no-op.

    A collective: every rank must enter the block. Memory: the full parameters of ``model`` on every rank while
    inside. Meant for no-grad use (generation, weight export).

    Yields:
        ``model``.
    """
    from torch.distributed.fsdp import FSDPModule

    groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not groups:
        if is_fsdp1(model):
            with summoned_parameters(model):
                yield model
        else:
            yield model
        return
    for group in groups:
        group.set_reshard_after_forward(False, recurse=False)
    try:
        handles = [group.unshard(async_op=True) for group in groups]
        for handle in handles:
            if handle is not None:
                handle.wait()
        yield model
    finally:
        for group in groups:
            group.reshard()
            group.set_reshard_after_forward(bool(getattr(group, RESHARD_ATTR, True)), recurse=False)


class GatheredGenerationEngine(EngineWrapper):
    """A rollout engine that generates with the policy's own parameters (``uses_policy_parameters``, HF
    ``generate``), run inside :func:`gathered_parameters` of the sharded policy (FSDP2: one all-gather per group per
    rollout instead of one per generated token).

    Args:
        engine: the wrapped engine; it generates with the unwrapped policy module.
        model: the sharded policy.

    Every other member is ``engine``'s (:class:`~lightning_grpo.protocols.engine.EngineWrapper`).
    """

    def __init__(self, engine: RolloutEngine, model: nn.Module) -> None:
        super().__init__(engine)
        self.model = model

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], num_generations: int, sampling: SamplingConfig,
        images: Sequence[RowImages] = (),
    ) -> RolloutOutput:
        """``engine.generate`` (with ``images`` when a prompt has some) with the policy's full parameters gathered once
        (a collective: every rank calls)."""
        with gathered_parameters(self.model):
            return super().generate(prompt_ids, num_generations, sampling, images)


def full_state_dict(model: nn.Module, rank0_only: bool = False) -> dict[str, Tensor]:
    """The full (unsharded) state dict of ``model``, with the module's own names, on CPU.

    For an FSDP2 model every ``DTensor`` is all-gathered, for an FSDP1 root its flat shards
    (``torch.distributed.checkpoint.state_dict.get_model_state_dict`` with ``full_state_dict=True``; wrapper name
    parts such as ``_fsdp_wrapped_module`` are dropped): a collective, every rank must call it. A plain model
    returns ``model.state_dict()`` (detached, on its device).

    Args:
        model: the model (FSDP2-sharded or not).
        rank0_only: FSDP only: gather onto rank 0 only (the other ranks get ``{}``), offloaded to CPU as each
            tensor arrives, so peak memory is one model on rank 0 and one parameter elsewhere.

    Returns:
        ``{name: tensor}``.
    """
    if not is_fsdp2(model) and not is_fsdp1(model):
        return {k: v.detach() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    state: dict[str, Any] = get_model_state_dict(model, options=options)
    if rank0_only:
        return state
    return {k: v.detach().cpu() for k, v in state.items()}
