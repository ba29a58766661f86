"""Mixture-of-experts policies: which modules route, how each family turns its router's logits into the selected
experts and their mixing weights, and the hooks that record or replace that selection (routing replay, R3:
docs/algorithm.md "Routing replay").

Every supported family routes the same way in transformers 5 (``<Family>TopKRouter.forward``): ``logits = x W^T``
``(rows, E)``, ``probs = softmax(logits in float32)``, the top-k of ``probs`` are the selected experts ``(rows, k)``,
their probabilities the mixing weights, renormalized over the k when the family does so; the sparse block hands
``(weights, indices)`` to its experts. They differ only in what :class:`RouterFamily` records: whether the weights are
renormalized and their dtype. :data:`FAMILIES` is the one place that knows them (keyed by the config's
``model_type``); a new family is one entry.

:class:`MoeRouters` holds a model's routers in layer order (the ``moe_layers`` dimension of the routed-experts
fields: only the layers that route, so a dense layer of a mixed model has no column) with one forward hook each,
installed once and idle unless a recording or a replay is open:

* :meth:`MoeRouters.record`: each forward call appends the experts every router selected (the HF engine, while it
  generates);
* :meth:`MoeRouters.replay`: each router uses the given experts instead of its own top-k where one is given (``-1``:
  its own), with the mixing weights recomputed from its live logits at those experts exactly as the family computes
  them, so the router's weight still receives a gradient (the R3 paper, arXiv:2510.11370 sec. 3; slime's
  ``routing_replay.py`` gathers the live scores at the replayed indices the same way). With gradient checkpointing
  the replay that was open when a decoder layer ran forward is open again while backward recomputes it (the
  checkpoint's ``context_fn``), so the recomputed activations are those of the forward pass.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor, nn

from lightning_grpo.protocols.routing import ROUTED_DTYPE


@dataclass(frozen=True)
class RouterFamily:
    """How one family's router computes its mixing weights (transformers 5.19's ``<Family>TopKRouter.forward``).

    Attributes:
        model_type: the config's ``model_type``.
        router_class: the router module's class name (``Qwen3MoeTopKRouter``).
        renormalizes: whether the top-k probabilities are divided by their sum, given the model config
            (Qwen3-MoE and OLMoE: ``config.norm_topk_prob``; Mixtral: always).
        float32_weights: the weights stay float32 (Mixtral) instead of being cast to the logits' dtype.
    """

    model_type: str
    router_class: str
    renormalizes: Callable[[Any], bool]
    float32_weights: bool = False

    def mixing_weights(self, config: Any, logits: Tensor, experts: Tensor) -> Tensor:
        """The ``(rows, k)`` mixing weights of ``experts`` (``(rows, k)`` long) given the router's ``(rows, E)``
        logits, as the family computes them for its own top-k: ``softmax(logits in float32)`` gathered at
        ``experts``, divided by their sum when it renormalizes, in its dtype. Differentiable in ``logits``; equal
        bit for bit to the family's weights when ``experts`` is its own top-k (in its order)."""
        probs = torch.softmax(logits.float(), dim=-1)
        weights = probs.gather(-1, experts)
        if self.renormalizes(config):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights if self.float32_weights else weights.to(logits.dtype)


#: The mixture-of-experts families whose routers can be recorded and replayed, by ``model_type``.
FAMILIES: dict[str, RouterFamily] = {
    "qwen3_moe": RouterFamily("qwen3_moe", "Qwen3MoeTopKRouter", lambda c: bool(c.norm_topk_prob)),
    "olmoe": RouterFamily("olmoe", "OlmoeTopKRouter", lambda c: bool(c.norm_topk_prob)),
    "mixtral": RouterFamily("mixtral", "MixtralTopKRouter", lambda c: True, float32_weights=True),
}


def moe_family(config: Any) -> Optional[RouterFamily]:
    """The :class:`RouterFamily` of a model config (its ``model_type``), or None for a dense (or unsupported)
    model."""
    return FAMILIES.get(str(getattr(config, "model_type", "")))


