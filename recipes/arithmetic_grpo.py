"""GRPO on the seeded arithmetic task with the embedded SmolLM2-135M-Instruct, sized for a 2-core CPU.

    python recipes/arithmetic_grpo.py                  # validate, train 30 steps, validate, report
    python recipes/arithmetic_grpo.py --max-steps 40   # longer
    python recipes/arithmetic_grpo.py --precision bf16-mixed --correction icepop   # bf16, IcePop's mask

The task (:mod:`lightning_grpo.data.synthetic`, ``dataset="arithmetic"``, level 1): "What is 13 - 6?" (numbers 0-15)
after one worked example, the answer on a last line ``#### <number>``; 130 held-out questions are never trained on.
The reward is strict accuracy (the number on the ``####`` line is right; the format is logged, not rewarded). The
held-out scores, greedy accuracy and the unbiased pass@1 of ``eval_samples`` samples at the training temperature
(seeded), are measured by the same validation before training (``trainer.validate``) and after it (the fit's last
validation). The run ends by printing a before/after table and the paths of the plot
(``lightning-grpo plot``) and the completion table (:class:`lightning_grpo.callbacks.CompletionTable`).
"""

from __future__ import annotations

import os

# vLLM's CPU engine cuts this process's torch threads to 1 (training included) unless OMP_NUM_THREADS is set: use
# every core this process may run on, before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))

import argparse  # noqa: E402
import csv  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Optional  # noqa: E402

import lightning as L  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from lightning_grpo import GRPOConfig, GRPOModule  # noqa: E402
from lightning_grpo.callbacks import CompletionTable, GRPOModelCheckpoint, GRPOProgressBar  # noqa: E402
from lightning_grpo.config import DistillationConfig, EngineConfig, EvalConfig  # noqa: E402
from lightning_grpo.data import PromptDataModule  # noqa: E402
from lightning_grpo.evaluation.plot import plot_metrics  # noqa: E402
from lightning_grpo.rollout.engine_registry import resolve_engine_name

#: ``--correction``: the rollout correction of the sampler-trainer mismatch (docs/algorithm.md, "Rollout correction";
#: docs/performance.md, "bf16"): none, TIS (the token-level importance weight pi_old / pi_sampler truncated at 2, as
#: asynchronous runs use) or IcePop (tokens whose weight is outside [0.5, 5] get no policy-gradient loss).
CORRECTIONS: dict[str, dict[str, Any]] = {
    "none": {},
    "tis": dict(importance_sampling_cap=2.0),
    "icepop": dict(importance_sampling_cap=5.0, importance_sampling_min=0.5, importance_sampling_mode="mask"),
}

#: The reward functions (accuracy first: it is the validation's check) and their weights: the reward is the strict
#: accuracy, in {0, 1}; the format (a last line ``#### <number>``, which strict accuracy already needs) is logged only.
REWARDS = ["gsm8k_accuracy_strict", "gsm8k_format"]
WEIGHTS = [1.0, 0.0]


