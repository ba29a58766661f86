"""The weights of an HF policy module as the engines read them: :class:`ModuleWeights`, the
:class:`~lightning_grpo.protocols.weights.PolicyWeights` that the single-device, DDP and FSDP backends give
(``ParallelBackend.configure`` -> ``GRPOModels.weights``).

A PEFT LoRA policy is streamed merged (:func:`lightning_grpo.models.hf_weights.merge_lora`), FSDP2 ``DTensor``
parameters are gathered one at a time (``full_tensor()``, a collective), FSDP1's flat shards inside
``summon_full_params`` (``gather``); the post-sync probe is a forward pass of the policy
(:func:`lightning_grpo.functional.token_logprobs` of its logits at temperature 1, in the trainer's precision).
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager, Iterator, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_grpo.functional import token_logprobs
from lightning_grpo.models.hf_weights import has_separate_head, hf_weights
from lightning_grpo.protocols.weights import PolicyWeights


class ModuleWeights(PolicyWeights):
    """The weights of an HF causal LM (possibly a PEFT model, FSDP-sharded, compiled or checkpoint-wrapped).

    Args:
        model: the policy module.
        collective: reading them is a collective (sharded parameters: FSDP).
        gather: a context in which ``model``'s parameters are whole (FSDP1's ``summon_full_params``), entered around
            :meth:`tensors`; None: they gather themselves (FSDP2 ``DTensor``) or are whole.
        separate_head: whether the policy trains its own ``lm_head``; None: read from ``model``'s parameter names
            (give it when they are FSDP1's flat names).
        forward_context: the trainer's precision context (``precision_plugin.forward_context``), entered around the
            probe's forward pass: the post-sync check compares the engine with the logprobs the trainer computes
            (bf16 autocast under ``precision="bf16-mixed"``).
    """

    def __init__(self, model: nn.Module, *, collective: bool = False,
                 gather: Optional[Callable[[nn.Module], ContextManager]] = None,
                 separate_head: Optional[bool] = None,
                 forward_context: Callable[[], ContextManager] = contextlib.nullcontext) -> None:
        self.model = model
        self._forward_context = forward_context
        self._collective = collective
        self._gather = gather
        self._separate_head = has_separate_head(model) if separate_head is None else separate_head
        config = getattr(model, "config", None)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self._vocab_size = int(getattr(config, "vocab_size", 0) or 0)

    def tensors(self) -> Iterator[tuple[str, Tensor]]:
        """:func:`lightning_grpo.models.hf_weights.hf_weights` of the model (merged LoRA; ``lm_head.weight`` added
        when the checkpoint ties embeddings), inside ``gather`` when given."""
        with self._gather(self.model) if self._gather is not None else contextlib.nullcontext():
            yield from hf_weights(self.model, self.tie_word_embeddings)

    @torch.no_grad()
    def probe_logprobs(self, sequences: Sequence[Sequence[int]]) -> Tensor:
        """A forward pass of the model (in its current mode, inside ``forward_context``; a collective under FSDP,
        every rank calls it)."""
        device = next(self.model.parameters()).device
        ids = torch.tensor([list(s) for s in sequences], dtype=torch.long, device=device)
        with self._forward_context():
            logits = self.model(input_ids=ids).logits[:, :-1]
            logprobs, _ = token_logprobs(logits, ids[:, 1:])
        return logprobs.float().cpu()

    @property
    def vocab_size(self) -> int:
        """The model config's ``vocab_size``."""
        return self._vocab_size

    @property
    def separate_head(self) -> bool:
        return self._separate_head

    @property
    def collective(self) -> bool:
        return self._collective

    @property
    def device(self) -> torch.device:
        """The device of the model's first parameter."""
        return next(self.model.parameters()).device
