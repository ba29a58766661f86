"""Shared parts of ``benchmarks/vs_trl.py``, ``scaling.py`` and ``lora.py``: models, prompts, the trainer workers.

Every measured training run happens in a fresh subprocess (:func:`run_worker`), so its peak RSS
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``) is that of one trainer alone, and no run inherits another's
allocator state, thread pools or compiled kernels. The parent passes a JSON *spec* and reads back a JSON
*result*; the worker is this file run as a script (``python benchmarks/_harness.py SPEC OUT``).

Step time (both trainers, same definition): the wall-clock interval between the ends of two consecutive
optimizer steps. It covers everything a trainer does per step (rollout, scoring, logprob passes, forward,
backward, clipping, optimizer, logging, data loading) and nothing done once (model load, engine start). The
first step has no previous end, so it is the warm-up and never measured: ``steps`` optimizer steps give
``steps - 1`` samples.

Tokens per step (both trainers, same definition): *generated* = completion tokens up to and including EOS;
*trained* = generated + the (non-padding) prompt tokens of every sequence, i.e. G x the chat-templated prompt
lengths of the step's prompts. Padding is never counted, so a trainer that pads less gets no credit for it in
the token count, only in the time.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional, Sequence

_WORKER_START = time.perf_counter()
REPO_ROOT = Path(__file__).resolve().parents[1]

#: Keys of our per-step timing metrics, in breakdown order (see GRPOModule); missing ones print as "n/a".
BREAKDOWN_KEYS = (
    "timing/rollout_s",
    "timing/scoring_s",
    "timing/logprobs_s",
    "timing/sync_s",
    "timing/forward_s",
    "timing/backward_s",
    "timing/optimizer_s",
    "timing/other_s",
)
STEP_KEY = "timing/step_s"
GIB = 2**30


# --------------------------------------------------------------------------- models and prompts
def build_tiny_model(dest: str, tokenizer_path: str) -> str:
    """Save a tiny random Llama with the SmolLM2 tokenizer into ``dest`` and return ``dest``.

    2 layers, hidden 128, 2 heads of head_dim 64 (vLLM's CPU attention needs 32, 64, ...; not 16),
    2 KV heads, MLP 256, tied embeddings, float32, seed 0. A random model almost never samples EOS
    (about 1 in 49k per token), so its completions run to ``max_new_tokens``: step work is set by the
    settings, not by what the model happens to write.
    """
    from lightning_grpo.demos.tiny_models import save_tiny_llama

    return save_tiny_llama(dest, tokenizer_path, hidden_size=128, intermediate_size=256, num_attention_heads=2,
                           num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)


def resolve_model(name: str, workdir: str) -> str:
    """Folder of the benchmark model: ``"embedded"`` (SmolLM2-135M-Instruct), ``"tiny"`` (built into
    ``workdir``) or any model folder."""
    from lightning_grpo.models.embedded import default_model_path

    if name == "embedded":
        return default_model_path()
    if name == "tiny":
        return build_tiny_model(os.path.join(workdir, "tiny_llama"), default_model_path())
    return name


def prompt_batches(num_batches: int, prompts_per_step: int, seed: int, data_dir: Optional[str],
                   dataset: str = "gsm8k") -> list[dict]:
    """The first ``num_batches`` train batches of :class:`lightning_grpo.data.PromptDataModule` of ``dataset``
    (GSM8K, or a task made in code such as ``"arithmetic-4"``; its prompt formatting: system prompt + instruction;
    its seeded shuffle), as dicts of lists."""
    from lightning_grpo.data import PromptDataModule

    data = PromptDataModule(dataset, data_dir=data_dir, prompts_per_step=prompts_per_step, val_size=0, seed=seed)
    data.setup("fit")
    batches = []
    for batch in data.train_dataloader():
        batches.append(batch)
        if len(batches) == num_batches:
            return batches
    raise ValueError(f"{dataset} train has fewer than {num_batches} batches of {prompts_per_step} prompts")


def prompt_lengths(tokenizer: Any, prompts: Sequence[Any]) -> list[int]:
    """Chat-templated prompt lengths in tokens (``add_generation_prompt=True``, as both trainers tokenize)."""
    lengths = []
    for prompt in prompts:
        ids = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        lengths.append(len(ids))
    return lengths


def median(values: Sequence[float]) -> Optional[float]:
    """The median, or None for no values."""
    import statistics

    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


# --------------------------------------------------------------------------- subprocess plumbing
def run_worker(spec: dict, workdir: str, label: str, verbose: bool = False, timeout: Optional[float] = None) -> dict:
    """Run one training in a fresh Python process; return its result dict (see :func:`worker_main`).

    The worker's output goes to ``<workdir>/<label>.log`` (and to the terminal with ``verbose``).

    Raises:
        RuntimeError: the worker failed (the end of its log is in the message).
    """
    spec_path = os.path.join(workdir, f"{label}.spec.json")
    out_path = os.path.join(workdir, f"{label}.result.json")
    log_path = os.path.join(workdir, f"{label}.log")
    with open(spec_path, "w") as handle:
        json.dump(spec, handle)
    if os.path.exists(out_path):
        os.remove(out_path)  # a result left by an earlier run in the same workdir
    busy = cpu_busy_fraction()
    env = dict(os.environ)
    for key in TORCH_DISTRIBUTED_ENV:  # a row is its own run: not a rank of the caller's process group, if it has one
        env.pop(key, None)
    env["MASTER_PORT"] = str(free_port())  # its own rendezvous (two rows never share a port that may still be held)
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        env.setdefault(key, "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    if spec.get("threads"):
        env["OMP_NUM_THREADS"] = str(spec["threads"])
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the KV cache size is GRPOConfig.engine.kv_cache_space_gib's
    if spec.get("engine") == "vllm":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process engine, as GRPOModule uses it
    command = [sys.executable, str(Path(__file__).resolve()), spec_path, out_path]
    if spec.get("cpus"):  # pinned to these cores (e.g. the trainer next to a rollout server on the other cores)
        command = ["taskset", "-c", str(spec["cpus"]), *command]
    with open(log_path, "w") as log:
        if verbose:
            proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            assert proc.stdout is not None
            for line in proc.stdout:
                log.write(line)
                sys.stdout.write(f"  [{label}] {line}")
            code = proc.wait(timeout=timeout)
        else:
            code = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout).returncode
    if code != 0 or not os.path.exists(out_path):
        tail = "".join(open(log_path).readlines()[-40:])
        raise RuntimeError(f"worker {label} failed (exit code {code}); log {log_path}:\n{tail}")
    with open(out_path) as handle:
        result = json.load(handle)
    result["cpu_busy_before"] = busy
    return result


def code_version() -> dict[str, Any]:
    """The commit of this checkout and whether its tracked files differ from it (which code a figure measured)."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=30,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "HEAD") or None, "dirty": bool(git("status", "--porcelain",
                                                                           "--untracked-files=no"))}


