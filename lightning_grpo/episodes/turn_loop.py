"""The turn loop: G episodes per prompt, batched by turn over every running episode, token-exact.

Each turn is one ``engine.generate`` over all the rollout's running episodes (turn 0: the prompts, G samples each;
turn t > 0: every running episode's whole sequence so far, one sample each), so the HF engine runs one batched
``generate`` per turn and vLLM (colocated or on a rollout server) schedules them together, its prefix cache reusing
each episode's earlier turns. Between turns every finished model turn goes to its episode's environment
(:func:`lightning_grpo.episodes.environment.step_all`) and each observation is encoded once
(:meth:`lightning_grpo.episodes.chat.ChatFormat.env_turn_ids`) and appended.

The trained sequence of an episode is its prompt's ids, then exactly the ids each model turn sampled (through its
EOS; never decoded and encoded again), then each observation's ids, ...: ``completion_ids`` of the
:class:`~lightning_grpo.protocols.rollout.RolloutOutput` is everything after the prompt, ``completion_mask`` is 1 on the
model's tokens (the loss, KL, entropy and every ``loss_type``'s normalizer count those only) and ``env_mask`` 1 on
the environment's (context: attended to, never trained), ``sampler_logprobs`` the engine's logprobs of the model's
tokens (0 on the environment's) and ``completion_versions`` the weight version of each model token (the turn's
per-token versions when the engine reports them, else its ``weight_version``; -1 on the environment's tokens): an
episode, and a turn, may span weight versions when the engine takes new weights while it generates.

Limits (``GRPOConfig.episode``): at most ``max_turns`` model turns; one budget of ``max_tokens`` tokens (None:
the sampling's ``max_new_tokens``, i.e. ``GRPOConfig.max_new_tokens`` in training and ``eval.max_new_tokens`` in
evaluation) for all model and environment tokens after the prompt, and at most ``max_new_tokens`` per model turn:
a model turn is cut to what remains of the budget; a model turn without EOS (cut, or at ``max_new_tokens``) ends the
episode as truncated, and so does an observation that would leave no room for a model token (it is not
appended); ``mask_truncated_completions`` then means what it means for single-turn completions.

Processes in lockstep: an engine that generates with the policy's own parameters (HF) may be a collective per call
(FSDP gathers the parameters around each ``generate``), so with ``any_process`` (the data-parallel agreement) every
process runs as many turns as the process with the longest episodes: one whose episodes are all over joins each
further turn with a one-token ``generate`` it discards, and a stop request is agreed on too. Engines with their own
weights (vLLM, rollout servers) run each process's turns independently.

Images (vision-language policies, docs/vision.md): with ``images`` (the policy's
:class:`~lightning_grpo.rollout.image_prompts.ImagePrompts`) the prompts' images go with every turn's ``generate`` (an
episode's prompt images, then those of its observations so far), and an observation may show images: its messages'
``{"type": "image", "image": <PIL image>}`` parts are written as the model's placeholder runs and their images
appended to the episode's (the rollout's ``images``); the records keep the messages without the pictures.

Routed experts (routing replay "R3", an engine that ``returns_routed_experts``): each token keeps the experts it was
routed to when an engine call first fed it to the model: the prompt's in turn 0's prefill, a model token's in the
decode step after it was sampled, and a turn's last model token and the environment's tokens in the next turn's
prefill (AReaL accumulates ``routed_experts`` across a request's segments the same way); a token no call fed (the
episode's last) has -1.

Seeds (engines that ``seeds_per_request``): turn 0 seeds completion j of prompt i with ``seed + i * G + j`` as a
single-turn rollout does; turn t > 0 seeds the r-th running episode with ``seed + t * N + r`` (N = B * G episodes),
disjoint from every other turn's seeds, so a rollout is a function of its seed base and the weights and a resumed run
regenerates it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import Tensor

from lightning_grpo.episodes.chat import ChatFormat
from lightning_grpo.episodes.environment import Environment, EnvironmentFactory, EnvStep, step_all
from lightning_grpo.episodes.episode_metrics import episode_columns, episode_metrics
from lightning_grpo.protocols.engine import RolloutEngine, generate
from lightning_grpo.protocols.episode import EpisodeRecord, Turn
from lightning_grpo.protocols.rollout import RolloutInterrupted, RolloutOutput, StopFlag, left_pad
from lightning_grpo.protocols.routing import NO_EXPERT, ROUTED_DTYPE
from lightning_grpo.protocols.sampler import EncodedPrompts
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.protocols.vision import RowImages
from lightning_grpo.rollout.image_prompts import ImagePrompts, split_images

log = logging.getLogger(__name__)


@dataclass
class _Episode:
    """One episode while it runs."""

    prompt: list[int]
    env: Environment
    ids: list[int] = field(default_factory=list)
    model: list[int] = field(default_factory=list)  # 1 = sampled by the model
    logprobs: list[float] = field(default_factory=list)
    record: EpisodeRecord = field(default_factory=EpisodeRecord)
    running: bool = True
    pending: Optional[str] = None  # a finished model turn the environment has not answered yet
    versions: set = field(default_factory=set)
    token_versions: list[int] = field(default_factory=list)  # each token's weight version, -1 = not sampled
    images: RowImages = ()  # the prompt's, then each observation's (vision-language policies)
    prompt_routed: Optional[Tensor] = None  # [len(prompt), layers, k] the prompt's routed experts (turn 0)
    routed: Optional[Tensor] = None  # [len(ids), layers, k] each token's, -1 until a turn's engine call fed it


def _close(episodes: list[_Episode]) -> None:
    for e in episodes:
        _close_environment(e.env)


def _close_environment(env: Environment) -> None:
    try:
        env.close()
    except Exception as err:  # noqa: BLE001 - a failing close must not hide the rollout's outcome
        log.warning("closing an episode's environment failed: %s", err)


def _turn_versions(out: RolloutOutput, row: int, length: int) -> list[int]:
    """The weight version of each of the first ``length`` tokens of row ``row`` of one turn's ``out``: its per-token
    ``completion_versions`` when the engine reports them, else its ``weight_version``, else -1 (none reported)."""
    if out.completion_versions is not None:
        return [int(v) for v in out.completion_versions[row, :length].tolist()]
    return [-1 if out.weight_version is None else int(out.weight_version)] * length


class EpisodeRunner:
    """Runs the episodes of a rollout (see the module docstring): the multi-turn
    :class:`~lightning_grpo.protocols.sampler.Sampler` and its
    :class:`~lightning_grpo.protocols.sampler.PromptEncoder` (the prompts with their tools).

    Args:
        chat: the chat template's prompt and turn encoding (with the tools the prompt describes).
        environment_factory: makes one episode's environment (called once per episode; reset with its prompt's row).
        max_turns: most model turns per episode (``episode.max_turns``).
        max_tokens: the token budget of an episode after its prompt (``episode.max_tokens``; None = the sampling's
            ``max_new_tokens``, which is also the most tokens of one model turn).
        env_workers: environments stepped at once (``episode.env_workers``).
        stop: polled between turns (the engines poll it while they generate).
        images: a vision-language policy's image encoding (prompts and observations with images); None: text.

    Raises:
        ValueError: a limit below 1.
    """

    def __init__(self, chat: ChatFormat, environment_factory: EnvironmentFactory, max_turns: int,
                 max_tokens: Optional[int] = None, env_workers: int = 1, stop: Optional[StopFlag] = None,
                 images: Optional[ImagePrompts] = None) -> None:
        for name, value in (("max_turns", max_turns), ("env_workers", env_workers), ("max_tokens", max_tokens or 1)):
            if value < 1:
                raise ValueError(f"EpisodeRunner {name}={value!r} must be >= 1")
        self.chat = chat
        self.environment_factory = environment_factory
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self.env_workers = env_workers
        self.stop = stop if stop is not None else StopFlag()
        self.images = images

    def encode_prompts(self, prompts: Sequence[Any], max_prompt_length: int) -> tuple[list[list[int]], int]:
        """The prompts' ids with their tools (:meth:`ChatFormat.encode_prompts`): ``(ids, num_truncated)``."""
        return self.chat.encode_prompts(prompts, max_prompt_length)

    def sample(self, engine: RolloutEngine, prompts: EncodedPrompts, num_generations: int, sampling: SamplingConfig,
               any_process: Optional[Callable[[bool], bool]] = None) -> RolloutOutput:
        """The ``B * G`` episodes of ``B`` encoded prompts (prompt-major, as a single-turn rollout): ``prompts.rows[i]``
        is the dataset row of prompt i (``reset(**row)`` of its episodes' environments), ``prompts.images[i]`` its
        images (vision-language policies). ``any_process``: the data-parallel agreement
        (:meth:`lightning_grpo.protocols.collectives.Collectives.any_process`), for engines that generate with the
        policy's parameters (see the module docstring); None = this process alone.

        Returns:
            A :class:`RolloutOutput` with ``env_mask`` and ``episodes`` (one
            :class:`~lightning_grpo.protocols.episode.EpisodeRecord` each) set, the reward functions' ``transcript``
            and ``env_reward`` columns and the episodes' metrics (:mod:`lightning_grpo.episodes.episode_metrics`);
            ``completions`` are each episode's last model turn (its answer); ``weight_version`` the oldest version any
            turn reported (each episode's record: its own oldest) and ``completion_versions`` every model token's
            (None when no turn reported a version).

        Raises:
            RolloutInterrupted: the stop flag was set.
            RuntimeError: an environment's ``reset``/``step`` raised (the episode is named; tools never raise).
            ValueError: an observation with images for a policy without them; images for an engine that does not
                take them.
        """
        b, g = len(prompts), num_generations
        per_turn = sampling.max_new_tokens
        budget = self.max_tokens or per_turn
        episodes: list[_Episode] = []
        reported: list[tuple[bool, bool]] = []  # whether each turn's call reported sampler logprobs, routed experts
        lockstep = any_process is not None and engine.capabilities.uses_policy_parameters
        try:
            for k in range(b * g):
                episodes.append(_Episode(list(prompts.ids[k // g]), self._environment(k, prompts.rows[k // g]),
                                         images=prompts.images[k // g]))
            first = replace(sampling, max_new_tokens=min(per_turn, budget))
            out = generate(engine, prompts.ids, g, first, prompts.images)
            reported.append(self._take(episodes, list(range(b * g)), out, budget))
            turn = 1
            while self._more_turns(episodes, budget, any_process if lockstep else None):
                running = [k for k, e in enumerate(episodes) if e.running]
                if not running:  # another process still generates: take part in its collective, discard the result
                    generate(engine, prompts.ids[:1], 1, replace(sampling, max_new_tokens=1), prompts.images[:1])
                    turn += 1
                    continue
                room = max(budget - len(episodes[k].ids) for k in running)
                seed = None if sampling.seed is None else sampling.seed + turn * b * g
                turn_sampling = replace(sampling, max_new_tokens=min(per_turn, room), seed=seed)
                prefixes = [episodes[k].prompt + episodes[k].ids for k in running]
                out = generate(engine, prefixes, 1, turn_sampling, [episodes[k].images for k in running])
                reported.append(self._take(episodes, running, out, budget))
                turn += 1
        finally:
            _close(episodes)
        return self._output(episodes, prompts.ids, g, int(engine.pad_token_id), all(r[0] for r in reported),
                            all(r[1] for r in reported))

    def _more_turns(self, episodes: list[_Episode], budget: int,
                    any_process: Optional[Callable[[bool], bool]]) -> bool:
        """Answer the finished model turns; whether another turn is generated (with ``any_process``: while any
        process has a running episode, a stop request agreed on).

        Raises:
            RolloutInterrupted: the stop flag is set (on any process, with ``any_process``).
        """
        self._answer(episodes, budget)
        running = any(e.running for e in episodes)
        if any_process is None:
            if running:
                self.stop.check("the episodes")
            return running
        if any_process(self.stop.is_set()):
            raise RolloutInterrupted("the episodes were stopped by a stop request (e.g. SIGTERM) before they finished")
        return any_process(running)

    def _environment(self, k: int, row: Mapping[str, Any]) -> Environment:
        """Make and reset episode ``k``'s environment; one whose ``reset`` raises is closed before the error is
        raised (the environments made before it are closed by :meth:`run`), so every environment made is closed
        exactly once."""
        try:
            env = self.environment_factory()
        except Exception as err:
            raise RuntimeError(f"episode {k}: making its environment failed: {err}") from err
        try:
            env.reset(**row)
        except BaseException as err:
            _close_environment(env)
            if not isinstance(err, Exception):
                raise
            raise RuntimeError(f"episode {k}: resetting its environment failed: {err}") from err
        return env

    def _take(self, episodes: list[_Episode], index: list[int], out: RolloutOutput,
              budget: int) -> tuple[bool, bool]:
        """Append one model turn to each episode ``index[r]`` from row r of ``out``, cut to its budget; whether
        ``out`` has sampler logprobs and routed experts."""
        tokenizer = self.chat.tokenizer
        for r, k in enumerate(index):
            e = episodes[k]
            n = int(out.completion_mask[r].sum())
            room = budget - len(e.ids)
            ids = [int(t) for t in out.completion_ids[r, : min(n, room)].tolist()]
            finished = not bool(out.truncated[r]) and n <= room
            logprobs = [] if out.sampler_logprobs is None else out.sampler_logprobs[r, : len(ids)].tolist()
            start = len(e.ids)
            _take_routing(e, out, r, len(ids))
            e.ids += ids
            e.model += [1] * len(ids)
            e.logprobs += logprobs if out.sampler_logprobs is not None else [0.0] * len(ids)
            text = tokenizer.decode(ids, skip_special_tokens=True)
            e.record.turns.append(Turn("model", start, len(e.ids), [{"role": "assistant", "content": text}]))
            e.record.model_turns += 1
            versions = _turn_versions(out, r, len(ids))
            e.token_versions += versions
            e.versions.update(v for v in versions if v >= 0)
            if finished:
                e.pending = text
            else:
                e.running, e.record.truncated = False, True
        return out.sampler_logprobs is not None, out.completion_routed_experts is not None

    def _answer(self, episodes: list[_Episode], budget: int) -> None:
        """Step the environment of every episode with a finished model turn; append the observations that fit."""
        waiting = [k for k, e in enumerate(episodes) if e.running and e.pending is not None]
        if not waiting:
            return
        try:
            steps = step_all([episodes[k].env for k in waiting], [episodes[k].pending or "" for k in waiting],
                             self.env_workers)
        except Exception as err:
            raise RuntimeError(f"an environment's step raised (episodes {waiting}): {err}") from err
        for k, step in zip(waiting, steps, strict=True):
            self._observe(episodes[k], step, budget)

    def _observe(self, e: _Episode, step: EnvStep, budget: int) -> None:
        e.pending = None
        record = e.record
        record.tool_calls += step.tool_calls
        record.tool_errors += step.tool_errors
        record.tool_timeouts += step.tool_timeouts
        if step.reward is not None:
            record.env_reward = float(step.reward)
        if step.done:
            e.running, record.done = False, True
            return
        if record.model_turns >= self.max_turns:
            e.running = False
            return
        messages, pictures = split_images(step.messages, "an observation")
        ids, shown = self._observation(messages, pictures)
        if len(e.ids) + len(ids) >= budget:  # no room for a model token after it: the episode is cut here
            e.running, record.truncated, record.budget_exceeded = False, True, True
            return
        start = len(e.ids)
        if e.routed is not None:  # fed to the model by the next turn's call
            e.routed = torch.cat([e.routed, e.routed.new_full((len(ids), *e.routed.shape[1:]), NO_EXPERT)])
        e.ids += ids
        e.model += [0] * len(ids)
        e.logprobs += [0.0] * len(ids)
        e.token_versions += [-1] * len(ids)
        e.images += shown
        record.turns.append(Turn("env", start, len(e.ids), [dict(m) for m in messages]))

    def _observation(self, messages: Any, pictures: list[Any]) -> tuple[list[int], RowImages]:
        """An observation's ids (each picture's placeholder run expanded) and its images.

        Raises:
            ValueError: pictures for a policy that is not a vision-language model.
        """
        if not pictures:
            return self.chat.env_turn_ids(messages), ()
        images = self.images
        if images is None:
            raise ValueError("an environment's observation has images, but the policy is not a vision-language model")
        shown = tuple(images.process(p) for p in pictures)
        return images.expand(self.chat.env_turn_ids(messages), shown, "an observation"), shown

    def _output(self, episodes: list[_Episode], prompt_ids: Sequence[Sequence[int]], g: int, pad: int,
                reports_logprobs: bool, reports_routing: bool) -> RolloutOutput:
        n, t = len(episodes), max(1, max(len(e.ids) for e in episodes))
        completion_ids = torch.full((n, t), pad, dtype=torch.long)
        model = torch.zeros((n, t), dtype=torch.long)
        logprobs = torch.zeros((n, t), dtype=torch.float32)
        for i, e in enumerate(episodes):
            completion_ids[i, : len(e.ids)] = torch.tensor(e.ids, dtype=torch.long)
            model[i, : len(e.ids)] = torch.tensor(e.model, dtype=torch.long)
            logprobs[i, : len(e.ids)] = torch.tensor(e.logprobs, dtype=torch.float32)
        env = torch.zeros_like(model)
        for i, e in enumerate(episodes):
            env[i, : len(e.ids)] = 1 - model[i, : len(e.ids)]
        versions = set().union(*(e.versions for e in episodes))
        token_versions = torch.full((n, t), -1, dtype=torch.long)
        for i, e in enumerate(episodes):
            e.record.weight_version = min(e.versions) if e.versions else None
            token_versions[i, : len(e.ids)] = torch.tensor(e.token_versions, dtype=torch.long)
        ids, mask = left_pad([list(p) for p in prompt_ids], pad, torch.device("cpu"))
        records = [e.record for e in episodes]
        return RolloutOutput(
            prompt_ids=ids.repeat_interleave(g, dim=0), prompt_mask=mask.repeat_interleave(g, dim=0),
            completion_ids=completion_ids, completion_mask=model, env_mask=env,
            truncated=torch.tensor([e.record.truncated for e in episodes], dtype=torch.bool),
            completions=[e.record.final_text for e in episodes],
            sampler_logprobs=logprobs if reports_logprobs else None,
            weight_version=min(versions) if versions else None,
            episodes=records, columns=episode_columns(records), metrics=episode_metrics(records, model, env),
            images=[e.images for e in episodes],
            **(_routed_fields(episodes, ids.shape[1], t) if reports_routing else {}),
            completion_versions=token_versions if versions else None,
        )


def _take_routing(e: _Episode, out: RolloutOutput, r: int, n: int) -> None:
    """Row ``r`` of ``out`` (one engine call: episode ``e``'s prompt and tokens so far, then its ``n`` new model
    tokens): the routed experts of the tokens no earlier call fed (the prompt in turn 0, the last model token and the
    environment's tokens of the previous turns), then of the new tokens."""
    prompt, completion = out.prompt_routed_experts, out.completion_routed_experts
    if prompt is None or completion is None:
        return
    fed = prompt[r, prompt.shape[1] - len(e.prompt) - len(e.ids):]  # the call's real prompt: e.prompt + e.ids
    if e.prompt_routed is None:
        e.prompt_routed = fed[: len(e.prompt)]
        e.routed = fed.new_empty((0, *fed.shape[1:]))
    assert e.routed is not None
    earlier = fed[len(e.prompt):]
    e.routed = torch.where(e.routed >= 0, e.routed, earlier.to(e.routed.device))
    e.routed = torch.cat([e.routed, completion[r, :n].to(e.routed.device)])


def _routed_fields(episodes: list[_Episode], prompt_width: int, completion_width: int) -> dict[str, Tensor]:
    """``prompt_routed_experts`` ``(N, P, layers, k)`` (left-padded) and ``completion_routed_experts`` ``(N, T,
    layers, k)`` (right-padded) of the episodes, -1 at padding."""
    first = next(e.prompt_routed for e in episodes if e.prompt_routed is not None)
    shape = first.shape[1:]
    prompt = torch.full((len(episodes), prompt_width, *shape), NO_EXPERT, dtype=ROUTED_DTYPE)
    completion = torch.full((len(episodes), completion_width, *shape), NO_EXPERT, dtype=ROUTED_DTYPE)
    for i, e in enumerate(episodes):
        if e.prompt_routed is not None and e.routed is not None:
            prompt[i, prompt_width - len(e.prompt_routed):] = e.prompt_routed.cpu()
            completion[i, : len(e.routed)] = e.routed.cpu()
    return {"prompt_routed_experts": prompt, "completion_routed_experts": completion}