class _Recording:
    """An open :meth:`MoeRouters.record`: the selection of each forward call."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        self.calls: list[list[Tensor]] = []

    def router(self, layer: int, indices: Tensor) -> None:
        if layer == 0 or not self.calls or len(self.calls[-1]) != layer:
            self.calls.append([])
        self.calls[-1].append(indices.detach().to(ROUTED_DTYPE))

    def stacked(self) -> list[Tensor]:
        """Each complete forward call's selection, ``(rows, layers, k)``."""
        return [torch.stack(c, dim=1) for c in self.calls if len(c) == self.layers]


@dataclass
class ReplayStats:
    """What the routers of replayed forward passes chose themselves, over the positions with a replayed selection:
    ``differing`` (their own top-k set is not the replayed one) of ``counted`` (position, MoE layer) pairs, as
    0-dim tensors on the model's device (added up without a device sync; None before the first count)."""

    differing: Optional[Tensor] = None
    counted: Optional[Tensor] = None

    def add(self, differing: Tensor, counted: Tensor) -> None:
        self.differing = differing if self.differing is None else self.differing + differing
        self.counted = counted if self.counted is None else self.counted + counted


class _Replay:
    """An open :meth:`MoeRouters.replay`."""

    def __init__(self, experts: Tensor, substitute: bool, stats: Optional[ReplayStats]) -> None:
        self.experts = experts
        self.substitute = substitute
        self.stats = stats


