"""GRPO micro-batches through megatron-core's forward-backward schedules (pipeline parallelism).

megatron-core runs the forward and backward passes of all micro-batches of one optimizer step in one call,
``get_forward_backward_func()(forward_step_func=..., data_iterator=..., num_microbatches=...)``: with PP > 1
the non-interleaved 1F1B schedule (``forward_backward_pipelining_without_interleaving``: warm-up forwards, then
one forward and one backward alternately, then the cool-down backwards; Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", sec. 2.2), with PP = 1 a plain loop
(``forward_backward_no_pipelining``). Every stage calls it with the same micro-batches; the activations travel
between stages by send/recv (each stage sends the shape first: ``variable_seq_lengths``), and the loss function
runs on the last stage only.

:func:`run_schedule` is that call for GRPO: each micro-batch (an
:class:`~lightning_grpo.training.experience.Experience`) is laid out as in
:meth:`~lightning_grpo.strategies.megatron.policy.MegatronPolicy.completion_logprobs` (each row's prompt from
position 0, then its completion), the last stage turns the vocab-parallel logits of the completion positions into
logprobs (:func:`~lightning_grpo.strategies.megatron.vocab_parallel.vocab_parallel_logprobs`) and hands them to the
caller's ``loss`` (the GRPO objective), and the results are broadcast from the last stage to the others, so that
every rank returns the same list.

megatron-core divides each micro-batch's loss by the number of micro-batches before its backward; the loss the
caller returns is multiplied by that number first, so the gradient is exactly the gradient of the sum of the
returned losses (the step's normalization is the caller's: ``Experience.loss_normalizer``).
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_grpo.strategies.megatron.replay import RoutingReplay, recorded_routing, routing_layout
from lightning_grpo.strategies.megatron.vocab_parallel import vocab_parallel_logprobs
from lightning_grpo.training.packing import arrange

#: ``loss(batch, logprobs, entropy) -> (loss, payload)``: the micro-batch's loss (0-dim, with grad; its gradient is
#: accumulated as is) and what to return for it (any picklable object of tensors).
MicroBatchLoss = Callable[[Any, Tensor, Optional[Tensor]], tuple[Tensor, Any]]


def causal_mask(length: int, device: torch.device) -> Tensor:
    """megatron-core's attention mask for a causal sequence: ``(1, 1, S, S)`` bool, True where a query may
    NOT attend (keys after it)."""
    return torch.triu(torch.ones(length, length, dtype=torch.bool, device=device), diagonal=1)[None, None]


def sequence_source(batch: Any) -> tuple[Tensor, Tensor]:
    """The unpadded layout of a left-padded batch as a map of positions: ``(source, prompt_lengths)``.

    Args:
        batch: ``prompt_mask`` ``(B, P)`` (left-padded), ``completion_ids`` ``(B, T)``.

    Returns:
        ``source`` ``(B, P + T)`` long: where in ``[prompt, completion]`` each position's token is, as
        ``row * (P + T) + column`` (each row's prompt from position 0, then its completion, then filler: the row's
        last column again; the causal mask keeps filler from changing anything before it), so
        :func:`lightning_grpo.training.packing.arrange` lays any per-token field out like the tokens;
        ``prompt_lengths`` ``(B,)`` long.

    Raises:
        ValueError: a row has an empty prompt.
    """
    p, t = batch.prompt_mask.shape[1], batch.completion_ids.shape[1]
    prompt_lengths = batch.prompt_mask.sum(dim=1)  # [B]
    if (prompt_lengths == 0).any():
        raise ValueError(f"rows {(prompt_lengths == 0).nonzero().flatten().tolist()} have an empty prompt")
    offset = (p - prompt_lengths).unsqueeze(1)  # [B, 1] left padding of each row
    positions = torch.arange(p + t, device=prompt_lengths.device)
    columns = (positions.unsqueeze(0) + offset).clamp(max=p + t - 1)  # [B, P+T]
    rows = torch.arange(len(prompt_lengths), device=prompt_lengths.device).unsqueeze(1)
    return rows * (p + t) + columns, prompt_lengths


def sequence_layout(batch: Any) -> tuple[Tensor, Tensor]:
    """The unpadded layout of a left-padded batch: ``(tokens, predicting)``.

    Args:
        batch: ``prompt_ids``/``prompt_mask`` ``(B, P)`` (left-padded), ``completion_ids`` ``(B, T)``.

    Returns:
        ``tokens`` ``(B, P + T)`` long: each row's prompt from position 0, then its completion, then filler
        (:func:`sequence_source`); ``predicting`` ``(B, T)`` long: the positions whose output predicts completion
        token ``j``.

    Raises:
        ValueError: a row has an empty prompt.
    """
    source, prompt_lengths = sequence_source(batch)
    t = batch.completion_ids.shape[1]
    tokens = arrange(batch.prompt_ids, batch.completion_ids, source)  # [B, P+T]
    predicting = (prompt_lengths - 1).unsqueeze(1) + torch.arange(t, device=tokens.device)  # [B, T]
    return tokens, predicting


def replayed_routing(batch: Any, required: bool = False) -> Optional[Tensor]:
    """The batch's recorded routing laid out like :func:`sequence_layout`'s tokens, ``(B, P + T, moe_layers, top_k)``
    (:func:`~lightning_grpo.strategies.megatron.replay.routing_layout`), or None when it carries none (``required``:
    an error then, :func:`~lightning_grpo.strategies.megatron.replay.recorded_routing`)."""
    recorded = recorded_routing(batch, required)
    if recorded is None:
        return None
    source, _ = sequence_source(batch)
    return routing_layout(*recorded, source)


def keep_positions(predicting: Tensor) -> Callable[[nn.Module, tuple], tuple]:
    """A forward pre-hook for the output layer that keeps only the hidden states of the ``predicting`` positions
    ``(B, T)``: ``(S, B, H)`` -> ``(T, B, H)``, so the logits are ``(B, T, V / TP)``."""

    def hook(module: nn.Module, args: tuple) -> tuple:
        hidden = args[0]  # [S, B, H]
        t, b = predicting.shape[1], predicting.shape[0]
        index = predicting.t().unsqueeze(-1).expand(t, b, hidden.shape[-1])  # [T, B, H]
        return (hidden.gather(0, index),) + tuple(args[1:])

    return hook


def unwrap(model: nn.Module) -> nn.Module:
    """The ``GPTModel`` inside megatron-core's ``DistributedDataParallel`` wrapper (or ``model`` itself)."""
    while not hasattr(model, "post_process") and hasattr(model, "module"):
        model = model.module
    return model


