"""GRPO under Lightning's FSDP1 strategy (``Trainer(strategy="fsdp")``, ``FullyShardedDataParallel``; CUDA only
in Lightning, although torch's FSDP1 itself also runs on CPU with gloo).

Lightning wraps the whole LightningModule in one FSDP unit unless the module wraps submodules itself in
``configure_model``. :func:`configure_fsdp1` does the latter, with the strategy's own settings (precision,
CPU offload, sharding strategy, ``auto_wrap_policy``, ``use_orig_params``, device mesh): the policy and the
frozen reference policy each become their own FSDP root, so that

* the reference policy is sharded too (it lives outside the module tree, so Lightning would not shard it);
* both can be called outside ``training_step`` (rollouts, old/reference logprobs): an FSDP root all-gathers its
  parameters in its own forward;
* rollouts gather the policy once: ``FullyShardedDataParallel.summon_full_params(writeback=False)`` around
  ``generate``, which then runs on the unwrapped model. Without an ``auto_wrap_policy`` (the policy is one FSDP
  unit, Lightning's default) generation runs no collective at all. With nested FSDP units their forwards still
  all-gather per generated token (FSDP1 offers no way around it; FSDP2 does, see
  :mod:`lightning_grpo.strategies.fsdp`), so the HF engine is run with synchronized generation.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator

from torch import nn

if TYPE_CHECKING:
    from lightning.pytorch.strategies import FSDPStrategy

    from lightning_grpo.module import GRPOModule


def is_fsdp1(model: nn.Module) -> bool:
    """Whether ``model`` is (or contains) a ``torch.distributed.fsdp.FullyShardedDataParallel`` module."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def _wrap(model: nn.Module, strategy: "FSDPStrategy", auto_wrap_policy: object) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel

    kwargs = {k: v for k, v in strategy.kwargs.items() if k != "auto_wrap_policy"}
    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=auto_wrap_policy,
        cpu_offload=strategy.cpu_offload,
        mixed_precision=strategy.mixed_precision_config,
        sharding_strategy=strategy.sharding_strategy,
        device_id=strategy.root_device,
        **kwargs,
    )


def configure_fsdp1(module: "GRPOModule", strategy: "FSDPStrategy") -> None:
    """Wrap ``module.policy`` and ``module.ref_model`` as FSDP1 roots with the strategy's settings (see the
    module docstring); make the rollout engine gather the policy with ``summon_full_params``. Idempotent.

    The strategy's ``auto_wrap_policy`` is consumed here (Lightning would otherwise warn that it is ignored).
    """
    from lightning_grpo.rollout.hf import HFRolloutEngine
    from lightning_grpo.strategies.fsdp import GatheredGenerationEngine

    if is_fsdp1(module.policy):
        return
    auto_wrap_policy = strategy.kwargs.pop("auto_wrap_policy", None)
    module.policy = _wrap(module.policy, strategy, auto_wrap_policy)
    if module.ref_model is not None:
        module._ref[0] = _wrap(module.ref_model, strategy, auto_wrap_policy)
    engine = module.rollout_engine
    if engine is not None and not isinstance(engine, GatheredGenerationEngine):
        if isinstance(engine, HFRolloutEngine) and auto_wrap_policy is not None:
            # nested units all-gather in every forward: every rank must run as many forwards as the longest
            # rank (transformers' synced_gpus, switched on by this attribute, like for FSDP2 modules)
            engine.model._is_fsdp_managed_module = True
        module.rollout_engine = GatheredGenerationEngine(engine, module.policy, gather_for_sync=True)


@contextlib.contextmanager
def summoned_parameters(model: nn.Module) -> Iterator[nn.Module]:
    """The full parameters of an FSDP1 ``model`` for the block (``summon_full_params``, ``writeback=False``,
    ``recurse=True``: changes inside are discarded). A collective: every rank must enter. Memory: the full
    model on every rank while inside."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    with FullyShardedDataParallel.summon_full_params(model, writeback=False, recurse=True):
        yield model
