"""The rollout-engine interface: token ids in; completions, masks and optional sampler logprobs out.

Every engine (HF ``generate`` in :mod:`lightning_grpo.rollout.engines.hf`, vLLM in
:mod:`lightning_grpo.rollout.engines.vllm`)
implements :class:`RolloutEngine`. The trainer never depends on an engine's internals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor

from lightning_grpo.rollout.episode_record import EpisodeRecord
from lightning_grpo.rollout.sampling import sampling_errors


@dataclass(frozen=True)
class SamplingConfig:
    """How completions are sampled: the *only* settings that shape the sampled distribution. A checkpoint's
    ``generation_config.json`` (repetition penalty, no-repeat n-grams, bad words, its own temperature / top-k /
    top-p / min-p, ...) never changes a rollout; repetition, frequency and presence penalties are not supported.

    Unless ``greedy``, every engine samples from :func:`lightning_grpo.functional.sampling_logits` of the policy's
    logits: ``logits / temperature``, then min-p, top-k and top-p (vLLM's order), renormalized over the kept
    tokens. The trainer's logprobs (:func:`lightning_grpo.functional.token_logprobs` with the same four values)
    score exactly that distribution.

    Attributes:
        max_new_tokens: most tokens generated per completion (>= 1).
        temperature: softmax temperature (> 0); ignored when ``greedy``.
        top_p: nucleus mass in (0, 1]; 1.0 disables it.
        top_k: keep the k most likely tokens (>= 0); 0 disables it.
        min_p: keep the tokens whose probability is at least ``min_p`` times the largest one, in [0, 1]; 0
            disables it.
        greedy: argmax decoding (evaluation); sampler logprobs are then those of ``log_softmax(logits)``.
        seed: base of per-request seeds (completion ``j`` of prompt ``i`` gets ``seed + i * G + j``, G completions
            per prompt) for engines whose sampling can be seeded per request (vLLM, colocated or on a rollout
            server, GPU and CPU), so a resumed run regenerates the same rollouts; None = the engine's own
            generator. The HF engine, which samples from torch's global generator, ignores it.

    Raises:
        ValueError: a field out of range (named in the message).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    greedy: bool = False
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling.max_new_tokens={self.max_new_tokens!r} is invalid: must be >= 1")
        temperature = None if self.greedy else self.temperature
        for name, value, requirement in sampling_errors(temperature, self.top_p, self.top_k, self.min_p):
            raise ValueError(f"sampling.{name}={value!r} is invalid: {requirement}")


@dataclass
class RolloutOutput:
    """The completions of one rollout, in prompt-major order (the G completions of prompt i are rows
    ``i*G .. i*G+G-1``).

    Attributes:
        prompt_ids: ``(N, P)`` long, left-padded prompt ids repeated G times (N = num_prompts * G).
        prompt_mask: ``(N, P)`` long, 1 on real prompt tokens.
        completion_ids: ``(N, T)`` long, right-padded generated ids (multi-turn: the whole episode after the prompt,
            model and environment turns).
        completion_mask: ``(N, T)`` long, 1 up to and including the first EOS (any id in ``eos_token_ids``);
            multi-turn: 1 on the model's tokens only (every model turn through its EOS).
        truncated: ``(N,)`` bool, True when no EOS was generated within ``max_new_tokens`` (multi-turn: the last
            model turn has no EOS, or an observation did not fit the episode's token budget).
        completions: ``N`` decoded completion texts (special tokens skipped); multi-turn: each episode's last model
            turn.
        sampler_logprobs: ``(N, T)`` float32 logprobs of the generated tokens under the distribution the
            engine sampled them from (after temperature and truncation, see :class:`SamplingConfig`), 0 at
            masked positions; ``None`` when the engine does not report them (HF engine by default).
        weight_version: the version of the weights that sampled these completions, for engines that count their
            weight syncs (the rollout server: 0 = the checkpoint it loaded, +1 per sync); None for the others.
        env_mask: multi-turn episodes (:mod:`lightning_grpo.episodes`): ``(N, T)`` long, 1 on the environment's
            tokens (tool results, observations, the template's turn separators): attended to, never trained; the
            real tokens of a row are ``completion_mask | env_mask``, a prefix. None for single-turn rollouts.
        episodes: multi-turn: one :class:`~lightning_grpo.rollout.episode_record.EpisodeRecord` per row (turns, tool
            counts, limits, the environment's reward); None for single-turn rollouts.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    completion_ids: Tensor
    completion_mask: Tensor
    truncated: Tensor
    completions: list[str]
    sampler_logprobs: Optional[Tensor] = None
    weight_version: Optional[int] = None
    env_mask: Optional[Tensor] = None
    episodes: Optional[list[EpisodeRecord]] = None


class RolloutInterrupted(RuntimeError):
    """A rollout was stopped by its :class:`StopFlag` (e.g. on SIGTERM) before it finished; nothing of it is
    returned, and the caller discards it."""


class StopFlag:
    """A request to stop the rollout in progress, polled by the engines while they generate (the HF engine at
    every generated token, vLLM between engine steps); a stopped ``generate`` raises :class:`RolloutInterrupted`.

    The flag is set by :meth:`set` or whenever the ``watch``-ed predicate (e.g. ``lambda: trainer.received_sigterm``)
    returns True. Polling it neither consumes nor reseeds any random number generator. The engines also count the
    tokens they are generating on it (:meth:`tick`, ``ticks``: an estimate, one per running sequence per decoding
    step), which a progress bar can read while a rollout runs.
    """

    def __init__(self) -> None:
        self._set = False
        self._predicate: Optional[Callable[[], bool]] = None
        self.ticks = 0

    def tick(self, tokens: int) -> None:
        """Count ``tokens`` more tokens generated (progress only; never reset, read differences)."""
        self.ticks += tokens

    def set(self) -> None:
        self._set = True

    def clear(self) -> None:
        self._set = False

    def watch(self, predicate: Optional[Callable[[], bool]]) -> None:
        """Also count as set while ``predicate()`` is True (None: stop watching)."""
        self._predicate = predicate

    def is_set(self) -> bool:
        return self._set or (self._predicate is not None and bool(self._predicate()))

    def check(self, what: str = "the rollout") -> None:
        """Raise :class:`RolloutInterrupted` if the flag is set."""
        if self.is_set():
            raise RolloutInterrupted(f"{what} was stopped by a stop request (e.g. SIGTERM) before it finished")


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a generator: every member the rest of the package uses on an engine.

    An engine says what it is through capabilities, which the backends, the worker and the experience maker read
    instead of asking for its type: :attr:`uses_policy_parameters`, :attr:`seeds_per_request`,
    :attr:`sync_is_collective` and :attr:`reads_weight_sources`. A user engine may
    implement only the core (:class:`CoreRolloutEngine`: ``generate``, ``sync_weights``, ``pad_token_id``):
    :func:`as_rollout_engine` adds the rest with neutral defaults.
    """

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], num_generations: int, sampling: SamplingConfig
    ) -> RolloutOutput:
        """Sample ``num_generations`` completions for each prompt (given as token ids, no padding)."""
        ...

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Make the engine generate with ``model``'s current weights (called after optimizer steps)."""
        ...

    @property
    def pad_token_id(self) -> int:
        """The id that pads prompts (left) and completions (right) in :class:`RolloutOutput`."""
        ...

    @property
    def uses_policy_parameters(self) -> bool:
        """True: the engine generates with the policy module itself (HF ``generate``): its weights are always the
        trainer's, a sharding backend gathers the parameters around :meth:`generate`, and it cannot generate while
        the trainer trains (no asynchronous rollouts). False: it holds its own copy, updated by
        :meth:`sync_weights`."""
        ...

    @property
    def seeds_per_request(self) -> bool:
        """Whether ``SamplingConfig.seed`` seeds each request (completion j of prompt i with ``seed + i*G + j``), so
        a rollout is reproducible whatever the batch; False: the engine samples from torch's global generator."""
        ...

    @property
    def sync_is_collective(self) -> bool:
        """Whether :meth:`sync_weights` must be called by every trainer process together (the rollout servers:
        global rank 0 streams the weights, the others wait); False: each process syncs its own engine."""
        ...

    @property
    def reads_weight_sources(self) -> bool:
        """Whether :meth:`sync_weights` also takes an :class:`~lightning_grpo.rollout.engines.hf_weights.
        HFWeightSource` (a policy that is no transformers module and gives its weights one gathered tensor at a time:
        the Megatron policy) and reads it to the end, every tensor (colocated vLLM, the rollout servers). False: it
        is given a transformers module (the Megatron backend refreshes an HF copy of the policy for it)."""
        ...

    def set_lockstep(self, enabled: bool) -> None:
        """With ``enabled``, every process runs as many forward passes per :meth:`generate` as the longest one
        (transformers' ``synced_gpus``): needed where each forward of the policy is a collective (FSDP1 with nested
        units). A no-op for engines that do not use the policy's parameters."""
        ...

    def wake_up(self) -> None:
        """Bring the engine's weights and cache back onto the accelerator before a rollout (no-op if never slept)."""
        ...

    def sleep(self, level: int = 1) -> None:
        """Free the engine's accelerator memory until the next :meth:`wake_up` (vLLM sleep mode; a no-op where the
        engine keeps nothing between rollouts)."""
        ...

    def close(self) -> None:
        """Release the engine (processes, memory); it is not used afterwards."""
        ...


