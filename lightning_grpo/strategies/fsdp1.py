"""GRPO under Lightning's FSDP1 strategy (``Trainer(strategy="fsdp")``, ``FullyShardedDataParallel``; CUDA only
in Lightning, although torch's FSDP1 itself also runs on CPU with gloo).

Lightning wraps the whole LightningModule in one FSDP unit unless the module wraps submodules itself in
``configure_model``. :class:`FSDP1Backend` (called from ``GRPOModule.configure_model``) does the latter, with
the strategy's own settings (precision, CPU offload, sharding strategy, ``auto_wrap_policy``,
``use_orig_params``, device mesh): the policy and the frozen reference policy each become their own FSDP root,
so that

* the reference policy is sharded too (it lives outside the module tree, so Lightning would not shard it);
* both can be called outside ``training_step`` (rollouts, old/reference logprobs): an FSDP root all-gathers its
  parameters in its own forward;
* rollouts gather the policy once: ``FullyShardedDataParallel.summon_full_params(writeback=False)`` around
  ``generate``, which then runs on the unwrapped model; a weight sync reads the parameters inside it too. Without
  an ``auto_wrap_policy`` (the policy is one FSDP unit, Lightning's default) generation runs no collective at all.
  With nested FSDP units their forwards still all-gather per generated token (FSDP1 offers no way around it;
  FSDP2 does, see :mod:`lightning_grpo.strategies.fsdp`), so the HF engine is run with synchronized generation.

Gradient norm and clipping by norm use the root's ``clip_grad_norm_`` (the norm over all shards; Lightning's
FSDP1 precision plugin refuses ``gradient_clip_algorithm="norm"``).
"""

from __future__ import annotations

from typing import Any, Optional, Union

from lightning.pytorch.strategies import FSDPStrategy
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_grpo.models.hf_weights import has_separate_head
from lightning_grpo.strategies._gather import GatheredGenerationEngine, full_state_dict, gathered_parameters, is_fsdp1
from lightning_grpo.strategies.backend import ClipFallback, GRPOModels, clips_by_norm
from lightning_grpo.strategies.local import LocalBackend
from lightning_grpo.strategies.module_weights import ModuleWeights


def _wrap(model: nn.Module, strategy: FSDPStrategy, auto_wrap_policy: object) -> nn.Module:
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


def _root(model: Any) -> Optional[nn.Module]:
    """``model`` when it is an FSDP1 root (``FullyShardedDataParallel``), else None."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    return model if isinstance(model, FullyShardedDataParallel) else None


class FSDP1Backend(LocalBackend):
    """:class:`~lightning_grpo.strategies.backend.ParallelBackend` of Lightning's ``FSDPStrategy`` (see the module
    docstring). Reductions are :class:`~lightning_grpo.strategies.local.LocalBackend`'s.

    Args:
        strategy: the ``FSDPStrategy`` (its precision, CPU offload, sharding strategy, ``auto_wrap_policy``, ...).
    """

    def configure(self, models: GRPOModels) -> GRPOModels:
        """Wrap the policy, the reference policy and the distillation teacher as FSDP1 roots with the strategy's
        settings; make the HF rollout engine gather the policy with ``summon_full_params``; the engines with their
        own weights read them inside it (a collective). Idempotent.

        The strategy's ``auto_wrap_policy`` is consumed here (Lightning would otherwise warn that it is ignored).

        Raises:
            ValueError: a LoRA policy (``GRPOModule(lora=...)``): use FSDP2.
        """
        if models.lora:
            raise ValueError("GRPOModule(lora=...) is not supported with Lightning's FSDP1 strategy (FSDPStrategy): "
                             "use strategy='grpo_fsdp2' (FSDP2), 'ddp' or a single device")
        policy, ref, engine, teacher = models.policy, models.ref, models.engine, models.teacher
        nested = False
        separate_head = None  # the wrapped root's names may be FSDP1's flat ones: read them before wrapping
        if not is_fsdp1(policy):
            separate_head = has_separate_head(policy)
            auto_wrap_policy = self.strategy.kwargs.pop("auto_wrap_policy", None)
            nested = auto_wrap_policy is not None
            policy = _wrap(policy, self.strategy, auto_wrap_policy)
            ref = _wrap(ref, self.strategy, auto_wrap_policy) if ref is not None else None
            teacher = _wrap(teacher, self.strategy, auto_wrap_policy) if teacher is not None else None
        if engine is not None and engine.capabilities.uses_policy_parameters:
            if nested:
                # nested units all-gather in every forward: every rank must run as many forwards as the longest
                # rank (transformers' synced_gpus, as for FSDP2 modules)
                engine.set_lockstep(True)
            engine = GatheredGenerationEngine(engine, policy)
        weights = ModuleWeights(policy, collective=True, gather=gathered_parameters, separate_head=separate_head,
                                forward_context=self.forward_context)
        return GRPOModels(policy, ref, engine, lora=models.lora, weights=weights, sharded=True, teacher=teacher)

    def grad_norm(self, policy: nn.Module) -> Optional[Tensor]:
        """The root's ``clip_grad_norm_(inf)`` (the norm over all shards, scales nothing; a collective), or None
        before any gradient exists."""
        root = _root(policy)
        if root is None:
            return super().grad_norm(policy)
        if all(p.grad is None for p in root.parameters()):
            return None
        return root.clip_grad_norm_(float("inf")).float()

    def clip_gradients(
        self,
        policy: nn.Module,
        optimizer: Optimizer,
        gradient_clip_val: Optional[Union[int, float]],
        gradient_clip_algorithm: Optional[str],
        fallback: ClipFallback,
    ) -> Optional[Tensor]:
        """By norm: the root ``FullyShardedDataParallel.clip_grad_norm_`` (the policy after :meth:`configure`, else
        the strategy's wrapped module); by value: Lightning's ``fallback``."""
        if clips_by_norm(gradient_clip_val, gradient_clip_algorithm):
            for root in (_root(policy), _root(self.strategy.model)):
                if root is not None:
                    return root.clip_grad_norm_(float(gradient_clip_val))
        fallback(optimizer, gradient_clip_val, gradient_clip_algorithm)
        return None

    def export_state_dict(self, policy: nn.Module) -> Optional[dict[str, Any]]:
        """The full state dict (on CPU) for rank 0. A collective. torch's FSDP1 rank-0-only gather with CPU offload
        crashes (segfault) when the parameters are on CPU already: there every rank gathers."""
        if not is_fsdp1(policy):
            return None
        return full_state_dict(policy, rank0_only=self.strategy.root_device.type != "cpu")