def stage_forward(model: nn.Module, batch: Any, replay: Optional[RoutingReplay] = None) -> Tensor:
    """This stage's forward pass of ``batch`` (see :func:`sequence_layout`): the last stage returns the
    vocab-parallel logits of the completion positions ``(B, T, V / TP)``, the others their hidden states
    ``(P + T, B, H)`` (the input of a later stage is the one megatron-core set with ``set_input_tensor``). With
    ``replay`` (a mixture of experts' routers) the batch's recorded routing, if any, is replayed
    (:func:`replayed_routing`)."""
    tokens, predicting = sequence_layout(batch)
    if replay is not None:
        replay.push(replayed_routing(batch, replay.required))
    gpt = unwrap(model)
    handle = gpt.output_layer.register_forward_pre_hook(keep_positions(predicting)) if gpt.post_process else None
    try:
        return model(tokens, None, causal_mask(tokens.shape[1], tokens.device))
    finally:
        if handle is not None:
            handle.remove()


def run_schedule(
    model: nn.Module,
    batches: Sequence[Any],
    temperature: float,
    loss: Optional[MicroBatchLoss] = None,
    with_entropy: bool = False,
    replay: Optional[RoutingReplay] = None,
) -> list[Any]:
    """Run ``batches`` through megatron-core's schedule on this stage (see the module docstring). A collective
    over the model-parallel group: every TP and PP rank calls it with the same batches.

    Args:
        model: this stage's ``GPTModel`` (or its megatron-core ``DistributedDataParallel`` wrapper; the config's
            ``finalize_model_grads_func``/``no_sync_func``, if set, then reduce the gradients).
        batches: the micro-batches (Experiences), in order.
        temperature: the sampling temperature of the logprobs.
        loss: the micro-batch loss (forward and backward); None = forward only, no grad: the payload of each
            micro-batch is ``{"logprobs": (B, T) float32, "entropy": (B, T) float32 or None}``.
        with_entropy: compute the entropy (no grad) for ``loss`` / the payload.
        replay: this stage's routing replay (a mixture of experts): each micro-batch's recorded routing is replayed.

    Returns:
        One payload per micro-batch, in order, on every rank (on the device of the model).
    """
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import get_forward_backward_func

    forward_only = loss is None
    count = len(batches)

    def loss_func(batch: Any, logits: Tensor) -> tuple[Tensor, Any]:
        logprobs, entropy = vocab_parallel_logprobs(logits, batch.completion_ids, temperature, with_entropy)
        if loss is None:
            return logits.new_zeros((), dtype=torch.float32), {"logprobs": logprobs.detach(), "entropy": entropy}
        value, payload = loss(batch, logprobs, entropy)
        return value * count, payload  # the schedule divides by the number of micro-batches

    def forward_step(data: Iterator[Any], stage_model: nn.Module) -> tuple[Tensor, Callable]:
        batch = next(data)
        return stage_forward(stage_model, batch, replay), partial(loss_func, batch)

    if replay is not None:
        replay.clear()
    lengths = [b.prompt_ids.shape[1] + b.completion_ids.shape[1] for b in batches]
    context = torch.no_grad() if forward_only else torch.enable_grad()
    with context:
        payloads = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[model], num_microbatches=count,
            seq_length=max(lengths), micro_batch_size=max(len(b) for b in batches), forward_only=forward_only,
        )
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return list(payloads)
    device = next(unwrap(model).parameters()).device
    return _from_last_stage(list(payloads) if parallel_state.is_pipeline_last_stage() else None, device)


def _from_last_stage(payloads: Optional[list[Any]], device: torch.device) -> list[Any]:
    """The last pipeline stage's payloads on every stage (one pickled broadcast over the PP group)."""
    from megatron.core import parallel_state

    group = parallel_state.get_pipeline_model_parallel_group()
    source = torch.distributed.get_process_group_ranks(group)[-1]
    box = [None if payloads is None else _move(payloads, torch.device("cpu"))]
    torch.distributed.broadcast_object_list(box, src=source, group=group)
    return _move(box[0], device)


def detached(value: Any) -> Any:
    """``value`` (tensors in dicts, lists, tuples and dataclasses) with its tensors detached."""
    return _move(value, None)


def _move(value: Any, device: Optional[torch.device]) -> Any:
    """``value`` (tensors in dicts, lists, tuples and dataclasses) with its tensors detached (on ``device``)."""
    if isinstance(value, Tensor):
        return value.detach() if device is None else value.detach().to(device)
    if isinstance(value, dict):
        return {k: _move(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_move(v, device) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{f.name: _move(getattr(value, f.name), device)
                                             for f in dataclasses.fields(value) if f.init})
    return value