@runtime_checkable
class CoreRolloutEngine(Protocol):
    """The least a user's engine implements: ``generate``, ``sync_weights`` and ``pad_token_id`` (as in
    :class:`RolloutEngine`)."""

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], num_generations: int, sampling: SamplingConfig
    ) -> RolloutOutput: ...

    def sync_weights(self, model: torch.nn.Module) -> None: ...

    @property
    def pad_token_id(self) -> int: ...


CORE_MEMBERS = ("generate", "sync_weights", "pad_token_id")


def as_rollout_engine(engine: Any) -> RolloutEngine:
    """``engine`` as a full :class:`RolloutEngine`: itself when it implements every member, else wrapped in a
    :class:`CoreEngineAdapter` that adds the lifecycle no-ops and the default capabilities (its own weights, no
    per-request seeds, a per-process sync).

    Raises:
        TypeError: ``engine`` lacks a core member (``generate``, ``sync_weights``, ``pad_token_id``), named.
    """
    if isinstance(engine, RolloutEngine):
        return engine
    if not isinstance(engine, CoreRolloutEngine):
        missing = [name for name in CORE_MEMBERS if not hasattr(engine, name)]
        raise TypeError(f"{type(engine).__name__} is not a rollout engine: it lacks {', '.join(missing)} (a rollout "
                        "engine implements generate, sync_weights and pad_token_id; see RolloutEngine)")
    return CoreEngineAdapter(engine)