def _mean(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else float("nan")


def summarize(metrics_csv: Path, first: int = 5) -> dict[str, Any]:
    """The before/after numbers of a run's ``metrics.csv``: train reward and format (mean of the first and of the
    last ``first`` optimizer steps) and held-out accuracy (the first and the last validation), plus the curve."""
    rows = list(csv.DictReader(open(metrics_csv, newline="")))

    def column(name: str) -> list[tuple[int, float]]:
        return [(int(r["step"]), float(r[name])) for r in rows if r.get(name) not in (None, "")]

    reward, fmt = column("reward"), column("rewards/gsm8k_format/mean")
    accuracy = column("val/accuracy")
    sampled = column("val/pass@1")
    return {
        "reward": {"first": _mean([v for _, v in reward[:first]]), "last": _mean([v for _, v in reward[-first:]])},
        "format": {"first": _mean([v for _, v in fmt[:first]]), "last": _mean([v for _, v in fmt[-first:]])},
        "heldout_accuracy": {"before": accuracy[0][1] if accuracy else float("nan"),
                             "after": accuracy[-1][1] if len(accuracy) > 1 else float("nan")},
        "heldout_pass@1": {"before": sampled[0][1] if sampled else float("nan"),
                           "after": sampled[-1][1] if len(sampled) > 1 else float("nan")},
        "curve": {"step": [s for s, _ in reward], "reward": [v for _, v in reward], "format": [v for _, v in fmt],
                  "accuracy": [v for _, v in column("rewards/gsm8k_accuracy_strict/mean")],
                  "timing_step_s": [v for _, v in column("timing/step_s")]},
        "val_curve": accuracy,
        "val_pass@1_curve": sampled,
        "reverse_kl": column("distillation/reverse_kl"),
        # the sampler-trainer mismatch (engines that report sampler logprobs: vLLM) and what the correction dropped,
        # each metric's mean over the steps
        "mismatch": {name: _mean([v for _, v in column(name)]) for name in (rows[0] if rows else {})
                     if name.startswith(("sampling/mismatch_ratio/", "sampling/sampling_logp_difference/",
                                         "sampling/masked_fraction/", "sampling/importance_sampling_ratio/"))},
    }


def table(summary: dict[str, Any], first: int = 5) -> str:
    """The printed before/after table."""
    r, f, a, p = summary["reward"], summary["format"], summary["heldout_accuracy"], summary["heldout_pass@1"]
    return "\n".join([
        f"{'':34s}{'before':>10s}{'after':>10s}",
        f"{f'train reward (first/last {first} steps)':34s}{r['first']:>10.3f}{r['last']:>10.3f}",
        f"{f'train format (first/last {first} steps)':34s}{f['first']:>10.3f}{f['last']:>10.3f}",
        f"{'held-out accuracy (greedy)':34s}{a['before']:>10.3f}{a['after']:>10.3f}",
        f"{'held-out pass@1 (sampled, T=train)':34s}{p['before']:>10.3f}{p['after']:>10.3f}",
    ])


def main(max_steps: int = 30, prompts_per_step: int = 8, num_generations: int = 8, max_new_tokens: int = 64,
         learning_rate: float = 1e-5, val_size: int = 130, level: int = 1, temperature: float = 1.2,
         eval_samples: int = 4, loss_type: str = "grpo", engine: Optional[str] = None,
         root: str = "outputs/arithmetic_grpo", model: str = "embedded", seed: int = 42, val_every: int = 0,
         teacher: Optional[str] = None, distill_coef: float = 1.0, precision: str = "32-true",
         correction: str = "none", engine_dtype: str = "auto") -> dict[str, Any]:
    """Validate, train ``max_steps`` GRPO steps, validate again; print the table and paths; return the summary
    (:func:`summarize` plus ``seconds``, ``plot``, ``completions``, ``log_dir``, ``export``: the trained policy's
    folder). ``val_every`` > 0 validates every that many steps as well; ``teacher`` (a model folder with this
    tokenizer) trains by on-policy distillation from it instead of the reward (``GRPOConfig.distillation``, the
    per-token reverse KL times ``distill_coef`` as the advantage; the reward is still scored and logged).
    ``precision``: Lightning's (``"bf16-mixed"``: float32 weights, bf16 compute; the vLLM engine in ``engine_dtype``,
    "auto" = the trainer's compute dtype); ``correction``: a key of :data:`CORRECTIONS`."""
    if correction not in CORRECTIONS:
        raise ValueError(f"correction={correction!r}: choose one of {', '.join(CORRECTIONS)}")
    start = time.perf_counter()
    L.seed_everything(seed)
    module = GRPOModule(
        model=model,
        reward_funcs=REWARDS,
        reward_weights=WEIGHTS,
        config=GRPOConfig(num_generations=num_generations, max_prompt_length=128, max_new_tokens=max_new_tokens,
                          temperature=temperature, beta=0.0, loss_type=loss_type,
                          engine=EngineConfig(name=engine or "auto", dtype=engine_dtype),
                          **CORRECTIONS[correction],
                          distillation=DistillationConfig(teacher=teacher, coef=distill_coef),
                          eval=EvalConfig(max_new_tokens=max_new_tokens, num_samples=eval_samples,
                                          temperature=temperature)),
        learning_rate=learning_rate,
    )
    data = PromptDataModule(f"arithmetic-{level}", prompts_per_step=prompts_per_step, val_size=val_size,
                            val_batch_size=val_size, seed=seed)
    logger = CSVLogger(root, name="lightning_logs")
    trainer = L.Trainer(
        max_steps=max_steps,
        accumulate_grad_batches=1,
        gradient_clip_val=1.0,
        precision=precision,
        log_every_n_steps=1,
        # micro-batches: one per optimizer step here, so after the last step (and every val_every steps)
        val_check_interval=val_every if 0 < val_every < max_steps else max_steps,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=logger,
        callbacks=[GRPOModelCheckpoint(save_last="link", every_n_train_steps=max_steps, save_on_exception=True),
                   CompletionTable(every_n_steps=1, print_every_n_steps=10, print_rows=2), GRPOProgressBar()],
        default_root_dir=root,
        enable_model_summary=False,
    )
    engine = resolve_engine_name(module.config.engine.name)  # "auto": vllm where installed, else hf
    trainer.validate(module, datamodule=data)  # the held-out score before training, logged at step 0
    trainer.fit(module, datamodule=data)
    log_dir = Path(logger.log_dir)
    summary = summarize(log_dir / "metrics.csv")
    summary["plot"] = str(plot_metrics(log_dir, title=f"GRPO on arithmetic-{level}, SmolLM2-135M ({engine})"))
    summary["completions"] = str(log_dir / "completions.csv")
    summary["log_dir"] = str(log_dir)
    summary["export"] = str(log_dir / "hf_model")  # GRPOModule's default export_dir
    summary["seconds"] = time.perf_counter() - start
    summary["settings"] = dict(max_steps=max_steps, prompts_per_step=prompts_per_step, num_generations=num_generations,
                               max_new_tokens=max_new_tokens, learning_rate=learning_rate, val_size=val_size,
                               level=level, temperature=temperature, eval_samples=eval_samples, loss_type=loss_type,
                               engine=engine, seed=seed, rewards=REWARDS, weights=WEIGHTS, val_every=val_every,
                               teacher=teacher, distill_coef=distill_coef, model=model, precision=precision,
                               correction=correction, engine_dtype=module.resolved.engine_dtype)
    print(table(summary))
    print(f"plot: {summary['plot']}\ncompletions: {summary['completions']}\ntook {summary['seconds'] / 60:.1f} min")
    return summary


def parse_args(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = main.__defaults__  # type: ignore[attr-defined]
    names = main.__code__.co_varnames[: main.__code__.co_argcount]
    for name, default in zip(names, defaults, strict=True):
        kind = type(default) if default is not None else str
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=default)
    return {k.replace("-", "_"): v for k, v in vars(parser.parse_args(argv)).items()}


if __name__ == "__main__":
    main(**parse_args())
