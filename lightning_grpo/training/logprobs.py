"""Per-token logprobs of the completions under a model: the three forward layouts and the no-grad batched pass.

* padded: ``(B, P + T)`` rows with an attention mask (``GRPOConfig.padding_free=False``);
* packed: the real tokens packed into rows with restarting position ids
(:func:`lightning_grpo.training.packing.pack_sequences`);
* shared prefix: each group of sequences sharing a prompt is one row, the prompt computed once
  (:func:`lightning_grpo.training.packing.shared_prefix_rows`, a custom 4-D attention mask; sdpa/eager attention).

All three give the same logprobs and gradients (tests assert 1e-5); only the completion positions are scored on the
padding-free paths, and only the loss positions on the padded one. With ``GRPOConfig.lm_head_chunk_size`` (the
default) the logprobs are computed from the output layer's input chunk by chunk
(:mod:`lightning_grpo.training.logprob_head`): no ``[K, V]`` logits, in forward or backward; else from the logits.
Multi-turn episodes lay out their environment tokens too
(:attr:`~lightning_grpo.training.experience.Experience.completion_attention_mask`: attended to, their logprobs computed
and masked out of the loss). A vision-language policy gets each layout's images and 3-D positions
(:mod:`lightning_grpo.training.vision_layouts`); its image placeholder tokens are out of the distribution, as the
engines never sample them (``banned_token_ids``). A backend whose models score their completions themselves (the
Megatron
policy: vocab-parallel) says so once, with a :class:`CompletionScorer` (``GRPOModels.scorer``,
:meth:`CompletionLogprobs.use`).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, ContextManager, Optional, Protocol

import torch
from torch import Tensor, nn

from lightning_grpo import functional as F
from lightning_grpo.config import GRPOConfig
from lightning_grpo.protocols.vision import VisionSpec
from lightning_grpo.training.experience import Experience
from lightning_grpo.training.layout_limits import layout_limits
from lightning_grpo.training.logprob_head import Truncation, plain_output_layer, scoring_head
from lightning_grpo.training.packing import (
    merge_rows,
    pack_sequences,
    padded_source,
    sequence_token_counts,
    shared_prefix_rows,
    token_budget_partition,
)
from lightning_grpo.training.routing_replay import PolicyRouting
from lightning_grpo.training.vision_layouts import VisionInputs

log = logging.getLogger(__name__)

#: ``(model inputs, target ids (1, K), (rows, cols) of the K targets in the padded completion layout, the layout's
#: source map: :func:`lightning_grpo.training.packing.arrange`)``
Pass = tuple[dict, Tensor, tuple[Tensor, Tensor], Tensor]


class PositionInputs(Protocol):
    """Per-position inputs of the policy's forward pass beyond its ids, taken from a micro-batch's per-token fields
    (:mod:`lightning_grpo.protocols.tokens`): e.g. the experts each token was routed to by the sampler, replayed in
    the trainer. Given to :meth:`CompletionLogprobs.add_position_inputs`; every forward layout calls it with its
    ``source`` map, so the values are laid out exactly like the layout's input ids
    (:func:`lightning_grpo.training.packing.arrange`)."""

    def __call__(self, batch: Experience, source: Tensor) -> ContextManager[object]:
        """A context the forward pass of ``batch`` in the layout mapped by ``source`` runs in."""
        ...


class CompletionScorer(Protocol):
    """How a backend's models score completions themselves (Megatron's vocab-parallel logprobs,
    :meth:`lightning_grpo.strategies.megatron.policy.MegatronPolicy.completion_logprobs`): :class:`CompletionLogprobs`
    hands it the model and the micro-batch instead of running a forward layout. It scores the untruncated tempered
    distribution, without an entropy gradient (:func:`check_untruncated_scoring`)."""

    def __call__(self, model: nn.Module, batch: Experience, temperature: float,
                 with_entropy: bool) -> tuple[Tensor, Optional[Tensor]]:
        """``(B, T)`` float32 logprobs of ``batch``'s completion tokens under ``model`` at ``temperature`` (and the
        ``(B, T)`` entropy, no grad, with ``with_entropy``)."""
        ...


def check_untruncated_scoring(config: GRPOConfig, scorer: str, entropy_grad: bool) -> None:
    """Raise ``ValueError`` when ``config`` needs what a scorer of the untruncated tempered distribution without an
    entropy gradient (the Megatron policy's vocab-parallel logprobs) does not give: ``entropy_coef > 0`` with
    ``entropy_grad``, or top-k / top-p / min-p truncation. ``scorer`` names it in the message."""
    if entropy_grad:
        raise ValueError(f"GRPOConfig.entropy_coef={config.entropy_coef} needs the entropy's gradient, which "
                         f"{scorer} does not provide: set entropy_coef=0")
    if config.top_k > 0 or config.top_p < 1 or config.min_p > 0:  # vocab-parallel logprobs do not truncate
        raise ValueError(f"GRPOConfig top_k={config.top_k}, top_p={config.top_p}, min_p={config.min_p}: "
                         f"{scorer} scores the untruncated distribution: set top_k=0, top_p=1.0, min_p=0")


class CompletionLogprobs:
    """Completion logprobs (and entropy) of a batch under a model, in the layout ``config`` selects.

    Args:
        config: the algorithm settings (``temperature``, ``padding_free``, ``shared_prefix``, ``packed_row_tokens``,
            ``entropy_coef``).
        vision: a vision-language policy's image facts (:func:`lightning_grpo.protocols.vision.vision_spec`): the
            batches' images go into every layout and its placeholder tokens are never sampled; None for a causal LM.

    Attributes:
        scorer: the backend's own scorer of its models (:meth:`use`), else None.
        routing: the policy's routing (a mixture-of-experts policy with routing replay or the load-balancing loss:
            :meth:`use_routing`), else None.
        sharded: the models all-gather their parameters on every forward call (FSDP): the padding-free paths then
            make one large forward pass instead of one per row (:meth:`use`; default False).
        scorer_replays_routing: the scorer replays the batches' routed experts itself (:meth:`use`; Megatron): the
            routing's per-position inputs are then its, not an error.
    """

    def __init__(self, config: GRPOConfig, vision: Optional[VisionSpec] = None) -> None:
        self.config = config
        self.vision = vision
        self.scorer: Optional[CompletionScorer] = None
        self.sharded = False
        self.scorer_replays_routing = False
        self.position_inputs: list[PositionInputs] = []
        self.routing: Optional[PolicyRouting] = None

    def add_position_inputs(self, inputs: PositionInputs) -> None:
        """Run every forward pass of the padded, packed and shared-prefix layouts inside ``inputs(batch, source)``."""
        self.position_inputs.append(inputs)

    def use_routing(self, routing: Optional[PolicyRouting]) -> None:
        """A mixture-of-experts policy's routing replay and load-balancing loss (:mod:`lightning_grpo.training.
        routing`): a :class:`PositionInputs` of every forward pass (it acts on the policy's routers only; the
        reference's pass suspends it: :meth:`PolicyRouting.suspended`), which the logprob passes find here (``R2``
        recording, the diagnostics). None: nothing."""
        self.routing = routing
        if routing is not None:
            self.add_position_inputs(routing)

    def _positions(self, batch: Experience, source: Tensor) -> ContextManager[object]:
        """The contexts of :attr:`position_inputs` for one forward pass, entered in order."""
        stack = contextlib.ExitStack()
        for inputs in self.position_inputs:
            stack.enter_context(inputs(batch, source))
        return stack

    def use(self, scorer: Optional[CompletionScorer], sharded: bool, scorer_replays_routing: bool = False) -> None:
        """What the trainer's backend said of its models (``GRPOModels.scorer``, ``GRPOModels.sharded``,
        ``GRPOModels.scorer_replays_routing``), once per configured run."""
        self.scorer, self.sharded = scorer, sharded
        self.scorer_replays_routing = scorer_replays_routing

    @property
    def banned_token_ids(self) -> tuple[int, ...]:
        """The tokens the engines never sample (a vision-language policy's placeholders), out of the distribution."""
        return () if self.vision is None else self.vision.banned_token_ids

    def _vision(self, batch: Experience) -> Optional[VisionInputs]:
        """The image inputs of ``batch``'s layouts, or None for a batch without images.

        Raises:
            ValueError: a batch with images for a policy without images (no ``vision``).
        """
        if not any(batch.images):
            return None
        if self.vision is None:
            raise ValueError("the experience has images, but the policy is not a vision-language model: load it from "
                             "a vision-language checkpoint (GRPOModule(model=...))")
        return VisionInputs(self.vision, batch.images, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                            batch.completion_attention_mask)

    def __call__(
        self, model: nn.Module, batch: Experience, with_entropy: bool = False, entropy_grad: bool = False
    ) -> tuple[Tensor, Optional[Tensor]]:
        """Per-token logprobs ``(B, T)`` float32 of ``batch.completion_ids`` under ``model``'s sampling distribution
        (temperature, min-p / top-k / top-p truncation renormalized), and optionally the per-token entropy ``(B, T)``
        (with grad when ``entropy_grad``). Positions of rows without loss tokens are 0 on the padding-free paths.

        Raises:
            ValueError: ``entropy_grad`` or truncation with a model that computes its own logprobs (no entropy
                gradient and no truncation there), or position inputs for it (it runs no forward layout).
        """
        if self.scorer is not None:
            handled = self.routing if self.scorer_replays_routing else None  # its own replay of the routed experts
            if any(inputs is not handled for inputs in self.position_inputs):
                raise ValueError(f"{type(model).__name__} scores its completions itself, without the forward layouts "
                                 "that per-position inputs (routing replay, the load-balancing loss) need: set "
                                 "GRPOConfig.routing_replay='off' and router_aux_loss_coef=0 with this backend")
            if any(batch.images):
                raise ValueError(f"{type(model).__name__} scores text only: images in the prompts need an HF "
                                 "vision-language policy (single device, DDP or FSDP2)")
            check_untruncated_scoring(self.config, type(model).__name__, entropy_grad)
            return self.scorer(model, batch, self.config.temperature, with_entropy)
        if self.padding_free(model):
            return self._packed(model, batch, with_entropy, entropy_grad)
        return self._padded(model, batch, with_entropy, entropy_grad)

    def padding_free(self, model: nn.Module) -> bool:
        """Whether ``model``'s forward passes use the padding-free layouts: ``padding_free``, unless the model is
        sharded and a packed row may hold only one of its sequences (:mod:`lightning_grpo.training.layout_limits`):
        a sharded model's forward pass is a collective, so each rank must run one per call, which only the padded
        layout then gives."""
        if not (self.config.padding_free and self.sharded):
            return self.config.padding_free
        config = getattr(model, "config", None)
        limits = layout_limits(config)
        if not limits.several_sequences:
            _log_once(config, "padding-free rows of a sharded model", limits.reason())
        return limits.several_sequences

    @torch.no_grad()
    def batched(
        self,
        model: nn.Module,
        experience: Experience,
        micro_batch_size: int,
        forward_context: Callable[[], ContextManager] = contextlib.nullcontext,
        max_tokens: Optional[int] = None,
        around: Optional[Callable[[Tensor, Experience], ContextManager[object]]] = None,
    ) -> Tensor:
        """Logprobs ``(N, T)`` float32 of every completion of ``experience`` under ``model`` in eval mode, no grad,
        in chunks of ``micro_batch_size`` sequences (of ``max_tokens`` tokens when given: the run's resolved
        ``max_tokens_per_microbatch``), inside ``forward_context()`` (the trainer's precision context) and, for each
        chunk, ``around(rows, chunk)`` (``chunk = experience.select(rows)``; e.g. routing replay "R2" recording the
        old policy's routing)."""
        if max_tokens is not None:
            counts = sequence_token_counts(experience.prompt_mask, experience.completion_attention_mask).tolist()
            parts = [torch.tensor(p, dtype=torch.long) for p in token_budget_partition(counts, max_tokens)]
        else:
            parts = list(torch.arange(len(experience)).split(max(1, micro_batch_size)))
        ids = experience.completion_ids
        result = torch.zeros(ids.shape, dtype=torch.float32, device=ids.device)  # float32 under any default dtype
        was_training = model.training
        model.eval()
        try:
            with forward_context():
                for index in parts:
                    part = experience.select(index)
                    with around(index, part) if around is not None else contextlib.nullcontext():
                        logprobs, _ = self(model, part)
                    result[index.to(result.device), : logprobs.shape[1]] = logprobs.float()
        finally:
            model.train(was_training)
        return result

    def forward_tokens(self, model: nn.Module, batch: Experience) -> int:
        """Tokens the training forward pass of ``batch`` computes: with ``padding_free`` the real tokens of the rows
        with loss tokens (a prompt shared by a group once, with ``shared_prefix``), else the padded ``B * (P + T)``."""
        if not (self.padding_free(model) and batch.completion_mask.any()):
            return int(batch.prompt_ids.numel() + batch.completion_ids.numel())
        has_loss = batch.completion_mask.any(dim=1)
        completion_tokens = int(batch.completion_attention_mask.sum())
        if self.shared_prefix(model, batch):
            vision = self._vision(batch)
            keys = vision.prompt_keys() if vision is not None else [None] * len(batch)
            prompts = {(tuple(batch.prompt_ids[i][batch.prompt_mask[i].bool()].tolist()), keys[i])
                       for i in has_loss.nonzero().flatten().tolist()}
            return sum(len(p) for p, _ in prompts) + completion_tokens
        return int(batch.prompt_mask[has_loss].sum()) + completion_tokens

    def shared_prefix(self, model: nn.Module, batch: Experience) -> bool:
        """Whether the padding-free forward of ``model`` lays out ``batch`` in shared-prefix rows: sdpa/eager
        attention, and the rows' 4-D mask is exact for its layers (:mod:`lightning_grpo.training.layout_limits`:
        not with a layer that reads no mask, nor with a sequence longer than a sliding window)."""
        config = getattr(model, "config", None)
        implementation = str(getattr(config, "_attn_implementation", ""))
        if not (self.config.shared_prefix and implementation in ("sdpa", "eager")):
            return False
        limits = layout_limits(config)
        longest = int((batch.prompt_mask.sum(dim=1) + batch.completion_attention_mask.sum(dim=1)).max())
        if limits.shared_prefix(longest):
            return True
        _log_once(config, "shared-prefix rows", limits.reason())
        return False

    # ------------------------------------------------------------------------------------------------ layouts
    def _padded(
        self, model: nn.Module, batch: Experience, with_entropy: bool, entropy_grad: bool
    ) -> tuple[Tensor, Optional[Tensor]]:
        input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)  # [B, P+T]
        attention_mask = torch.cat([batch.prompt_mask, batch.completion_attention_mask], dim=1)  # [B, P+T]
        position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)  # [B, P+T]
        t = batch.completion_ids.shape[1]
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      logits_to_keep=t + 1)
        vision = self._vision(batch)
        if vision is not None:
            inputs.update(vision.padded(input_ids, position_ids))
        head = self._chunked_head(model)
        source = padded_source(*batch.prompt_ids.shape, t, device=input_ids.device)
        if head is None:
            with self._positions(batch, source):
                logits = model(**inputs, use_cache=False).logits[:, :-1]  # [B, T, V]: position j predicts token j
            return self._token_logprobs(logits, batch.completion_ids, with_entropy, entropy_grad)
        # the last position predicts nothing; only the loss positions are scored (the others are 0)
        pad = batch.completion_ids.new_zeros(batch.completion_ids.shape[0], 1)
        targets = torch.cat([batch.completion_ids, pad], dim=1)  # [B, T+1]
        select = torch.cat([batch.completion_mask.bool(), pad.bool()], dim=1)  # [B, T+1]
        with self._positions(batch, source):
            scores = self._chunked(model, head, inputs, targets, select, with_entropy, entropy_grad)  # [B, T+1, 2]
        return scores[:, :-1, 0], scores[:, :-1, 1] if with_entropy else None

    def _packed(
        self, model: nn.Module, batch: Experience, with_entropy: bool, entropy_grad: bool
    ) -> tuple[Tensor, Optional[Tensor]]:
        mask = batch.completion_attention_mask  # the tokens laid out (multi-turn: model and environment tokens)
        has_loss = batch.completion_mask.any(dim=1).nonzero().flatten()
        if has_loss.numel() == 0:
            # no loss token in the batch: the padded forward keeps the graph (and the collectives) as on other ranks
            return self._padded(model, batch, with_entropy, entropy_grad)
        if self.shared_prefix(model, batch):
            return self._shared_prefix(model, batch, with_entropy, entropy_grad)
        counts = sequence_token_counts(batch.prompt_mask[has_loss], mask[has_loss]).tolist()
        vision = self._vision(batch)
        passes: list[Pass] = []
        for part in token_budget_partition(counts, self._row_tokens(model, counts)):
            rows = has_loss[torch.tensor(part, dtype=torch.long, device=has_loss.device)]
            packed = pack_sequences(batch.prompt_ids[rows], batch.prompt_mask[rows], batch.completion_ids[rows],
                                    mask[rows])
            inputs = dict(input_ids=packed.input_ids, position_ids=packed.position_ids,
                          logits_to_keep=packed.logit_index)
            if vision is not None:  # every row here has loss tokens, so each is packed, in this order
                inputs.update(vision.packed(rows.tolist(), packed.position_ids))
            # the packed rows' source maps into the sub-batch ``rows``: map it into the whole batch's layout
            width = batch.prompt_ids.shape[1] + batch.completion_ids.shape[1]
            source = rows[packed.source // width] * width + packed.source % width
            passes.append((inputs, packed.target_ids, (rows[packed.rows], packed.cols), source))
        return self._run(model, batch, passes, tuple(batch.completion_ids.shape), with_entropy, entropy_grad)

    def _shared_prefix(
        self, model: nn.Module, batch: Experience, with_entropy: bool, entropy_grad: bool
    ) -> tuple[Tensor, Optional[Tensor]]:
        dtype = next(model.parameters()).dtype
        mask_dtype = dtype if dtype.is_floating_point else torch.float32
        vision = self._vision(batch)
        groups = shared_prefix_rows(batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                    batch.completion_attention_mask, mask_dtype,
                                    keys=None if vision is None else vision.prompt_keys())
        sizes = [g.input_ids.shape[1] for g in groups]
        passes: list[Pass] = []
        for part in token_budget_partition(sizes, self._row_tokens(model, sizes)):
            row = merge_rows([groups[i] for i in part])
            inputs = dict(input_ids=row.input_ids, position_ids=row.position_ids, attention_mask=row.attention_mask,
                          logits_to_keep=row.logit_index)
            if vision is not None:
                inputs.update(vision.shared_prefix([groups[i].rows.unique_consecutive().tolist() for i in part]))
            passes.append((inputs, row.target_ids, (row.rows, row.cols), row.source))
        return self._run(model, batch, passes, tuple(batch.completion_ids.shape), with_entropy, entropy_grad)

    def _token_logprobs(
        self, logits: Tensor, targets: Tensor, with_entropy: bool, entropy_grad: bool
    ) -> tuple[Tensor, Optional[Tensor]]:
        """Logprobs (and entropy) of the sampling distribution: temperature, then min-p / top-k / top-p truncation
        renormalized, the behaviour policy both engines sample from (docs/algorithm.md)."""
        cfg = self.config
        return F.token_logprobs(logits, targets, cfg.temperature, with_entropy=with_entropy, entropy_grad=entropy_grad,
                                top_k=cfg.top_k, top_p=cfg.top_p, min_p=cfg.min_p,
                                banned_token_ids=self.banned_token_ids)

    def _chunked_head(self, model: nn.Module) -> Optional[nn.Linear]:
        """The output layer to score through chunk by chunk (``lm_head_chunk_size``), or None: full logits."""
        if self.config.lm_head_chunk_size is None:
            return None
        return plain_output_layer(model)

    def _chunked(self, model: nn.Module, head: nn.Linear, inputs: dict, targets: Tensor, select: Tensor,
                 with_entropy: bool, entropy_grad: bool) -> Tensor:
        """``model(**inputs)`` with ``head`` scoring ``targets`` at ``select`` (:func:`scoring_head`): ``(B, S, 2)``
        float32 ``[logprob, entropy]`` per output position, no ``[B, S, V]`` logits."""
        cfg = self.config
        truncation = Truncation(cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p, self.banned_token_ids)
        with scoring_head(head, targets, select, truncation, with_entropy, entropy_grad, cfg.lm_head_chunk_size):
            return model(**inputs, use_cache=False).logits

    def _row_tokens(self, model: nn.Module, sizes: list[int]) -> int:
        """Tokens per forward pass of the padding-free paths: ``packed_row_tokens``, or automatically all rows in
        one pass for varlen flash-attention kernels or a sharded model (an all-gather per forward call), else one
        row per pass (sdpa/eager compute a combined row's attention densely); always one row per pass for a model
        whose packed sequences would see each other (:mod:`lightning_grpo.training.layout_limits`)."""
        config = getattr(model, "config", None)
        limits = layout_limits(config)
        if not limits.several_sequences:
            _log_once(config, "several sequences in one packed row", limits.reason())
            return 1
        if self.config.packed_row_tokens is not None:
            return self.config.packed_row_tokens
        implementation = str(getattr(config, "_attn_implementation", ""))
        return max(sum(sizes), 1) if "flash" in implementation or self.sharded else 1

    def _run(
        self, model: nn.Module, batch: Experience, passes: list[Pass], shape: tuple, with_entropy: bool,
        entropy_grad: bool,
    ) -> tuple[Tensor, Optional[Tensor]]:
        """Run each pass of ``batch`` and scatter its per-token logprobs (and entropy) into zero ``shape`` tensors."""
        device = passes[0][1].device
        logprobs = torch.zeros(shape, dtype=torch.float32, device=device)  # float32 also where the default is not
        entropy = torch.zeros(shape, dtype=torch.float32, device=device) if with_entropy else None
        head = self._chunked_head(model)
        for inputs, target_ids, index, source in passes:
            if head is None:
                with self._positions(batch, source):
                    out = model(**inputs, use_cache=False)
                row_logprobs, row_entropy = self._token_logprobs(out.logits, target_ids, with_entropy, entropy_grad)
            else:
                select = torch.ones_like(target_ids, dtype=torch.bool)
                with self._positions(batch, source):
                    scores = self._chunked(model, head, inputs, target_ids, select, with_entropy, entropy_grad)
                row_logprobs, row_entropy = scores[..., 0], scores[..., 1] if with_entropy else None
            logprobs = logprobs.index_put(index, row_logprobs.reshape(-1))
            if entropy is not None and row_entropy is not None:
                entropy = entropy.index_put(index, row_entropy.reshape(-1))
        return logprobs, entropy


_logged: set[tuple[str, str]] = set()


def _log_once(config: object, layout: str, reason: str) -> None:
    """Say once per model type and layout that ``layout`` is not used for the model, and why."""
    model_type = str(getattr(config, "model_type", ""))
    if (model_type, layout) not in _logged:
        _logged.add((model_type, layout))
        log.info("%s are not used for model_type %r (%s): each sequence is scored as if alone", layout, model_type,
                 reason)
