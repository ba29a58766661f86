"""A mixture-of-experts policy in the trainer: routing replay and the load-balancing loss, in every forward layout.

:class:`PolicyRouting` is the :class:`~lightning_grpo.training.logprobs.PositionInputs` of the policy's forward passes
(:meth:`~lightning_grpo.training.logprobs.CompletionLogprobs.add_position_inputs`: the old-logprob pass, the training
forward, the step statistics' pass; never the reference's or a teacher's). Every layout (padded, packed, shared
prefix) hands it its ``source`` map, and :func:`~lightning_grpo.training.packing.arrange` lays the micro-batch's
routed experts (``prompt_routed_experts``, ``completion_routed_experts``) and loss mask out exactly like the layout's
input ids, so the routers of :class:`~lightning_grpo.models.moe.MoeRouters` see them position by position:

* routing replay (``GRPOConfig.routing_replay``, docs/algorithm.md "Routing replay"): "R3" replays the rollout
  engine's routing; "R2" records the routing of the old-logprob pass into the experience
  (:meth:`PolicyRouting.record_old_routing`) and replays it in the updates. ``sampling/router_disagreement``: the share
  of (position, MoE layer) pairs with a replayed selection whose router would have chosen another top-k set itself,
  over the training forward passes of the step (a backend whose own routers replay, Megatron's, counts them itself:
  :meth:`PolicyRouting.add_replay_counts`);
* the load-balancing loss (``GRPOConfig.router_aux_loss_coef``): Switch Transformer's ``E * sum_e f_e P_e`` (Fedus
  et al. 2021, arXiv:2101.03961 eq. 4-6; pooled over the routing layers as transformers' ``load_balancing_loss_func``)
  over the loss tokens of the whole optimizer step on every process: ``f_e`` (no gradient) is counted by a no-grad
  pass at the step's start (:meth:`PolicyRouting.prepare_step`), so ``P_e``'s mean splits into a sum over the step's
  micro-batches and the loss and its gradient do not depend on accumulation or the process count.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
from torch import Tensor, nn

from lightning_grpo.config import GRPOConfig
from lightning_grpo.models.moe import MoeRouters, ReplayStats, moe_family
from lightning_grpo.protocols.collectives import Collectives
from lightning_grpo.protocols.routing import NO_EXPERT, ROUTED_DTYPE, RoutingRecorder, mask_routed
from lightning_grpo.training.experience import Experience
from lightning_grpo.training.packing import arrange

#: The metric of the routers' disagreement with the replayed experts (docs/training.md "Metrics").
DISAGREEMENT = "sampling/router_disagreement"


class PolicyRouting:
    """Routing replay and the load-balancing loss of a mixture-of-experts policy (see the module docstring).

    Args:
        config: the algorithm settings (``routing_replay``, ``router_aux_loss_coef``).
        routers: the policy's routers.

    Attributes:
        mode: ``config.routing_replay``.
        routers: the policy's routers (what the HF engine records with under "R3": :attr:`recorder`).
    """

    def __init__(self, config: GRPOConfig, routers: MoeRouters) -> None:
        self.config = config
        self.mode = config.routing_replay
        self.routers = routers
        self.coef = config.router_aux_loss_coef
        self._substitute = True
        self._stats = ReplayStats()
        self._counts: Optional[Tensor] = None  # the step's expert counts, pooled over layers (prepare_step)
        self._share: Optional[Tensor] = None  # [E] f_e of the prepared step
        self._step_tokens = 0.0  # the prepared step's loss tokens, all processes
        self._aux: Optional[Tensor] = None  # this forward's sum_t sum_l sum_e f_e p_le(t), with grad
        self._aux_logged: Optional[Tensor] = None  # the step's aux loss so far (no grad)
        self._captured: Optional[list[tuple[Tensor, Tensor]]] = None  # "R2": each pass's (source, experts)
        self._suspended = False

    @classmethod
    def of(cls, config: GRPOConfig, model: nn.Module) -> Optional["PolicyRouting"]:
        """The policy's routing when ``config`` asks for routing replay or the load-balancing loss, else None.

        Raises:
            ValueError: ``model`` is not a mixture-of-experts model of a supported family (the field is named).
        """
        if config.routing_replay == "off" and config.router_aux_loss_coef == 0:
            return None
        config_of_model = getattr(model, "config", None)  # an HF model's config
        if moe_family(config_of_model) is None:
            field = (f"routing_replay={config.routing_replay!r}" if config.routing_replay != "off"
                     else f"router_aux_loss_coef={config.router_aux_loss_coef}")
            raise ValueError(f"GRPOConfig.{field} needs a mixture-of-experts policy of a supported family "
                             f"(model_type qwen3_moe, olmoe or mixtral), but the policy is {type(model).__name__} "
                             f"(model_type={getattr(config_of_model, 'model_type', None)!r}): set it off")
        return cls(config, MoeRouters(model))

    @property
    def recorder(self) -> Optional[RoutingRecorder]:
        """What the HF engine records the routing with: the routers under "R3", else None (nothing recorded)."""
        return self.routers if self.mode == "R3" else None

    # ------------------------------------------------------------------------------------------ forward passes
    def __call__(self, batch: Experience, source: Tensor) -> ContextManager[object]:
        """The context of one forward pass of ``batch`` in the layout ``source`` maps
        (:class:`~lightning_grpo.training.logprobs.PositionInputs`).

        Raises:
            ValueError: "R3" and the batch carries no routed experts.
        """
        stack = contextlib.ExitStack()
        if self._suspended:
            return stack
        experts = self._experts(batch, source)
        if experts is not None:
            # the step's disagreement counts the training forward passes (with gradient) only
            stats = self._stats if not self._substitute or torch.is_grad_enabled() else None
            stack.enter_context(self.routers.replay(experts, substitute=self._substitute, stats=stats))
        if self.coef > 0 and (self._counts is not None or (self._share is not None and torch.is_grad_enabled())):
            mask = arrange(torch.zeros_like(batch.prompt_mask), batch.completion_mask, source).reshape(-1).bool()
            stack.enter_context(self.routers.observe(self._balance_observer(mask)))
        if self._captured is not None:
            captured, chosen = self._captured, []
            stack.enter_context(self.routers.observe(lambda layer, logits, experts, recomputing: chosen.append(
                experts.detach().to(ROUTED_DTYPE))))
            stack.callback(lambda: captured.append((source, torch.stack(chosen, dim=1))))
        return stack

    def _experts(self, batch: Experience, source: Tensor) -> Optional[Tensor]:
        """``(positions, moe_layers, top_k)``: the batch's routed experts laid out like the layout's input ids; None
        when nothing is replayed."""
        if self.mode == "off":
            return None
        prompt, completion = batch.prompt_routed_experts, batch.completion_routed_experts
        if prompt is None or completion is None:
            if self.mode == "R2":  # the old-policy pass itself, or a rollout trained by one step: its own routing
                return None
            raise ValueError("GRPOConfig.routing_replay='R3': this micro-batch carries no routed experts (the "
                             "rollout engine returned none, or the experience was made without them)")
        return arrange(prompt, completion, source).reshape(-1, *prompt.shape[2:])

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """While open, forward passes run without it: the reference policy's pass (the reference chooses its own
        experts: it is another model, whose distribution the KL measures; with LoRA it is the policy's modules with
        the adapters off, so it would otherwise be replayed too)."""
        previous, self._suspended = self._suspended, True
        try:
            yield
        finally:
            self._suspended = previous

    @contextlib.contextmanager
    def unreplayed(self, stats: ReplayStats) -> Any:
        """While open, the routers choose their own experts; their disagreement with the replayed ones is counted
        into ``stats`` (``routing_replay_diagnostics``)."""
        previous = self._substitute, self._stats
        self._substitute, self._stats = False, stats
        try:
            yield
        finally:
            self._substitute, self._stats = previous

    # --------------------------------------------------------------------------------------- routing replay R2
    @contextlib.contextmanager
    def recording(self, experience: Experience) -> Iterator[Callable[[Tensor, Experience], ContextManager[object]]]:
        """"R2": the old-logprob pass of ``experience`` records its routing. Yields ``around(rows, part)``, the context
        of the forward passes of ``part`` (``experience.select(rows)``: :meth:`CompletionLogprobs.batched`'s
        ``around``); on exit ``experience``'s routed-experts fields hold the experts every token was routed to
        (``-1`` at padding and where no layout laid a position out; a prompt that the shared-prefix layout laid out
        once for its group is given to every row with that prompt)."""
        n, p = experience.prompt_ids.shape
        t = experience.completion_ids.shape[1]
        layers, k = self.routers.moe_layers, self.routers.top_k
        device = experience.prompt_ids.device
        routed = torch.full((n, p + t, layers, k), NO_EXPERT, dtype=ROUTED_DTYPE, device=device)

        @contextlib.contextmanager
        def around(rows: Tensor, part: Experience) -> Iterator[object]:
            captured: list[tuple[Tensor, Tensor]] = []
            self._captured = captured
            try:
                yield
            finally:
                self._captured = None
            part_p, part_t = part.prompt_ids.shape[1], part.completion_ids.shape[1]
            buffer = torch.full((len(rows), part_p + part_t, layers, k), NO_EXPERT, dtype=ROUTED_DTYPE,
                                device=device)
            flat = buffer.view(-1, layers, k)
            for source, experts in captured:
                flat[source.reshape(-1).to(device)] = experts.to(device)
            index = rows.to(device)
            routed[index, p - part_p : p] = buffer[:, :part_p]  # the part's prompt columns are the last ones
            routed[index, p : p + part_t] = buffer[:, part_p:]  # its completion columns the first ones

        yield around
        prompt = mask_routed(routed[:, :p], experience.prompt_mask)  # the padded layout lays pads out too
        experience.prompt_routed_experts = _shared_prompts(experience.prompt_ids, experience.prompt_mask, prompt)
        experience.completion_routed_experts = mask_routed(routed[:, p:], experience.completion_attention_mask)

    # -------------------------------------------------------------------------------------- load-balancing loss
    def prepare_step(self, policy: nn.Module, members: list[Experience], score: Any,
                     collectives: Collectives) -> None:
        """The load-balancing loss's ``f_e`` for the optimizer step whose micro-batches are ``members``: a no-grad
        pass of each (``score(batch)``: the policy's forward in the training layout, with routing replay as
        configured) counts the experts its loss tokens are routed to, summed over every process (a collective)."""
        if self.coef == 0:
            return
        self._counts = torch.zeros(self.routers.num_experts, dtype=torch.float64)
        self._step_tokens = 0.0
        try:
            with torch.no_grad():
                for batch in members:
                    score(batch)
            local = torch.cat([self._counts, torch.tensor([sum(float(m.completion_mask.sum()) for m in members)],
                                                          dtype=torch.float64)])
            total = collectives.reduce_sum(local.to(collectives.device)).cpu()
        finally:
            self._counts = None
        self._step_tokens = float(total[-1])
        layers = self.routers.moe_layers
        self._share = total[:-1] / max(self._step_tokens * layers, 1.0)

    def _balance_observer(self, mask: Tensor) -> Any:
        def observe(layer: int, logits: Tensor, chosen: Tensor, recomputing: bool) -> None:
            rows = mask.to(logits.device)
            if self._counts is not None:  # the step's no-grad counting pass
                counts = torch.bincount(chosen[rows].reshape(-1), minlength=self.routers.num_experts)
                self._counts += counts.double().cpu()
                return
            assert self._share is not None
            probs = torch.softmax(logits.float(), dim=-1)[rows]  # [tokens, E]
            term = (probs * self._share.to(probs.device, torch.float32)).sum()
            if not recomputing:  # backward's recomputation runs the same operations; its results are the forward's
                self._aux = term if self._aux is None else self._aux + term

        return observe

    def aux_loss(self) -> Optional[Tensor]:
        """The load-balancing loss's share of the forward pass that just ran (0-dim float32, with its gradient):
        ``E * sum_{t, l, e} f_e p_le(t) / (layers * step tokens)``, its sum over the step's micro-batches and
        processes being the step's loss; None when the loss is off. Taken once (the next forward starts from 0).

        Raises:
            RuntimeError: the loss is on but no step was prepared (:meth:`prepare_step`).
        """
        if self.coef == 0:
            return None
        if self._share is None:
            raise RuntimeError("GRPOConfig.router_aux_loss_coef > 0 needs the step's expert shares: call "
                               "GRPOModule.prepare_step with the step's micro-batches before its training_step")
        term, self._aux = self._aux, None
        scale = self.routers.num_experts / max(self._step_tokens * self.routers.moe_layers, 1.0)
        value = term * scale if term is not None else torch.zeros((), dtype=torch.float32)
        logged = value.detach().double().cpu()
        self._aux_logged = logged if self._aux_logged is None else self._aux_logged + logged
        return value

    # -------------------------------------------------------------------------------------------------- metrics
    def add_replay_counts(self, differing: Tensor, counted: Tensor) -> None:
        """Counts of routers that replay outside these hooks (``MegatronStrategy``'s megatron-core routers,
        :mod:`lightning_grpo.strategies.megatron.replay`) into the step's ``sampling/router_disagreement``: of
        ``counted`` (token, MoE layer) pairs with a replayed selection in this rank's training forward passes,
        ``differing`` whose router would have chosen another top-k set (0-dim tensors)."""
        self._stats.add(differing, counted)

    def step_metrics(self, collectives: Collectives) -> dict[str, float]:
        """The step's routing metrics over every process (a collective), then reset: ``sampling/router_disagreement``
        with routing replay (NaN when no position had a replayed selection), ``aux_loss`` with the load-balancing
        loss."""
        stats, self._stats = self._stats, ReplayStats()
        aux, self._aux_logged = self._aux_logged, None
        values = [float(stats.differing or 0.0), float(stats.counted or 0.0), float(aux or 0.0)]
        total = collectives.reduce_sum(torch.tensor(values, dtype=torch.float64, device=collectives.device)).tolist()
        metrics: dict[str, float] = {}
        if self.mode != "off":
            metrics[DISAGREEMENT] = total[0] / total[1] if total[1] > 0 else float("nan")
        if self.coef > 0:
            metrics["aux_loss"] = total[2]
        return metrics


def _shared_prompts(prompt_ids: Tensor, prompt_mask: Tensor, routed: Tensor) -> Tensor:
    """``routed`` (``(N, P, layers, k)``) with each row whose real prompt positions were not recorded given those of
    a row with the same prompt that was (the shared-prefix layout lays a group's prompt out once)."""
    missing = ((routed < 0).all(dim=-1).all(dim=-1) & prompt_mask.bool()).any(dim=1)
    if not missing.any():
        return routed
    keys = [tuple(ids[m.bool()].tolist()) for ids, m in zip(prompt_ids, prompt_mask, strict=True)]
    recorded = {keys[i]: i for i in range(len(keys)) if not bool(missing[i])}
    out = routed.clone()
    for i in missing.nonzero().flatten().tolist():
        j = recorded.get(keys[i])
        if j is not None:
            out[i] = routed[j]
    return out