def write_report(report: dict, path: Optional[str]) -> None:
    """Write a benchmark report as JSON to ``path`` (parent folders created); nothing when ``path`` is empty."""
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        json.dump(report, handle, indent=1)
    print(f"\nwrote {path}")


def cpu_busy_fraction(seconds: float = 1.0) -> Optional[float]:
    """Fraction of the machine's CPU time spent busy over the next ``seconds`` (from ``/proc/stat``; None
    elsewhere). Sampled before each run, when no trainer of ours is running: what other processes use."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as handle:
            values = [int(v) for v in handle.readline().split()[1:]]
        idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
        return sum(values), idle

    try:
        total0, idle0 = sample()
        time.sleep(seconds)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    return None if total1 == total0 else 1.0 - (idle1 - idle0) / (total1 - total0)


def _vm_hwm(pid: str = "self") -> int:
    """``VmHWM`` (peak resident set) of a process in bytes, 0 where ``/proc`` is missing."""
    try:
        with open(f"/proc/{pid}/status") as handle:
            return next(int(line.split()[1]) * 1024 for line in handle if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return 0


class RssPeaks:
    """The process's peak resident set, and the peak of its training phases (reset through ``/proc/self/
    clear_refs`` when a phase starts). Resetting also resets ``ru_maxrss``, so the process peak is tracked here as
    the maximum of every reading."""

    def __init__(self) -> None:
        self.process = 0
        self.train = 0

    def start_train(self) -> None:
        self.process = max(self.process, _vm_hwm())
        try:
            with open("/proc/self/clear_refs", "w") as handle:
                handle.write("5")
        except OSError:
            pass

    def end_train(self) -> None:
        hwm = _vm_hwm()
        self.train, self.process = max(self.train, hwm), max(self.process, hwm)

    def result(self) -> dict[str, int]:
        self.process = max(self.process, _vm_hwm(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        return {"peak_rss_bytes": self.process, "train_peak_rss_bytes": self.train or None,
                "peak_rss_children_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}


PEAKS = RssPeaks()


def peak_rss() -> dict[str, int]:
    """Peak resident set size in bytes of this process (and of its training phases, see :class:`RssPeaks`) and of
    its largest finished child."""
    return PEAKS.result()


def cuda_peak() -> dict[str, Any]:
    """The CUDA allocator's peak (bytes) when torch was used on a GPU, else {}."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    return {"cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(),
            "cuda_max_reserved_bytes": torch.cuda.max_memory_reserved()}


