"""The rollout server's request bodies (pydantic models): every field typed, unknown fields refused, so a bad body
is an HTTP 400 naming the field (``body.sampling.top_p: Input should be a valid number``) before any work is done.

Token ids are strict integers (``true`` or ``1.0`` is not a token id); ranges that depend on the model (token ids
within the vocabulary, lengths within ``max_model_len``, the per-request work limit) are checked by the server
(:class:`lightning_grpo.rollout.server.app.RolloutServer`), ranges of the sampling settings by
:class:`lightning_grpo.protocols.sampling.SamplingConfig`.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from lightning_grpo.rollout.engines.multimodal import MAX_IMAGES_PER_PROMPT

#: How ``/update_weights`` treats the sequences in flight (:mod:`lightning_grpo.rollout.server.async_engine`).
UpdateMode = Literal["wait", "interrupt"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingFields(_Body):
    """:class:`~lightning_grpo.protocols.sampling.SamplingConfig`'s fields but ``seed`` (seeds travel per prompt)."""

    max_new_tokens: StrictInt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: StrictInt = 0
    min_p: float = 0.0
    greedy: StrictBool = False
    banned_token_ids: list[StrictInt] = Field(default_factory=list, max_length=64)


class GenerateRequest(_Body):
    """``POST /generate``: ``num_generations`` completions of each prompt (token-id lists), completion ``j`` of
    prompt ``i`` seeded with ``seeds[i] + j`` when ``seeds`` is given. With ``images`` (a vision-language model),
    ``images[i]`` are prompt i's pictures as base64 PNG (at most ``MAX_IMAGES_PER_PROMPT``, each at most
    ``MAX_IMAGE_BYTES``), its ids holding one placeholder token per image (vLLM expands them; the answer gives the
    expanded ids back). With ``return_routed_experts`` the answer carries the routed experts of each completion
    (a server that records them)."""

    prompts: list[list[StrictInt]]
    num_generations: StrictInt
    sampling: SamplingFields
    seeds: Optional[list[StrictInt]] = None
    images: Optional[list[Annotated[list[str], Field(max_length=MAX_IMAGES_PER_PROMPT)]]] = None
    return_routed_experts: StrictBool = False


class ProbeRequest(_Body):
    """``POST /probe_logprobs``: teacher-forced logprobs of each sequence (token-id lists)."""

    sequences: list[list[StrictInt]]


class InitWeightSyncRequest(_Body):
    """``POST /init_weight_sync``: join the trainer's group ``prefix`` in its store at ``host:port``."""

    host: str = Field(min_length=1, max_length=255)
    port: StrictInt = Field(ge=1, le=65535)
    prefix: str = Field(min_length=1, max_length=200)
    world_size: StrictInt = Field(ge=2)
    backend: Literal["gloo", "nccl"]
    timeout_s: float = Field(gt=0, le=86400)


class UpdateWeightsRequest(_Body):
    """``POST /update_weights``: receive the weights streamed now and serve them as ``version``; ``mode`` "wait"
    (the sequences in flight finish first) or "interrupt" (they continue under the new weights, their prefix
    recomputed: :mod:`lightning_grpo.rollout.server.async_engine`)."""

    version: StrictInt = Field(ge=0)
    mode: UpdateMode = "wait"


class Empty(_Body):
    """A body with no fields (``POST /close_weight_sync``)."""
