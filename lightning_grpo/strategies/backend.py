"""The one seam between ``GRPOModule`` and a parallel backend (single device/DDP, FSDP2, FSDP1, Megatron).

The module hands its models to the backend as a :class:`GRPOModels` record and takes back the record the
backend returns: the sharded, converted or wrapped models, and what the rest of the run needs to know of them, read
once here (the policy's weights as the engines read them, its own completion scorer, whether a forward pass
all-gathers); a backend never sees the LightningModule. Everything else the module needs from the backend (gradient
norm and clipping, the full weights for export, the data-parallel reductions of metrics and loss normalizers) is one
method of :class:`ParallelBackend`. :func:`lightning_grpo.strategies.backend_for` picks the backend of a Lightning
strategy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence, Union, runtime_checkable

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_grpo.algorithm import ObjectiveOutput
from lightning_grpo.config import GRPOConfig
from lightning_grpo.protocols.collectives import Collectives
from lightning_grpo.protocols.engine import RolloutEngine
from lightning_grpo.protocols.weights import PolicyWeights
from lightning_grpo.training.experience import Experience
from lightning_grpo.training.logprobs import CompletionScorer

#: ``LightningModule.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)``: Lightning's own
#: clipping through the precision plugin, for what a backend does not clip itself.
ClipFallback = Callable[[Optimizer, Optional[Union[int, float]], Optional[str]], None]

#: ``objective(micro_batch, logprobs, entropy) -> ObjectiveOutput``: the GRPO objective of one micro-batch from the
#: policy's ``(B, T)`` float32 logprobs (with grad) and entropy (no grad, or None); ``GRPOModule.objective``.
StepObjective = Callable[[Experience, Tensor, Optional[Tensor]], ObjectiveOutput]


@dataclass
class GRPOModels:
    """The models a backend shards, converts or wraps, and what it tells of them.

    Attributes:
        policy: the trained policy (an HF causal LM before :meth:`ParallelBackend.configure`).
        ref: the frozen reference policy (``beta > 0``), else None.
        engine: the rollout engine, else None (before ``GRPOModule.setup`` makes one); :meth:`ParallelBackend.
            configure` is given the engine as it was made (or given) and returns it wrapped where it needs to.
        lora: the policy is a PEFT LoRA model (read once when it is loaded).
        weights: the policy's weights as the engines read them (LoRA merged, shards gathered); set by
            :meth:`ParallelBackend.configure`.
        scorer: computes completion logprobs for the backend's models itself (Megatron's vocab-parallel ones);
            None: :class:`~lightning_grpo.training.logprobs.CompletionLogprobs`' forward layouts.
        sharded: each forward pass of the policy and reference all-gathers their parameters (FSDP): callers make few,
            large forward calls.
        teacher: on-policy distillation's frozen teacher model (``GRPOConfig.distillation.teacher``), else None;
            a backend shards, converts and restores it as it does ``ref`` (the ``scorer`` and ``sharded`` hold for
            it too).
        scorer_replays_routing: the ``scorer`` replays the routed experts a mixture-of-experts policy's batches carry
            itself (``GRPOConfig.routing_replay="R3"``: Megatron's routers), where the forward layouts' per-position
            inputs cannot reach.
        routing_counts: ``add(differing, counted)`` (float64 0-dim tensors): where a backend whose own routers replay
            (``scorer_replays_routing``) adds, at each training step, the (token, MoE layer) pairs with a replayed
            selection (``counted``) and those whose router would have chosen another top-k set (``differing``), over
            this data-parallel rank's training forward passes: the module's ``sampling/router_disagreement``
            (:meth:`~lightning_grpo.training.routing_replay.PolicyRouting.add_replay_counts`); None: nothing to count.
    """

    policy: nn.Module
    ref: Optional[nn.Module] = None
    engine: Optional[RolloutEngine] = None
    lora: bool = False
    weights: Optional[PolicyWeights] = None
    scorer: Optional[CompletionScorer] = None
    sharded: bool = False
    teacher: Optional[nn.Module] = None
    scorer_replays_routing: bool = False
    routing_counts: Optional[Callable[[Tensor, Tensor], None]] = None


@runtime_checkable
class ParallelBackend(Protocol):
    """What ``GRPOModule`` needs from a parallel backend. Methods marked "a collective" must be called by every
    process, in the same order."""

    def configure(self, models: GRPOModels) -> GRPOModels:
        """Shard / convert the models, wrap the engine, and say what the rest of the run needs of them
        (``weights``, ``scorer``, ``sharded``), from ``GRPOModule.configure_model``. Idempotent: models configured
        already are not configured again (the engine is wrapped again: it is given as made)."""
        ...

    def restore(self, models: GRPOModels) -> GRPOModels:
        """Hand back plain HF models after a run (Megatron); the identity elsewhere. The engine is left out: the
        rollout worker keeps the engine as it was made."""
        ...

    def grad_norm(self, policy: nn.Module) -> Optional[Tensor]:
        """The 2-norm of the policy's full gradient (0-dim float32), or None before any gradient exists. A
        collective when the gradient is sharded."""
        ...

    def clip_gradients(
        self,
        policy: nn.Module,
        optimizer: Optimizer,
        gradient_clip_val: Optional[Union[int, float]],
        gradient_clip_algorithm: Optional[str],
        fallback: ClipFallback,
    ) -> Optional[Tensor]:
        """Clip by the norm of the full gradient where Lightning's clipping cannot (sharded gradients), else call
        ``fallback`` (Lightning's own clipping). Returns the total norm before clipping when the backend clipped
        by norm itself, else None."""
        ...

    def export_state_dict(self, policy: nn.Module) -> Optional[dict[str, Any]]:
        """The policy's full state dict for ``save_pretrained(state_dict=...)`` on rank 0 (on CPU; ``{}`` on the
        other ranks), or None when ``policy.save_pretrained`` saves its full weights itself. A collective under
        FSDP."""
        ...

    def reduce_sum(self, tensor: Tensor) -> Tensor:
        """``tensor`` summed over the data-parallel processes (the identity in one process). A collective."""
        ...

    def reduce_max(self, tensor: Tensor) -> Tensor:
        """``tensor``'s elementwise maximum over the data-parallel processes. A collective."""
        ...

    def collectives(self, device: torch.device) -> Collectives:
        """:meth:`reduce_sum` and :meth:`reduce_max` as one :class:`~lightning_grpo.protocols.collectives.Collectives`
        record whose flags are reduced on ``device``: what the components get instead of the backend."""
        ...

    @property
    def data_parallel_size(self) -> int:
        """Processes that hold different data (tensor-parallel ranks share theirs)."""
        ...

    @property
    def runs_whole_step(self) -> bool:
        """Whether the backend runs the forward and backward passes of all micro-batches of an optimizer step itself,
        in one :meth:`train_step` (megatron-core's pipeline schedules need every micro-batch at once). The module
        then calls :meth:`train_step` at the step's first micro-batch and neither zeroes the gradients nor runs
        a backward pass itself (Lightning's accumulation still counts the micro-batches and steps the optimizer)."""
        ...

    def train_step(self, policy: nn.Module, micro_batches: Sequence[Experience], objective: StepObjective,
                   config: GRPOConfig) -> list[ObjectiveOutput]:
        """Zero the gradients, then the forward and backward passes of ``micro_batches`` (one optimizer step, in
        order; logprobs at ``config.temperature``), so that the policy's gradient is the gradient of the sum of the
        micro-batches' ``objective(...).loss`` over them and over every data-parallel process (each loss is already
        its share of the step's normalized loss, ``Experience.loss_normalizer``). Returns each micro-batch's
        objective output, detached, on every process. A collective. Only for backends with
        :attr:`runs_whole_step`.

        Raises:
            NotImplementedError: the backend does not run whole steps.
            ValueError: ``config`` asks for something the backend's logprobs do not compute (named).
        """
        ...


def clips_by_norm(gradient_clip_val: Optional[Union[int, float]], gradient_clip_algorithm: Any) -> bool:
    """Whether Lightning's clipping settings ask for clipping by norm: a non-zero ``gradient_clip_val`` and the
    algorithm "norm" or None (Lightning's default; a ``GradClipAlgorithmType`` or a string)."""
    algorithm = str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm) or "norm").lower()
    return bool(gradient_clip_val) and algorithm == "norm"
