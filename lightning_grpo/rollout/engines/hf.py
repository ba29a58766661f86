"""Rollouts with transformers' ``generate`` on the policy itself (sampling, left padding, KV cache).

What is sampled is :func:`lightning_grpo.protocols.sampling.sampling_logits` of the policy's logits and nothing else:

* ``generate`` fills every field a ``GenerationConfig`` leaves unset (None) from ``model.generation_config``, the
  checkpoint's ``generation_config.json``, and turns many of them into logits processors (repetition penalty,
  no-repeat n-grams, bad words, suppressed tokens, min length, its own temperature / top-k / top-p / min-p /
  typical-p, ...). The engine therefore swaps ``model.generation_config`` for :func:`neutral_generation_config`
  (the checkpoint's special-token ids only) for the duration of the call, and passes a config whose every
  logits-processing field is neutral: only transformers' neutral global defaults remain.
* Temperature, min-p, top-k and top-p are applied by one logits processor of ours, :class:`SamplingProcessor`
  (the same function as the trainer's logprobs), not by transformers' warpers, whose order (top-p before min-p)
  differs from vLLM's.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    StoppingCriteria,
)

from lightning_grpo.protocols.engine import EngineCapabilities
from lightning_grpo.protocols.rollout import (
    RolloutInterrupted,
    RolloutOutput,
    StopFlag,
    completion_mask_from_eos,
    eos_token_ids_from,
    finish_rollout,
    left_pad,
)
from lightning_grpo.protocols.routing import RoutingRecorder, mask_routed
from lightning_grpo.protocols.sampling import SamplingConfig, sampling_logits
from lightning_grpo.protocols.vision import RowImages, VisionSpec, vision_spec
from lightning_grpo.protocols.weights import PolicyWeights
from lightning_grpo.rollout.engine_registry import EngineSpec
from lightning_grpo.rollout.engines.generate_routing import generation_routing
from lightning_grpo.rollout.engines.multimodal import ImageRows


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Every id that ends a completion: the model's ``generation_config.eos_token_id`` (an int or a list) and the
    tokenizer's ``eos_token_id``."""
    return eos_token_ids_from(getattr(model, "generation_config", None), tokenizer)


def neutral_generation_config(model_config: Optional[GenerationConfig], **fields: Any) -> GenerationConfig:
    """A ``GenerationConfig`` that keeps only the special-token ids of ``model_config`` (bos/eos/pad/decoder start),
    with every other field unset, updated with ``fields``. Unset fields then take transformers' global defaults,
    none of which processes logits except ``top_k=50``, which callers set explicitly."""
    keep = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
    kept = {name: getattr(model_config, name, None) for name in keep}
    return GenerationConfig(**{**{name: value for name, value in kept.items() if value is not None}, **fields})


class SamplingProcessor(LogitsProcessor):
    """Replaces the scores by :func:`lightning_grpo.protocols.sampling.sampling_logits` (temperature, min-p, top-k,
    top-p; greedy: the raw logits). It is the last processor of the list, so with ``record=True`` the log-softmax of its
    output is the log-probability of the distribution ``generate`` samples (or takes the argmax) from: the
    logprob of each token is read at the next call, when the token has been appended to ``input_ids``.

    Args:
        sampling: the settings.
        record: keep the sampled tokens' logprobs (one ``(N, V)`` row of the last step is held).
    """

    def __init__(self, sampling: SamplingConfig, record: bool = False) -> None:
        self.sampling = sampling
        self.record = record
        self.logprobs: list[torch.Tensor] = []  # [N] float32 per generated token (all but the last)
        self.last: Optional[torch.Tensor] = None  # [N, V] log-softmax of the latest step

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        s = self.sampling
        if s.greedy:
            out = scores.float()
            if s.banned_token_ids:  # never sampled, greedy included (vLLM's bad words)
                out = out.index_fill(-1, torch.as_tensor(s.banned_token_ids, device=out.device), float("-inf"))
        else:
            out = sampling_logits(scores, s.temperature, s.top_k, s.top_p, s.min_p, s.banned_token_ids)
        if self.record:
            if self.last is not None:
                self.logprobs.append(self.last.gather(1, input_ids[:, -1:]).squeeze(1))
            self.last = torch.log_softmax(out, dim=-1)
        return out

    def token_logprobs(self, completion_ids: torch.Tensor) -> torch.Tensor:
        """``(N, T)`` float32 logprobs of ``completion_ids`` (the generated ids, ``T`` >= 1 steps recorded)."""
        t = completion_ids.shape[1]
        if t == 0:
            return completion_ids.new_zeros(completion_ids.shape, dtype=torch.float32)
        steps = self.logprobs[:t]
        if len(steps) < t:
            assert self.last is not None and len(steps) == t - 1
            steps = steps + [self.last.gather(1, completion_ids[:, -1:]).squeeze(1)]
        return torch.stack(steps, dim=1)