#: The variables a process of a torch.distributed job inherits (torchrun's, Lightning's): a benchmark's worker drops
#: them (a caller inside a process group, e.g. a test worker, would hand it its rendezvous port).
TORCH_DISTRIBUTED_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                         "NODE_RANK", "GROUP_RANK", "TORCHELASTIC_RUN_ID")


# --------------------------------------------------------------------------- rollout server
def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: str, cpus: str, threads: int, kv_cache_gib: float, max_model_len: int,
                 log_path: str, dtype: str = "float32") -> tuple[subprocess.Popen, str]:
    """``lightning-grpo serve`` pinned to ``cpus`` with ``threads`` torch threads, computing in ``dtype``; returns
    ``(process, url)`` once ``/health`` answers (raises RuntimeError after 600 s or when it exits)."""
    from lightning_grpo.rollout.server.client import RolloutServerError, ServerClient

    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p))
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    command = ["taskset", "-c", cpus, sys.executable, "-m", "lightning_grpo.cli", "serve", "--model", model,
               "--host", "127.0.0.1", "--port", str(port), "--kv-cache-space-gib", f"{kv_cache_gib:.6f}",
               "--max-model-len", str(max_model_len), "--dtype", dtype]
    proc = subprocess.Popen(command, env=env, stdout=open(log_path, "a"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the rollout server exited with {proc.returncode}; see {log_path}")
        try:
            ServerClient(url, 2).request("GET", "/health")
            return proc, url
        except RolloutServerError:
            time.sleep(1)
    proc.kill()
    raise RuntimeError(f"the rollout server did not start within 600 s; see {log_path}")


def stop_server(proc: subprocess.Popen) -> int:
    """Stop a server from :func:`start_server`; returns its peak resident set (bytes, read before it exits)."""
    peak = _vm_hwm(str(proc.pid))
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(60)
    return peak


def describe_run(result: dict) -> str:
    """One line about a finished run: its measured step times, peak RSS, duration and the machine's load."""
    steps = [row["interval_s"] for row in result["steps"] if row["interval_s"] is not None]
    line = (f"steps {', '.join(f'{s:.2f}' for s in steps)} s; peak RSS {result['peak_rss_bytes'] / GIB:.2f} GiB; "
            f"process {result['wall_s']:.1f} s")
    busy = result.get("cpu_busy_before")
    if busy is not None:
        line += f"; CPU busy before the run {100 * busy:.0f} %"
        if busy > 0.1:
            line += " (other processes were running: timings are unreliable)"
    return line



# --------------------------------------------------------------------------- worker: ours
def _step_rows(ends: list[float], generated: list[float], prompt_tokens: list[int], metrics: list[dict],
               inner: list[Optional[float]]) -> list[dict]:
    """Per-step records: end time, interval since the previous step end (None for the warm-up step), the
    inner step time, token counts and the step's logged metrics. Lists shorter than ``ends`` give None / {}."""

    def at(values: list, i: int, default: Any = None) -> Any:
        return values[i] if i < len(values) else default

    rows = []
    for i, end in enumerate(ends):
        gen, prompt = at(generated, i), at(prompt_tokens, i)
        rows.append(
            {
                "step": i + 1,
                "end_s": end - _WORKER_START,
                "interval_s": None if i == 0 else end - ends[i - 1],
                "inner_s": at(inner, i),
                "generated_tokens": gen,
                "prompt_tokens": prompt,
                "train_tokens": None if gen is None or prompt is None else gen + prompt,
                "metrics": at(metrics, i, {}),
            }
        )
    return rows


def make_strategy(spec: Any) -> Any:
    """A Trainer ``strategy`` from JSON: None / a name, or ``{"name": "grpo_fsdp2" | "fsdp", **kwargs}``
    (:class:`lightning_grpo.strategies.FSDP2Strategy` / Lightning's ``FSDPStrategy`` with those arguments)."""
    if not isinstance(spec, dict):
        return spec or "auto"
    kwargs = dict(spec)
    name = kwargs.pop("name")
    if name == "grpo_fsdp2":
        from lightning_grpo.strategies import FSDP2Strategy

        return FSDP2Strategy(**kwargs)
    if name == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        return FSDPStrategy(**kwargs)
    raise ValueError(f"strategy {spec!r}: choose a name, or a dict with name 'grpo_fsdp2' or 'fsdp'")


def run_ours(spec: dict) -> dict:
    """Train ``spec["steps"]`` optimizer steps with GRPOModule + L.Trainer; return per-step records."""
    import dataclasses

    import lightning as L
    import torch
    from lightning.pytorch.loggers.logger import Logger
    from torch.utils.data import DataLoader

    import lightning_grpo.strategies  # noqa: F401 (registers "grpo_fsdp2")
    from lightning_grpo import EngineConfig, GRPOConfig, GRPOModule

    class MemoryLogger(Logger):
        """Keeps every ``log_metrics`` call in memory, merged by step (one dict per optimizer step)."""

        def __init__(self) -> None:
            super().__init__()
            self.by_step: dict[int, dict[str, float]] = {}

        @property
        def name(self) -> str:
            return "memory"

        @property
        def version(self) -> int:
            return 0

        def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
            row = self.by_step.setdefault(int(step or 0), {})
            row.update({k: float(v) for k, v in metrics.items()})

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

    class StepClock(L.Callback):
        """Wall-clock time at the end of every optimizer step; the peak memory of each step's training phase (its
        micro-batches' forward, backward and optimizer step, after the rollout and the logprob passes)."""

        def __init__(self) -> None:
            self.ends: list[float] = []
            self.cuda_train_peak = 0

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            if getattr(batch, "step_start", True):
                PEAKS.start_train()
                if torch.cuda.is_available():
                    torch.cuda.reset_peak_memory_stats()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if getattr(batch, "step_end", True):
                PEAKS.end_train()
                if torch.cuda.is_available():
                    self.cuda_train_peak = max(self.cuda_train_peak, torch.cuda.max_memory_allocated())
            if trainer.global_step > len(self.ends):
                self.ends.append(time.perf_counter())

    class FixedPrompts(L.LightningDataModule):
        """Exactly the given prompt batches, in order (both trainers get the same list)."""

        def __init__(self, batches: list[dict]) -> None:
            super().__init__()
            self.batches = batches
            self.prompts_per_step = len(batches[0]["prompt"])

        def train_dataloader(self) -> DataLoader:
            return DataLoader(self.batches, batch_size=1, shuffle=False, collate_fn=lambda items: items[0])

    n = spec["prompts_per_step"] * spec["num_generations"]
    known = {f.name for f in dataclasses.fields(GRPOConfig)}
    options = dict(
        num_generations=spec["num_generations"],
        max_new_tokens=spec["max_new_tokens"],
        temperature=spec["temperature"],
        beta=spec["beta"],
        loss_type=spec["loss_type"],
        num_iterations=1,
    )
    engine_options = {"name": spec["engine"], "kv_cache_space_gib": spec.get("kv_cache_gib", "auto")}
    ignored = {}
    extra = dict(spec.get("config") or {})
    for name in ("padding_free", "max_tokens_per_microbatch"):
        if spec.get(name) is not None:
            extra[name] = spec[name]
    for name, value in extra.items():  # "engine.<field>" for EngineConfig's fields
        if name.startswith("engine."):
            engine_options[name.removeprefix("engine.")] = value
        elif name in known:
            options[name] = value
        else:
            ignored[name] = value
    config = GRPOConfig(**options, engine=EngineConfig(**engine_options))
    token_budget = getattr(config, "max_tokens_per_microbatch", None)
    accumulate = 1 if token_budget else n // spec["micro_batch_size"]

    L.seed_everything(spec["seed"], workers=True, verbose=False)
    module = GRPOModule(
        spec["model_path"],
        reward_funcs=("gsm8k_accuracy", "gsm8k_format"),
        config=config,
        learning_rate=spec["learning_rate"],
        dtype=spec.get("dtype", "float32"),
        export_dir="",
        lora=spec.get("lora"),  # benchmarks/lora.py: peft.LoraConfig fields, or None (full fine-tuning)
        gradient_checkpointing=spec.get("gradient_checkpointing", False),
    )
    batches = prompt_batches(spec["steps"], spec["prompts_per_step"], spec["seed"], spec.get("data_dir"),
                             spec.get("dataset", "gsm8k"))
    prompt_tokens = [spec["num_generations"] * sum(prompt_lengths(module.tokenizer, b["prompt"])) for b in batches]
    logger, clock = MemoryLogger(), StepClock()
    trainer = L.Trainer(
        max_steps=spec["steps"],
        accelerator=spec.get("accelerator", "cpu"),
        devices=1,
        strategy=make_strategy(spec.get("strategy")),
        precision=spec.get("precision", "32-true"),
        logger=logger,
        log_every_n_steps=1,
        callbacks=[clock],
        gradient_clip_val=1.0,
        gradient_clip_algorithm="norm",
        accumulate_grad_batches=accumulate,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=spec["workdir"],
    )
    trainer.fit(module, datamodule=FixedPrompts(batches))  # its end closes the engine the module made

    step_metrics = [m for _, m in sorted(logger.by_step.items()) if "timing/rollout_s" in m]
    generated = [
        m["generated_tokens"] if "generated_tokens" in m else m["completions/mean_length"] * n for m in step_metrics
    ]
    inner = [m.get(STEP_KEY) for m in step_metrics]
    return {
        "steps": _step_rows(clock.ends, generated, prompt_tokens, step_metrics, inner),
        "trainable_params": sum(p.numel() for p in module.policy.parameters() if p.requires_grad),
        "accumulate_grad_batches": accumulate,
        "config": dataclasses.asdict(config),
        "token_budget": module.token_budget,
        "resolved": module.resolved.as_dict(),  # e.g. the engine's dtype ("auto": the trainer's compute dtype)
        "cuda_train_peak_bytes": clock.cuda_train_peak or None,
        "ignored_options": ignored,
    }


# --------------------------------------------------------------------------- worker: TRL
def trl_reward(function: Any) -> Any:
    """Adapt one of our reward functions ``fn(prompts, completions: list[str], answer, **kw)`` to TRL's call,
    whose conversational completions are message lists (``[{"role": "assistant", "content": ...}]``)."""

    def reward(prompts: list, completions: list, **kwargs: Any) -> list:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return function(prompts, texts, **kwargs)

    reward.__name__ = function.__name__
    return reward


def trl_settings(spec: dict, output_dir: str) -> dict:
    """TRL ``GRPOConfig`` keyword arguments that match our trainer's settings (see benchmarks/README.md)."""
    n = spec["prompts_per_step"] * spec["num_generations"]
    micro = spec["micro_batch_size"]
    return dict(
        output_dir=output_dir,
        use_cpu=spec.get("accelerator", "cpu") == "cpu",
        bf16=str(spec.get("precision", "32-true")).startswith("bf16"),
        fp16=False,
        gradient_checkpointing=False,  # TRL's default is True; ours is off
        seed=spec["seed"],
        # one rollout of P x G sequences per optimizer step, in micro-batches of `micro` sequences
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=n // micro,
        steps_per_generation=n // micro,
        num_generations=spec["num_generations"],
        num_iterations=1,
        max_steps=spec["steps"],
        shuffle_dataset=False,  # the dataset is already our datamodule's shuffled order
        # sampling
        max_completion_length=spec["max_new_tokens"],
        temperature=spec["temperature"],
        top_p=1.0,
        top_k=0,
        repetition_penalty=1.0,
        use_vllm=False,
        # objective (ours: epsilon_low = epsilon_high = 0.2, scale_rewards "group", advantage_eps 1e-4)
        loss_type=spec["loss_type"],
        beta=spec["beta"],
        epsilon=0.2,
        scale_rewards="group",
        mask_truncated_completions=False,
        # optimizer (ours: torch.optim.AdamW, betas (0.9, 0.99), no weight decay, constant lr, clip 1.0)
        learning_rate=spec["learning_rate"],
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.99,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        # no work that ours does not do
        logging_steps=1,
        save_strategy="no",
        eval_strategy="no",
        report_to="none",
        log_completions=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        remove_unused_columns=False,
    )


def run_trl(spec: dict) -> dict:
    """Train ``spec["steps"]`` optimizer steps with TRL's GRPOTrainer on CPU (HF generate); per-step records.

    vLLM is hidden from this process (``sys.modules["vllm"] = None``, so ``find_spec("vllm")`` is None): TRL
    imports vLLM at start-up whenever it is installed, although its HF-generate path never uses it, and that
    import alone would add to TRL's peak RSS. TRL then runs as on a machine without vLLM.
    """
    if spec.get("hide_vllm", True) and "vllm" not in sys.modules:
        sys.modules["vllm"] = None  # type: ignore[assignment]
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer

    from lightning_grpo.rewards import gsm8k_accuracy, gsm8k_format

    class StepClock(TrainerCallback):
        """Wall clock at on_step_begin / on_step_end, and the metrics TRL logs for each step."""

        def __init__(self) -> None:
            self.begins: list[float] = []
            self.ends: list[float] = []
            self.logs: dict[int, dict[str, float]] = {}
            self.cuda_train_peak = 0

        def on_step_begin(self, args, state, control, **kwargs):
            self.begins.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            PEAKS.end_train()
            if torch.cuda.is_available():
                self.cuda_train_peak = max(self.cuda_train_peak, torch.cuda.max_memory_allocated())
            self.ends.append(time.perf_counter())

        def on_log(self, args, state, control, logs=None, **kwargs):
            row = self.logs.setdefault(state.global_step, {})
            row.update({k: float(v) for k, v in (logs or {}).items() if isinstance(v, (int, float))})

    n = spec["prompts_per_step"] * spec["num_generations"]
    torch.manual_seed(spec["seed"])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_path"])
    model = AutoModelForCausalLM.from_pretrained(spec["model_path"], dtype=getattr(torch, spec.get("dtype", "float32")))
    if spec.get("accelerator", "cpu") != "cpu":
        model = model.to("cuda")
    batches = prompt_batches(spec["steps"], spec["prompts_per_step"], spec["seed"], spec.get("data_dir"),
                             spec.get("dataset", "gsm8k"))
    prompt_tokens = [spec["num_generations"] * sum(prompt_lengths(tokenizer, b["prompt"])) for b in batches]
    rows = [{key: batch[key][i] for key in batch} for batch in batches for i in range(len(batch["prompt"]))]
    dataset = datasets.Dataset.from_list(rows)

    settings = trl_settings(spec, os.path.join(spec["workdir"], "trl_out"))
    clock = StepClock()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[trl_reward(gsm8k_accuracy), trl_reward(gsm8k_format)],
        args=TRLConfig(**settings),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    generate = trainer._generate_and_score_completions

    def generate_then_measure(*args: Any, **kwargs: Any) -> Any:
        """The training phase (measured like ours: from after the rollout and its logprob passes) starts here."""
        out = generate(*args, **kwargs)
        PEAKS.start_train()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        return out

    trainer._generate_and_score_completions = generate_then_measure
    trainer.train()

    step_logs = [clock.logs.get(i + 1, {}) for i in range(len(clock.ends))]
    generated = [log["completions/mean_length"] * n for log in step_logs]
    # TRL counts prompt + completion tokens in num_tokens (cumulative): the prompts it saw, for the cross-check
    trl_prompt_tokens: list[Optional[float]] = []
    previous: Optional[float] = 0.0
    for log, completion_tokens in zip(step_logs, generated, strict=True):
        seen = log.get("num_tokens")
        delta = None if seen is None or previous is None else seen - previous - completion_tokens
        trl_prompt_tokens.append(delta)
        previous = seen
    inner = [end - begin for begin, end in zip(clock.begins, clock.ends, strict=True)]
    settings.pop("output_dir")
    return {
        "steps": _step_rows(clock.ends, generated, prompt_tokens, step_logs, inner),
        "trl_prompt_tokens": trl_prompt_tokens,
        "prompt_tokens": prompt_tokens,
        "config": settings,
        "cuda_train_peak_bytes": clock.cuda_train_peak or None,
    }


def worker_main(spec_path: str, out_path: str) -> None:
    """Entry point of a worker process: run the spec's trainer, write the result JSON.

    ``spec["allowed_distributions"]`` (benchmarks/gpu.py's dry run): every installed distribution outside that list
    is made unimportable first (``_packages.hide_others``), as on the GPU machine the run stands in for; the result's
    ``imported_modules`` names the installed distributions whose modules the run imported.
    """
    with open(spec_path) as handle:
        spec = json.load(handle)
    if spec.get("allowed_distributions"):
        from _packages import hide_others

        hide_others(set(spec["allowed_distributions"]))
    spec.setdefault("workdir", tempfile.mkdtemp(prefix="grpo_bench_"))
    if spec.get("threads"):
        import torch

        torch.set_num_threads(int(spec["threads"]))
    result = run_trl(spec) if spec["trainer"] == "trl" else run_ours(spec)
    result.update(peak_rss())  # before anything else is imported
    result.update(cuda_peak())
    from importlib import metadata

    import torch

    versions = {}
    for package in ("torch", "transformers", "lightning", "trl", "vllm-cpu", "vllm", "datasets", "peft"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    from _packages import imported_modules

    result.update(
        imported_modules=imported_modules(),
        trainer=spec["trainer"],
        engine=spec.get("engine"),
        precision=spec.get("precision", "32-true"),
        dtype=spec.get("dtype", "float32"),
        torch_threads=torch.get_num_threads(),
        vllm_imported=sys.modules.get("vllm") is not None,
        wall_s=time.perf_counter() - _WORKER_START,
        versions=versions,
    )
    with open(out_path, "w") as handle:
        json.dump(result, handle, indent=1)


if __name__ == "__main__":
    worker_main(sys.argv[1], sys.argv[2])