def completion_mask_from_eos(completion_ids: Tensor, eos_token_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Mask of the tokens up to and including the first EOS of each row.

    Works when pad == eos (SmolLM2, Qwen): the first EOS is found by position, not by comparing with pad.

    Args:
        completion_ids: ``(N, T)`` long generated ids (right-padded).
        eos_token_ids: every id that ends a completion (``generation_config.eos_token_id`` may be a list).

    Returns:
        ``(mask, truncated)``: ``(N, T)`` long mask and ``(N,)`` bool, True where no EOS occurs.

    Raises:
        ValueError: if ``eos_token_ids`` is empty.
    """
    if len(eos_token_ids) == 0:
        raise ValueError("eos_token_ids is empty: the tokenizer/generation_config defines no EOS token")
    is_eos = torch.isin(completion_ids, torch.as_tensor(list(eos_token_ids), device=completion_ids.device))
    n, t = completion_ids.shape
    has_eos = is_eos.any(dim=1)
    first = torch.where(has_eos, is_eos.int().argmax(dim=1), torch.full((n,), t, device=completion_ids.device))
    positions = torch.arange(t, device=completion_ids.device).expand(n, t)
    mask = (positions <= first.unsqueeze(1)).long()
    return mask, ~has_eos


def finish_rollout(prompt_ids: Tensor, prompt_mask: Tensor, num_generations: int, completion_ids: Tensor,
                   completion_mask: Tensor, truncated: Tensor, sampler_logprobs: Optional[Tensor], tokenizer: Any,
                   pad_token_id: int, weight_version: Optional[int] = None) -> RolloutOutput:
    """The :class:`RolloutOutput` of ``B`` left-padded prompts (``(B, P)`` ids and mask, repeated G times here) and
    their ``B * G`` completions; the texts are decoded with ``tokenizer`` from the masked ids (pad where masked,
    special tokens skipped)."""
    texts = tokenizer.batch_decode((completion_ids * completion_mask + pad_token_id * (1 - completion_mask)).tolist(),
                                   skip_special_tokens=True)
    return RolloutOutput(prompt_ids=prompt_ids.repeat_interleave(num_generations, dim=0),
                         prompt_mask=prompt_mask.repeat_interleave(num_generations, dim=0),
                         completion_ids=completion_ids, completion_mask=completion_mask, truncated=truncated,
                         completions=texts, sampler_logprobs=sampler_logprobs, weight_version=weight_version)


def eos_token_ids_from(generation_config: Any, tokenizer: Any) -> list[int]:
    """Every id that ends a completion: ``generation_config.eos_token_id`` (an int or a list) plus the
    tokenizer's ``eos_token_id``, sorted."""
    ids: set[int] = set()
    configured = getattr(generation_config, "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured is not None:
        ids.update(int(i) for i in configured)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


class EngineWrapper:
    """Base of engines that wrap another engine (FSDP's gathered generation, Megatron's tensor-parallel
    broadcast): forwards each :class:`RolloutEngine` member to ``self.engine`` explicitly; subclasses override
    what they change.

    Args:
        engine: the wrapped engine.
    """

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], num_generations: int, sampling: SamplingConfig
    ) -> RolloutOutput:
        """``engine.generate``."""
        return self.engine.generate(prompt_ids, num_generations, sampling)

    def sync_weights(self, model: torch.nn.Module) -> None:
        """``engine.sync_weights``."""
        self.engine.sync_weights(model)

    def wake_up(self) -> None:
        """``engine.wake_up()``."""
        self.engine.wake_up()

    def sleep(self, level: int = 1) -> None:
        """``engine.sleep(level)``."""
        self.engine.sleep(level)

    def close(self) -> None:
        """``engine.close()``."""
        self.engine.close()

    def set_lockstep(self, enabled: bool) -> None:
        """``engine.set_lockstep(enabled)``."""
        self.engine.set_lockstep(enabled)

    @property
    def pad_token_id(self) -> int:
        """``engine.pad_token_id``."""
        return self.engine.pad_token_id

    @property
    def uses_policy_parameters(self) -> bool:
        """``engine.uses_policy_parameters``."""
        return self.engine.uses_policy_parameters

    @property
    def seeds_per_request(self) -> bool:
        """``engine.seeds_per_request``."""
        return self.engine.seeds_per_request

    @property
    def sync_is_collective(self) -> bool:
        """``engine.sync_is_collective``."""
        return self.engine.sync_is_collective

    @property
    def reads_weight_sources(self) -> bool:
        """``engine.reads_weight_sources``."""
        return self.engine.reads_weight_sources


class CoreEngineAdapter(EngineWrapper):
    """A user engine with only the core members (:class:`CoreRolloutEngine`) as a full :class:`RolloutEngine`:
    ``wake_up``, ``sleep``, ``close`` and ``set_lockstep`` do nothing; it holds its own weights
    (``uses_policy_parameters`` False: ``sync_weights`` is called after every ``engine.sync_every`` optimizer steps)
    and does not seed per request."""

    def __init__(self, engine: CoreRolloutEngine) -> None:
        self.engine = engine  # type: ignore[assignment]

    def wake_up(self) -> None:
        """Nothing to do."""

    def sleep(self, level: int = 1) -> None:
        """Nothing to do."""

    def close(self) -> None:
        """Nothing to do."""

    def set_lockstep(self, enabled: bool) -> None:
        """Nothing to do."""

    @property
    def uses_policy_parameters(self) -> bool:
        """False: a user engine is taken to hold its own weights."""
        return False

    @property
    def seeds_per_request(self) -> bool:
        """False."""
        return False

    @property
    def sync_is_collective(self) -> bool:
        """False: each process syncs its own engine."""
        return False

    @property
    def reads_weight_sources(self) -> bool:
        """False: a user engine is given a transformers module."""
        return False