class HFRolloutEngine:
    """Generates with the policy module itself, so it always uses the current weights (``sync_weights`` is a
    no-op). The model is put in eval mode for the rollout and restored afterwards; no gradients are kept.

    Sampling draws from :func:`lightning_grpo.protocols.sampling.sampling_logits` (``softmax(logits / temperature)``
    renormalized over what min-p / top-k / top-p keep) and nothing else: the checkpoint's generation config is
    neutralized (see the module docstring), so the trainer's logprobs with the same settings describe exactly the
    sampled distribution.

    Args:
        model: the causal LM being trained.
        tokenizer: its tokenizer (pad id; decoding).
        report_logprobs: also return ``sampler_logprobs``, the logprobs of the generated tokens under the
            distribution ``generate`` actually sampled from (read after every logits processor). Off by default:
            on the trained weights they equal the trainer's own logprobs up to kernel differences.
        vision: a vision-language policy's image facts (:func:`lightning_grpo.protocols.vision.vision_spec`): prompts
            may then have images (``generate(..., images=...)``, :mod:`lightning_grpo.rollout.engines.multimodal`).
        routing: a mixture-of-experts policy's routing recorder (routing replay, ``GRPOConfig.routing_replay="R3"``):
            every rollout then carries the experts each token was routed to (``prompt_routed_experts``,
            ``completion_routed_experts``, :mod:`lightning_grpo.rollout.engines.generate_routing`); None: nothing is
            recorded (no cost).
        forward_context: entered around ``generate`` (the trainer's precision context: bf16 autocast under
            ``precision="bf16-mixed"``), so the rollout samples in the precision the trainer scores it in.


    Attributes:
        capabilities: it generates with the trained module itself; sampling draws from torch's global generator;
            nothing to sync; it takes images when the policy is a vision-language model; its rollouts carry the
            routed experts when it was made with a routing recorder.
    """


    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, report_logprobs: bool = False,
        stop: Optional[StopFlag] = None, vision: Optional[VisionSpec] = None,
        routing: Optional[RoutingRecorder] = None,
        forward_context: Callable[[], ContextManager] = contextlib.nullcontext,
    ) -> None:
        self.model = model
        self.routing = routing
        self.forward_context = forward_context
        self.vision = vision
        self.tokenizer = tokenizer
        self.report_logprobs = report_logprobs
        self.stop = stop if stop is not None else StopFlag()  # polled at every generated token
        self.eos_token_ids = eos_token_ids(model, tokenizer)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        self.pad_token_id = int(pad)
        self.synced_gpus: Optional[bool] = None  # None: transformers decides (DeepSpeed ZeRO-3 / FSDP2 modules)
        self.capabilities = EngineCapabilities(uses_policy_parameters=True, accepts_images=vision is not None,
                                               returns_routed_experts=routing is not None)

    def set_lockstep(self, enabled: bool) -> None:
        """``generate(synced_gpus=True)`` when enabled (FSDP1 with nested units: every forward is a collective)."""
        self.synced_gpus = True if enabled else None

    def sync_weights(self, weights: PolicyWeights) -> None:
        """Nothing to do: generation runs on the trained module."""

    def wake_up(self) -> None:
        """Nothing to do: the engine is the policy itself."""

    def sleep(self, level: int = 1) -> None:
        """Nothing to do: the engine holds no memory of its own between rollouts."""

    def close(self) -> None:
        """Nothing to release."""

    def generation_config(self, sampling: SamplingConfig, num_generations: int) -> GenerationConfig:
        """The ``GenerationConfig`` passed to ``generate``: every logits-processing field neutral (temperature,
        top-k, top-p and min-p are applied by :class:`SamplingProcessor`), the engine's EOS and pad ids."""
        # transformers applies the sampling warpers only when do_sample; greedy leaves them unset (no warning)
        warpers = dict(temperature=1.0, top_k=0, top_p=1.0, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0)
        return neutral_generation_config(
            getattr(self.model, "generation_config", None),
            max_new_tokens=sampling.max_new_tokens,
            min_new_tokens=0,
            do_sample=not sampling.greedy,
            **({} if sampling.greedy else warpers),
            repetition_penalty=1.0,
            encoder_repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            encoder_no_repeat_ngram_size=0,
            renormalize_logits=False,
            remove_invalid_values=False,
            guidance_scale=1.0,
            num_beams=1,
            num_return_sequences=1 if sampling.greedy else num_generations,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            use_cache=True,
        )

    @torch.no_grad()
    def generate(
        self, prompt_ids: Sequence[Sequence[int]], num_generations: int, sampling: SamplingConfig,
        images: Sequence[RowImages] = (),
    ) -> RolloutOutput:
        """See :class:`lightning_grpo.protocols.engine.RolloutEngine`. ``sampler_logprobs`` are reported when the
        engine was built with ``report_logprobs``. ``images``: each prompt's images (a vision-language policy;
        :class:`~lightning_grpo.protocols.engine.ImageRolloutEngine`).

        Raises:
            RolloutInterrupted: :attr:`stop` was set before or during generation (polled at every token).
            ValueError: images for a policy that is not a vision-language model.
        """
        self.stop.check()
        if num_generations < 1:
            raise ValueError(f"num_generations must be >= 1, got {num_generations}")
        device = next(self.model.parameters()).device
        rows = ImageRows.of(prompt_ids, images, num_generations, sampling.greedy, self.vision)
        ids, mask = left_pad(rows.prompt_ids, self.pad_token_id, device)
        config = self.generation_config(sampling, rows.per_row)
        processor = SamplingProcessor(sampling, record=self.report_logprobs)
        was_training = self.model.training
        checkpoint_config = getattr(self.model, "generation_config", None)
        self.model.eval()
        # generate() fills every unset field from model.generation_config: hand it one with nothing to fill from
        self.model.generation_config = neutral_generation_config(checkpoint_config)
        stop = _StopCriterion(self.stop)
        recording = self.routing.record() if self.routing is not None else contextlib.nullcontext()
        try:
            with recording as calls, self.forward_context():  # the trainer's precision (bf16 autocast: "bf16-mixed")
                out = self.model.generate(
                    input_ids=ids, attention_mask=mask, generation_config=config,
                    logits_processor=LogitsProcessorList([processor]), stopping_criteria=[stop],
                    synced_gpus=self.synced_gpus, **rows.model_inputs(ids),
                )
        finally:
            self.model.generation_config = checkpoint_config
            self.model.train(was_training)
        if stop.fired:
            raise RolloutInterrupted("the HF rollout was stopped by a stop request (e.g. SIGTERM) before it finished")
        completion_ids = out[:, ids.shape[1] :]  # [N or B, T]
        sampler_logprobs = processor.token_logprobs(completion_ids) if self.report_logprobs else None
        if completion_ids.shape[1] == 0:  # nothing generated: one pad column, masked below
            completion_ids = torch.full((out.shape[0], 1), self.pad_token_id, dtype=torch.long, device=device)
            sampler_logprobs = None if sampler_logprobs is None else completion_ids.new_zeros(completion_ids.shape)
        if sampling.greedy:  # every greedy completion of a prompt is the same: decode once, repeat
            completion_ids = completion_ids.repeat_interleave(num_generations, dim=0)
            if sampler_logprobs is not None:
                sampler_logprobs = sampler_logprobs.repeat_interleave(num_generations, dim=0)
        completion_mask, truncated = completion_mask_from_eos(completion_ids, self.eos_token_ids)
        if sampler_logprobs is not None:  # finished rows continue with pad ids, whose logprob may be -inf
            sampler_logprobs = torch.where(completion_mask.bool(), sampler_logprobs.float(), 0.0)
        output = finish_rollout(ids, mask, rows.repeat, completion_ids, completion_mask, truncated, sampler_logprobs,
                                self.tokenizer, self.pad_token_id, images=rows.images)
        if self.routing is None:
            return output
        prompt, completion = generation_routing(calls, out.shape[0], ids.shape[1], output.completion_ids.shape[1],
                                                self.routing.moe_layers, self.routing.top_k)
        repeat = len(output) // out.shape[0]  # greedy: each prompt's one completion, repeated
        return replace(output,
                       prompt_routed_experts=mask_routed(prompt.repeat_interleave(repeat, dim=0), output.prompt_mask),
                       completion_routed_experts=mask_routed(completion.repeat_interleave(repeat, dim=0),
                                                             output.completion_mask))


class _StopCriterion(StoppingCriteria):
    """Ends ``generate`` for every row once ``flag`` is set (checked at every token). It stops rather than raises,
    so that with ``synced_gpus`` (FSDP1) this rank keeps taking part in the other ranks' forward passes until they
    stop too; :meth:`HFRolloutEngine.generate` then raises."""

    def __init__(self, flag: StopFlag) -> None:
        self.flag = flag
        self.fired = False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: object) -> torch.Tensor:
        self.fired = self.fired or self.flag.is_set()
        self.flag.tick(int(input_ids.shape[0]))
        return torch.full((input_ids.shape[0],), self.fired, dtype=torch.bool, device=input_ids.device)


def make(spec: EngineSpec) -> HFRolloutEngine:
    """The "hf" engine of the registry: generates with ``spec.model`` (the policy's transformers model; with LoRA,
    its layers carry the adapters), inside the trainer's precision context (``spec.forward_context``); a
    vision-language policy's prompts may have images; with ``spec.routing`` (routing replay) the rollouts carry the
    routed experts."""
    return HFRolloutEngine(spec.model, spec.tokenizer, stop=spec.stop, vision=vision_spec(spec.model.config),
                           routing=spec.routing, forward_context=spec.forward_context)
