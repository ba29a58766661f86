"""Routing replay for a megatron-core mixture of experts: the trainer's routers send each token to the experts the
sampler routed it to (rollout routing replay, "R3": Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by
Aligning Training and Inference Routers", arXiv:2510.11370), so that the trained policy and the sampler score the
same expert mixture; only the *selection* is replayed, the routing weights are the live router's (the softmax of
its logits over the replayed experts, or their softmax scores without ``norm_topk_prob``), so the router still gets a
gradient.

The rollout carries the routing as two per-token fields (:mod:`lightning_grpo.protocols.tokens`):
``prompt_routed_experts`` ``(N, P, moe_layers, top_k)`` and ``completion_routed_experts`` ``(N, T, moe_layers,
top_k)``, int, padded with -1, aligned with the prompt and completion ids. :func:`routing_layout` lays them out like
the scorer's own input ids (:func:`lightning_grpo.training.packing.arrange` with the unpadded layout's map of
positions, :func:`~lightning_grpo.strategies.megatron.pipeline.sequence_source`), so a replayed choice sits on
exactly its token (a routing padded unlike its ids would detach every choice from its token without an error:
google/tunix PR #2046). A token without a recorded routing (``NO_EXPERT``, -1: padding, a token never fed to the
sampler's model) is routed by the router itself, as in the HF path (:mod:`lightning_grpo.training.routing_replay`).

Mechanism: megatron-core's ``TopKRouter`` asks its ``router_replay`` (``megatron.core.transformer.moe.
router_replay.RouterReplay``, megatron-core 0.16) for the top-k of each forward; :class:`TokenRoutingReplay`, installed
on each router of this rank's pipeline stage by :class:`RoutingReplay`, answers with the target pushed for that
forward (:meth:`RoutingReplay.push`, once per micro-batch, right before its forward), rows without a target from the
live top-k. With activation recompute (``recompute_granularity="full"``) a layer's forward runs again in backward:
megatron-core's schedules run the backward passes in forward order (1F1B), so the targets of forwards run without
grad go to a first-in first-out list that the recomputations (with grad) take from, as megatron-core's own
``REPLAY_BACKWARD`` does. Under expert parallelism the router runs on the rank's own tokens before the all-to-all,
so the targets are per rank, whatever the EP size; under pipeline parallelism each stage replays its own MoE layers.

Disagreement (``sampling/router_disagreement``, as on the HF path: :mod:`lightning_grpo.training.routing_replay`):
while :meth:`RoutingReplay.counting` is open (``MegatronStrategy.train_step``: the training forward passes), each
router counts the (token, MoE layer) pairs with a replayed selection and those whose own top-k set (the live one it
computes anyway) is not the replayed one, once per forward (not again in backward's recomputation);
:func:`pipeline_sum` adds the stages' counts up.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor, nn

from lightning_grpo.models.moe import ReplayStats
from lightning_grpo.protocols.tokens import token_fields
from lightning_grpo.strategies.megatron.model import Architecture, StageLayout
from lightning_grpo.training.packing import arrange

#: The per-token fields of the recorded routing, prompt then completion.
ROUTED_FIELDS = ("prompt_routed_experts", "completion_routed_experts")


def recorded_routing(batch: Any, required: bool = False) -> Optional[tuple[Tensor, Tensor]]:
    """The batch's recorded routing ``(prompt (N, P, moe_layers, top_k), completion (N, T, moe_layers, top_k))``, or
    None when its record declares no such fields (:data:`ROUTED_FIELDS`: e.g. the rollout server's weight-sync probe)
    or holds none.

    Raises:
        ValueError: ``required`` (``GRPOConfig.routing_replay="R3"``) and an Experience without them; one of the two
            fields set and the other not.
    """
    declared = {name for name, _ in token_fields(batch)}
    if not declared.issuperset(ROUTED_FIELDS):
        return None
    prompt, completion = (getattr(batch, name) for name in ROUTED_FIELDS)  # declared per-token fields
    if prompt is None and completion is None:
        if required:
            raise ValueError("GRPOConfig.routing_replay='R3': this micro-batch carries no routed experts (the rollout "
                             "engine returned none, or the experience was made without them)")
        return None
    if prompt is None or completion is None:
        raise ValueError(f"{ROUTED_FIELDS[0] if prompt is None else ROUTED_FIELDS[1]} is missing while the other "
                         "routed-experts field is set: a rollout records the routing of its prompts and completions")
    return prompt, completion


def routing_layout(prompt: Tensor, completion: Tensor, source: Tensor) -> Tensor:
    """The recorded routing laid out like the input ids of a layout: ``(B, S, moe_layers, top_k)`` long (-1 where
    nothing was recorded).

    Args:
        prompt: ``(B, P, moe_layers, top_k)`` int, left-padded with -1.
        completion: ``(B, T, moe_layers, top_k)`` int, right-padded with -1.
        source: ``(B, S)`` long, the layout's map of each input position into ``[prompt, completion]``
            (``row * (P + T) + column``, :func:`~lightning_grpo.training.packing.arrange`).

    Raises:
        ValueError: shapes that do not match (named).
    """
    if prompt.shape[2:] != completion.shape[2:] or prompt.shape[0] != completion.shape[0]:
        raise ValueError(f"{ROUTED_FIELDS[0]} {tuple(prompt.shape)} and {ROUTED_FIELDS[1]} "
                         f"{tuple(completion.shape)} must have the same rows, moe_layers and top_k")
    return arrange(prompt.long(), completion.long(), source)  # [B, S, layers, k]


class TokenRoutingReplay:
    """The replay of one router (duck-typed as megatron-core's ``RouterReplay``: the router calls
    :meth:`get_replay_topk` only; it is not added to ``RouterReplay.global_router_replay_instances``, which would
    mix the policy's routers with the reference model's).

    Args:
        recompute: the layer's forward is recomputed in backward (full activation recompute).

    Attributes:
        recorded: when a list, each forward's chosen experts ``(tokens, top_k)`` are appended to it (tests).
        stats: when set (:meth:`RoutingReplay.counting`), each forward with a pushed target counts into it its tokens
            with a replayed selection and those whose live top-k set differs from it (not backward's recomputation).
    """

    def __init__(self, recompute: bool = False) -> None:
        self.recompute = recompute
        self._fresh: deque[Optional[Tensor]] = deque()
        self._backward: deque[Optional[Tensor]] = deque()
        self.recorded: Optional[list[Tensor]] = None
        self.stats: Optional[ReplayStats] = None

    def push(self, target: Optional[Tensor]) -> None:
        """The experts of the next forward: ``(tokens, top_k)`` long (-1 rows routed live), or None (all live)."""
        self._fresh.append(target)

    def clear(self) -> None:
        """Forget the pushed targets (the start of a schedule)."""
        self._fresh.clear()
        self._backward.clear()

    def _next(self) -> tuple[Optional[Tensor], bool]:
        """The target of this forward, and whether it is backward's recomputation of an earlier one."""
        if self._fresh:
            target = self._fresh.popleft()
            if self.recompute and not torch.is_grad_enabled():  # a checkpointed forward: recomputed in backward
                self._backward.append(target)
            return target, False
        if self.recompute and torch.is_grad_enabled() and self._backward:
            return self._backward.popleft(), True
        return None, False

    def get_replay_topk(self, scores: Tensor, topk: int, num_groups: Optional[int] = None,
                        group_topk: Optional[int] = None,
                        default_compute_topk: Optional[Callable[..., tuple[Tensor, Tensor]]] = None
                        ) -> tuple[Tensor, Tensor]:
        """``(scores of the chosen experts, their indices)``, both ``(tokens, top_k)``: the pushed target's experts,
        the live top-k (``default_compute_topk``) on rows without one. The signature is megatron-core's."""
        assert default_compute_topk is not None
        live_scores, live = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target, recomputing = self._next()
        if target is None:
            chosen = live
        else:
            if target.shape != live.shape:
                raise ValueError(f"replayed routing {tuple(target.shape)} does not match the router's tokens and "
                                 f"top-k {tuple(live.shape)}")
            target = target.to(live.device)
            given = (target >= 0).all(dim=-1)  # [tokens] a token with a replayed selection
            chosen = torch.where(given.unsqueeze(-1), target, live)
            if self.stats is not None and not recomputing:
                same = (target.sort(dim=-1).values == live.sort(dim=-1).values).all(dim=-1)
                self.stats.add((given & ~same).sum().double(), given.sum().double())
        if self.recorded is not None:
            self.recorded.append(chosen.detach().clone())
        return (live_scores, live) if target is None else (scores.gather(1, chosen), chosen)


class RoutingReplay:
    """The :class:`TokenRoutingReplay` of every router of one rank's pipeline stage of a megatron-core ``GPTModel``.

    Args:
        model: the stage's ``GPTModel``.
        arch: its architecture (a mixture of experts).
        stage: the stage.
        recompute: the layers are recomputed in backward (``TransformerConfig.recompute_granularity == "full"``).

    Attributes:
        required: every Experience scored must carry a recorded routing (``GRPOConfig.routing_replay="R3"``, set by
            ``MegatronStrategy.setup``).
    """

    def __init__(self, model: nn.Module, arch: Architecture, stage: StageLayout, recompute: bool = False) -> None:
        assert arch.moe is not None
        moe_index = {layer: i for i, layer in enumerate(arch.moe.moe_layers)}
        self.required = False
        self.slots: list[tuple[int, TokenRoutingReplay]] = []
        for local, layer in enumerate(stage.layers):
            if layer in moe_index:
                replay = TokenRoutingReplay(recompute)
                model.decoder.layers[local].mlp.router.router_replay = replay  # megatron-core's TopKRouter
                self.slots.append((moe_index[layer], replay))

    def clear(self) -> None:
        for _, replay in self.slots:
            replay.clear()

    def push(self, routing: Optional[Tensor]) -> None:
        """The routing of the next forward: ``(B, S, moe_layers, top_k)`` laid out like its ``(B, S)`` input ids
        (:func:`routing_layout`), or None (live routing). Each router gets its layer's ``(S B, top_k)``, in the
        token order of megatron-core's ``(S, B, H)`` hidden states."""
        for index, replay in self.slots:
            replay.push(None if routing is None else routing[:, :, index].transpose(0, 1).reshape(-1, routing.shape[3]))

    @contextlib.contextmanager
    def counting(self, stats: ReplayStats) -> Iterator[None]:
        """While open, this stage's routers count their disagreement with the replayed experts into ``stats``
        (:attr:`TokenRoutingReplay.stats`): ``counted`` (token, MoE layer) pairs with a replayed selection, of which
        ``differing`` the router's own top-k set is not the replayed one; one count per forward pass."""
        for _, replay in self.slots:
            replay.stats = stats
        try:
            yield
        finally:
            for _, replay in self.slots:
                replay.stats = None

    def record(self) -> list[list[Tensor]]:
        """Keep each router's chosen experts from now on; returns the lists, one per router in layer order, each
        getting ``(S B, top_k)`` per forward."""
        lists: list[list[Tensor]] = []
        for _, replay in self.slots:
            replay.recorded = []
            lists.append(replay.recorded)
        return lists


def pipeline_sum(stats: ReplayStats, group: Optional[Any], device: torch.device) -> tuple[Tensor, Tensor]:
    """``(differing, counted)`` of ``stats`` as float64 0-dim tensors on ``device``, summed over ``group`` (the
    pipeline stages, each counting its own MoE layers: a collective of the group) unless it is None."""
    zero = torch.zeros((), dtype=torch.float64, device=device)
    values = torch.stack([zero if value is None else value.to(device) for value in (stats.differing, stats.counted)])
    if group is not None:
        torch.distributed.all_reduce(values, group=group)
    return values[0], values[1]
