"""The routed experts of one HF ``generate`` call, laid out like its token ids (routing replay, docs/algorithm.md).

``generate`` runs one forward call over the left-padded prompts (the prefill: ``rows * P`` positions) and then one
per generated token but the last (decode step ``s`` feeds completion token ``s - 1``: ``rows`` positions); the last
generated token is never fed to the model, so it has no routing (:data:`NO_EXPERT`), nor has padding. Further calls
(``synced_gpus``: a finished process keeps joining the others' forward passes) feed nothing of this process's rows and
are ignored.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_grpo.protocols.routing import NO_EXPERT, ROUTED_DTYPE


def generation_routing(calls: list[Tensor], rows: int, prompt_width: int, completion_width: int, moe_layers: int,
                       top_k: int) -> tuple[Tensor, Tensor]:
    """``(prompt, completion)``: ``(rows, prompt_width, moe_layers, top_k)`` and ``(rows, completion_width,
    moe_layers, top_k)`` :data:`ROUTED_DTYPE` from the forward calls of one ``generate`` (``calls[0]``: the prefill,
    ``(rows * prompt_width, moe_layers, top_k)``; ``calls[s]``: decode step ``s``, ``(rows, moe_layers, top_k)``),
    :data:`NO_EXPERT` where no call fed the position. Padding is not masked here
    (:func:`~lightning_grpo.protocols.routing.mask_routed`).

    Raises:
        ValueError: no prefill, or a call whose shape is not the one described (the call is named).
    """
    if not calls:
        raise ValueError("generate made no forward call of the policy: there is no routing to record")
    expected = (rows * prompt_width, moe_layers, top_k)
    if tuple(calls[0].shape) != expected:
        raise ValueError(f"the prefill's routing has shape {tuple(calls[0].shape)}, expected {expected} "
                         "(rows * prompt width, moe_layers, top_k)")
    prompt = calls[0].reshape(rows, prompt_width, moe_layers, top_k)
    completion = torch.full((rows, completion_width, moe_layers, top_k), NO_EXPERT, dtype=ROUTED_DTYPE,
                            device=prompt.device)
    steps = calls[1:completion_width]  # step s feeds completion token s - 1; the last token is never fed
    for s, call in enumerate(steps):
        if tuple(call.shape) != (rows, moe_layers, top_k):
            raise ValueError(f"decode step {s + 1}'s routing has shape {tuple(call.shape)}, expected "
                             f"{(rows, moe_layers, top_k)}")
        completion[:, s] = call.to(completion.device)
    return prompt.to(ROUTED_DTYPE), completion