class MoeRouters:
    """The routers of a mixture-of-experts model in layer order, with their hooks (see the module docstring).

    Args:
        model: the model (a transformers causal LM of a :data:`FAMILIES` family; a PEFT policy's base model).

    Attributes:
        family: the model's :class:`RouterFamily`.
        routers: its router modules, in the order of their layers (``moe_layers = len(routers)``).
        num_experts, top_k: experts per layer and experts per token.

    Raises:
        ValueError: the model is not of a supported family, or has no router.
    """

    def __init__(self, model: nn.Module) -> None:
        config = getattr(model, "config", None)  # an HF model's config
        family = moe_family(config)
        if family is None:
            raise ValueError(f"{type(model).__name__} (model_type={getattr(config, 'model_type', None)!r}) is not a "
                             f"mixture-of-experts model of a supported family ({', '.join(sorted(FAMILIES))})")
        self.family = family
        self.config = config
        self.routers = [m for m in model.modules() if type(m).__name__ == family.router_class]
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no {family.router_class} module")
        self.num_experts = int(self.routers[0].num_experts)
        self.top_k = int(self.routers[0].top_k)
        self._layer = {module: i for i, module in enumerate(self.routers)}
        self._checkpointed = [m for m in model.modules() if _is_checkpointing_layer(m)]
        self._recording: Optional[_Recording] = None
        self._replay: Optional[_Replay] = None
        self._recomputing = False
        self._observers: tuple[Callable[[int, Tensor, Tensor, bool], None], ...] = ()
        for module in self.routers:
            module.register_forward_hook(self._hook)

    @property
    def moe_layers(self) -> int:
        """The layers that route (the routed-experts fields' third dimension)."""
        return len(self.routers)

    @contextlib.contextmanager
    def record(self) -> Iterator[list[Tensor]]:
        """While open, every forward call of the model appends the experts its routers selected: on exit the
        yielded list holds one ``(rows, moe_layers, top_k)`` int16 tensor per forward call (``rows``: the call's
        batch times sequence positions, row-major, as the routers see them), in call order.

        Raises:
            RuntimeError: a recording or a replay is already open.
        """
        if self._recording is not None or self._replay is not None:
            raise RuntimeError("MoeRouters.record: a recording or a replay of these routers is already open")
        self._recording = recording = _Recording(self.moe_layers)
        calls: list[Tensor] = []
        try:
            yield calls
        finally:
            self._recording = None
            calls.extend(recording.stacked())

    @contextlib.contextmanager
    def replay(self, experts: Tensor, substitute: bool = True,
               stats: Optional[ReplayStats] = None) -> Iterator[None]:
        """While open, each router uses the experts ``experts[:, layer]`` (``(rows, moe_layers, top_k)``, the rows
        as the routers see them in every forward call; ``-1``: its own top-k) with its live mixing weights
        (:meth:`RouterFamily.mixing_weights`). ``substitute=False`` only counts (``stats``). With ``stats``, the
        positions whose own top-k set differs from the replayed one are counted into it (not again in backward's
        recomputation).

        Raises:
            RuntimeError: a recording or a replay is already open; (in the forward pass) a router sees another
                number of rows than ``experts`` has.
        """
        if self._recording is not None or self._replay is not None:
            raise RuntimeError("MoeRouters.replay: a recording or a replay of these routers is already open")
        self._wrap_checkpointing()
        self._replay = _Replay(experts, substitute, stats)
        try:
            yield
        finally:
            self._replay = None

    @contextlib.contextmanager
    def observe(self, observer: Callable[[int, Tensor, Tensor, bool], None]) -> Iterator[None]:
        """While open, ``observer(layer, logits, experts, recomputing)`` sees every router call of the model: its
        ``(rows, E)`` logits (with their gradient) and the ``(rows, top_k)`` experts it routes to (the replayed ones
        under :meth:`replay`); ``recomputing``: backward's recomputation of a checkpointed layer, which must run the
        same differentiable operations as the forward pass did (their results are the forward's again)."""
        self._wrap_checkpointing()
        self._observers = (*self._observers, observer)
        try:
            yield
        finally:
            self._observers = tuple(o for o in self._observers if o is not observer)

    def _hook(self, module: nn.Module, args: Any, output: tuple[Tensor, Tensor, Tensor]) -> Optional[tuple]:
        layer = self._layer.get(module)
        if layer is None:  # a copy of a router (a deep-copied reference model carries the hook)
            return None
        logits, _, indices = output
        if self._recording is not None:
            self._recording.router(layer, indices)
            return None
        result, chosen, replay = None, indices, self._replay
        if replay is not None:
            experts = replay.experts[:, layer].to(device=indices.device, dtype=torch.long)
            if experts.shape != indices.shape:
                raise RuntimeError(f"routing replay: router {layer} selects {tuple(indices.shape)} (rows, top_k) "
                                   f"experts but {tuple(experts.shape)} were given: the replayed experts are not laid "
                                   "out like this forward pass's positions")
            given = (experts >= 0).all(dim=-1)  # [rows] a position with a replayed selection
            if replay.stats is not None and not self._recomputing:
                same = (experts.sort(dim=-1).values == indices.sort(dim=-1).values).all(dim=-1)
                replay.stats.add((given & ~same).sum().double(), given.sum().double())
            if replay.substitute:
                chosen = torch.where(given.unsqueeze(-1), experts, indices)
                result = logits, self.family.mixing_weights(self.config, logits, chosen), chosen
        for observer in self._observers:
            observer(layer, logits, chosen, self._recomputing)
        return result

    def _wrap_checkpointing(self) -> None:
        """Give every checkpointed decoder layer the ``context_fn`` that reopens, while backward recomputes the
        layer, the replay that was open when it ran forward (idempotent; gradient checkpointing may be switched on
        after this object was made, e.g. by FSDP2's ``activation_checkpointing``)."""
        for layer in self._checkpointed:
            func = getattr(layer, "_gradient_checkpointing_func", None)
            if not getattr(layer, "gradient_checkpointing", False) or func is None:
                continue
            if getattr(func, "keywords", {}).get("context_fn") is self._checkpoint_contexts:
                continue
            layer._gradient_checkpointing_func = functools.partial(func, context_fn=self._checkpoint_contexts)

    def _checkpoint_contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """``torch.utils.checkpoint``'s ``context_fn``: nothing around the forward pass; around the recomputation,
        the replay and the observers that are open now (the recomputation must run the same operations)."""
        return contextlib.nullcontext(), self._reopened(self._replay, self._observers)

    @contextlib.contextmanager
    def _reopened(self, replay: Optional[_Replay], observers: tuple) -> Iterator[None]:
        previous = self._replay, self._observers, self._recomputing
        self._replay, self._observers, self._recomputing = replay, observers, True
        try:
            yield
        finally:
            self._replay, self._observers, self._recomputing = previous


def _is_checkpointing_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers decoder layer that can be gradient-checkpointed."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return isinstance(module, GradientCheckpointingLayer)
