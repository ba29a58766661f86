"""Streaming rollouts' shared vocabulary (fully asynchronous RL, as AReaL runs it: arXiv:2505.24298): groups sampled
concurrently while the trainer trains, each token stamped with the version of the weights that produced it, and new
weights taken in flight, without waiting for the sequences being generated.

* :class:`GroupRequest`: one prompt's group to sample (the prompt's place in the data order is its ``key``);
* :class:`SampledCompletion`, :class:`SampledGroup`: what came back, per token: the ids, the sampler's logprobs and
  the weight version of each token, and any other per-token field by name (aligned with the ids);
* :class:`WeightUpdate`: what one in-flight weight update cost (the seconds generation paused for it);
* :class:`StreamingEngine`: what samples groups that way (the rollout servers' pool; a scripted engine in tests);
* :class:`EngineUnavailable`: the engine that had a group cannot finish it (its server died): the group is sampled
  again elsewhere, never lost, never trained twice.

Versions: a version is the number of weight updates the engine had received when it computed the token's distribution
(0 = the weights it started from); the trainer stamps each update with its optimizer step, so ``trainer version -
token version`` is the token's age in optimizer steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Protocol

from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.protocols.weights import PolicyWeights


class EngineUnavailable(RuntimeError):
    """The engine (a server) that was sampling a group is gone: the group's partial completions are lost and the group
    is sampled again from its prompt (on another server, or on this one once it is back and has the current weights)."""


@dataclass(frozen=True)
class GroupRequest:
    """One prompt's group: ``num_generations`` completions of ``prompt_ids``.

    Attributes:
        key: the prompt's place in the run's data order (unique in the run): what the streaming cursor counts as drawn,
            in flight, ready and trained, so a resume knows which prompts are done; negative for the groups of a
            one-off rollout (validation, ``GRPOModule.generate``), which are not the stream's.
        prompt_ids: the prompt's token ids (unpadded, non-empty).
        num_generations: G (>= 1).
        sampling: the sampling distribution and ``max_new_tokens`` (its ``seed`` unused: see ``seed``).
        seed: completion ``j`` is sampled with seed ``seed + j`` (engines that seed per request), or None.
    """

    key: int
    prompt_ids: tuple[int, ...]
    num_generations: int
    sampling: SamplingConfig
    seed: Optional[int] = None


@dataclass
class SampledCompletion:
    """One completion as sampled, every per-token list aligned with ``token_ids``.

    Attributes:
        token_ids: the generated ids (through the EOS when it stopped, unpadded).
        logprobs: the sampler's logprob of each token under the distribution and weights that sampled it (the
            behaviour policy, token by token).
        versions: the weight version that produced each token (non-decreasing; a completion that spans an update has
            two or more).
        finish_reason: "stop" (an EOS or a stop token) or "length" (``max_new_tokens`` reached: truncated).
        extra: other per-token fields by name, each a list aligned with ``token_ids`` (e.g. the experts each token was
            routed to), plus, for fields of the prompt's tokens, lists aligned with the prompt.
    """

    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: Literal["stop", "length"]
    extra: dict[str, list[Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (len(self.token_ids) == len(self.logprobs) == len(self.versions)):
            raise ValueError(f"a sampled completion has {len(self.token_ids)} token ids, {len(self.logprobs)} logprobs "
                             f"and {len(self.versions)} versions: one each per token")
        if any(b < a for a, b in zip(self.versions, self.versions[1:], strict=False)):
            raise ValueError(f"a sampled completion's versions decrease: {self.versions}")


@dataclass
class SampledGroup:
    """A group as sampled.

    Attributes:
        request: what was asked.
        completions: ``request.num_generations`` completions, in seed order.
        engine: which engine (server) sampled it, for the balance and fault metrics.
        attempts: how many times the group was sampled from its prompt (1 = first time; more after an engine was lost).
    """

    request: GroupRequest
    completions: list[SampledCompletion]
    engine: str = ""
    attempts: int = 1

    def __post_init__(self) -> None:
        if len(self.completions) != self.request.num_generations:
            raise ValueError(f"group {self.request.key}: {len(self.completions)} completions for num_generations="
                             f"{self.request.num_generations}")

    @property
    def oldest_version(self) -> int:
        """The oldest weight version of any token of the group (the age bound is checked against it); -1 when no
        completion has a token."""
        versions = [c.versions[0] for c in self.completions if c.versions]
        return min(versions) if versions else -1


@dataclass(frozen=True)
class WeightUpdate:
    """What one in-flight weight update took.

    Attributes:
        version: the version the engines hold now.
        seconds: wall seconds of the whole update on the trainer's side (send, load, acknowledge).
        paused_s: the longest time any engine's generation was paused for it.
        engines: how many engines received it.
    """

    version: int
    seconds: float
    paused_s: float
    engines: int


class StreamingEngine(Protocol):
    """Samples groups concurrently (continuous batching: a request joins the running batch) and takes new weights in
    flight: after :meth:`update_weights` returns, every engine holds the new weights and the sequences that were in
    flight continue under them (their later tokens carry the new version). The rollout servers' pool implements it;
    tests use a scripted one. It may declare ``returns_routed_experts = True`` (routing replay "R3"): every
    completion then carries ``prompt_routed_experts`` and ``completion_routed_experts`` among its ``extra`` fields,
    ``(length, moe_layers, top_k)`` nested lists aligned with its prompt's ids and with its own."""

    async def sample_group(self, request: GroupRequest) -> SampledGroup:
        """Sample one group (awaitable on the producer's event loop; many are in flight at once).

        Raises:
            EngineUnavailable: the engine sampling it was lost (the caller samples the group again).
        """
        ...

    def update_weights(self, weights: PolicyWeights, version: int) -> WeightUpdate:
        """Give every engine ``weights`` as version ``version``, without waiting for the groups in flight (called on
        the trainer's thread, by every trainer process when ``weights.collective``)."""
        ...

    @property
    def version(self) -> int:
        """The weight version the engines hold (-1 before the first update)."""
        ...

    def close(self) -> None:
        """Stop sampling and release the engines' connections (groups in flight raise :class:`EngineUnavailable`)."""
        ...
