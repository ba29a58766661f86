"""GRPO with a calculator tool on 3- and 4-digit arithmetic, with the embedded SmolLM2-135M-Instruct, on a CPU.

    python recipes/arithmetic_tools.py                   # validate, train 30 steps, validate, report
    python recipes/arithmetic_tools.py --max-steps 2 --prompts-per-step 2 --num-generations 2 --val-size 4  # smoke

The task: "What is 487 * 653?" (a product of two 3-digit numbers) or "What is 4821 + 9377?" (a sum of two 4-digit
numbers), seeded, train and held-out questions disjoint (written to ``<root>/data/{train,test}.jsonl``), after one
worked example in which the assistant calls the calculator, reads its result and answers on a last line
``#### <number>``. A 135M model cannot multiply 3-digit numbers by itself; the episode is multi-turn: the model's
tool call is run (:func:`lightning_grpo.episodes.calculator`), its result appended as a ``tool`` turn, and the model
answers (at most ``max_turns`` model turns, ``max_tokens`` tokens per episode; docs/multiturn.md). The reward is
strict accuracy of the final answer (the format is logged, not rewarded). The held-out scores are greedy accuracy and
the unbiased pass@1 of ``eval_samples`` samples, measured by the same validation (also multi-turn, with the tool)
before training and after it. The run ends with a before/after table: train reward, tool calls per episode, tool
error rate, held-out accuracy.

The tool is described to SmolLM2, whose chat template has no tool support, in a short system message
(:class:`ShortToolInstructions`, a :class:`~lightning_grpo.episodes.ToolCallParser` with the Hermes ``<tool_call>``
JSON format and shorter instructions than the default JSON schema listing, which costs a 135M model more context).
"""

from __future__ import annotations

import os

# vLLM's CPU engine cuts this process's torch threads to 1 (training included) unless OMP_NUM_THREADS is set: use
# every core this process may run on, before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))

import argparse  # noqa: E402
import csv  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Optional  # noqa: E402

import lightning as L  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402

from lightning_grpo import GRPOConfig, GRPOModule  # noqa: E402
from lightning_grpo.callbacks import CompletionTable, GRPOModelCheckpoint, GRPOProgressBar  # noqa: E402
from lightning_grpo.config import EngineConfig, EpisodeConfig, EvalConfig  # noqa: E402
from lightning_grpo.data import PromptDataModule  # noqa: E402
from lightning_grpo.episodes import HermesToolCallParser  # noqa: E402
from lightning_grpo.evaluation.plot import plot_metrics  # noqa: E402
from lightning_grpo.rollout.engine_registry import resolve_engine_name  # noqa: E402

#: The reward functions (accuracy first: it is the validation's check) and their weights: the reward is the strict
#: accuracy of the final answer, in {0, 1}; the format is logged only.
REWARDS = ["gsm8k_accuracy_strict", "gsm8k_format"]
WEIGHTS = [1.0, 0.0]
INSTRUCTION = "{question} Use the calculator, then give the final answer on the last line as #### <number>."


def _call(expression: str) -> str:
    return '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>' % expression


#: The worked example before every question (in no split): a tool call, its result, the answer.
FEWSHOT = [{"role": "user", "content": INSTRUCTION.format(question="What is 314 * 271?")},
           {"role": "assistant", "content": _call("314 * 271")},
           {"role": "tool", "name": "calculator", "content": "85094"},
           {"role": "assistant", "content": "314 * 271 = 85094\n#### 85094"}]


class ShortToolInstructions(HermesToolCallParser):
    """The Hermes ``<tool_call>`` format, described in two sentences per tool instead of the JSON schemas."""

    def instructions(self, schemas: list[dict[str, Any]]) -> str:
        tools = "\n".join(f"- {s['function']['name']}: {s['function']['description']}" for s in schemas)
        return (f"You can use these tools:\n{tools}\nTo use one, write it as in\n" + _call("12 * 34")
                + "\nwith your own expression, and wait for its result.")


def tool_arithmetic_rows(train_size: int, test_size: int, seed: int = 0) -> dict[str, list[dict]]:
    """Seeded, disjoint train and test questions: half ``a * b`` (100 <= a, b <= 999), half ``a + b``
    (1000 <= a, b <= 9999); the worked example (314 * 271) is in neither.

    Raises:
        ValueError: a size below 1 (train) or 0 (test).
    """
    if train_size < 1 or test_size < 0:
        raise ValueError(f"train_size must be >= 1 and test_size >= 0, got {train_size} and {test_size}")
    rng, seen = random.Random(seed), {(314, "*", 271)}
    rows: list[dict] = []
    while len(rows) < train_size + test_size:
        op = "*" if len(rows) % 2 == 0 else "+"
        low, high = (100, 999) if op == "*" else (1000, 9999)
        a, b = rng.randint(low, high), rng.randint(low, high)
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        rows.append({"question": f"What is {a} {op} {b}?", "answer": str(a * b if op == "*" else a + b),
                     "fewshot": FEWSHOT})
    return {"test": rows[:test_size], "train": rows[test_size:]}


def write_splits(folder: Path, train_size: int, test_size: int, seed: int) -> Path:
    """:func:`tool_arithmetic_rows` as ``folder/train.jsonl`` and ``folder/test.jsonl`` (the data module's splits)."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in tool_arithmetic_rows(train_size, test_size, seed).items():
        with open(folder / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    return folder


def _mean(values: list[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else float("nan")


def summarize(metrics_csv: Path, first: int = 5) -> dict[str, Any]:
    """The before/after numbers of a run's ``metrics.csv``: train reward, tool calls per episode and tool error rate
    (mean of the first and of the last ``first`` optimizer steps), held-out accuracy and pass@1 (the first and the
    last validation), and the curves."""
    rows = list(csv.DictReader(open(metrics_csv, newline="")))

    def column(name: str) -> list[tuple[int, float]]:
        return [(int(r["step"]), float(r[name])) for r in rows if r.get(name) not in (None, "")]

    def first_last(name: str) -> dict[str, float]:
        values = [v for _, v in column(name)]
        return {"first": _mean(values[:first]), "last": _mean(values[-first:])}

    accuracy, sampled = column("val/accuracy"), column("val/pass@1")
    reward = column("reward")
    return {
        "reward": first_last("reward"),
        "tool_calls_per_episode": first_last("tools/calls_per_episode"),
        "tool_error_rate": first_last("tools/error_rate"),
        "turns": first_last("turns/mean"),
        "format": first_last("rewards/gsm8k_format/mean"),
        "heldout_accuracy": {"before": accuracy[0][1] if accuracy else float("nan"),
                             "after": accuracy[-1][1] if len(accuracy) > 1 else float("nan")},
        "heldout_pass@1": {"before": sampled[0][1] if sampled else float("nan"),
                           "after": sampled[-1][1] if len(sampled) > 1 else float("nan")},
        "curve": {"step": [s for s, _ in reward], "reward": [v for _, v in reward],
                  "tool_calls_per_episode": [v for _, v in column("tools/calls_per_episode")],
                  "tool_error_rate": [v for _, v in column("tools/error_rate")],
                  "turns": [v for _, v in column("turns/mean")],
                  "timing_step_s": [v for _, v in column("timing/step_s")]},
        "val_curve": accuracy,
    }


def table(summary: dict[str, Any], first: int = 5) -> str:
    """The printed before/after table."""
    lines = [f"{'':46s}{'before':>10s}{'after':>10s}"]
    for key, label in (("reward", "train reward"), ("tool_calls_per_episode", "tool calls per episode"),
                       ("tool_error_rate", "tool error rate"), ("turns", "model turns per episode")):
        values = summary[key]
        lines.append(f"{f'{label} (first/last {first} steps)':46s}{values['first']:>10.3f}{values['last']:>10.3f}")
    for key, label in (("heldout_accuracy", "held-out accuracy (greedy)"),
                       ("heldout_pass@1", "held-out pass@1 (sampled, T=train)")):
        values = summary[key]
        lines.append(f"{label:46s}{values['before']:>10.3f}{values['after']:>10.3f}")
    return "\n".join(lines)


#: Micro-batches per optimizer step (gradient accumulation).
MICRO_BATCHES = 4


def main(max_steps: int = 30, prompts_per_step: int = 8, num_generations: int = 8, max_new_tokens: int = 48,
         max_tokens: int = 160, max_turns: int = 3, learning_rate: float = 1e-5, val_size: int = 100,
         train_size: int = 2000, temperature: float = 1.0, eval_samples: int = 2, loss_type: str = "grpo",
         engine: Optional[str] = None, root: str = "outputs/arithmetic_tools", model: str = "embedded",
         seed: int = 42) -> dict[str, Any]:
    """Validate, train ``max_steps`` GRPO steps on tool episodes, validate again; print the table and paths; return
    the summary (:func:`summarize` plus ``seconds``, ``plot``, ``completions``, ``log_dir``, ``settings``)."""
    start = time.perf_counter()
    L.seed_everything(seed)
    data_dir = write_splits(Path(root) / "data", train_size, val_size, seed)
    module = GRPOModule(
        model=model,
        reward_funcs=REWARDS,
        reward_weights=WEIGHTS,
        tools=["calculator"],
        tool_parser=ShortToolInstructions(),
        config=GRPOConfig(num_generations=num_generations, max_prompt_length=512, max_new_tokens=max_new_tokens,
                          temperature=temperature, beta=0.0, loss_type=loss_type,
                          episode=EpisodeConfig(max_turns=max_turns, max_tokens=max_tokens),
                          engine=EngineConfig(name=engine or "auto"),
                          eval=EvalConfig(max_new_tokens=max_new_tokens, num_samples=eval_samples,
                                          temperature=temperature)),
        learning_rate=learning_rate,
    )
    data = PromptDataModule(str(data_dir), prompts_per_step=prompts_per_step, val_size=val_size,
                            val_batch_size=val_size, seed=seed, system_prompt=None, instruction=INSTRUCTION,
                            answer_format="raw")
    logger = CSVLogger(root, name="lightning_logs")
    trainer = L.Trainer(
        max_steps=max_steps,
        # 4 micro-batches of 16 episodes a step (the same gradient as one of 64, docs/training.md): one micro-batch
        # of 64 episodes of ~500 tokens took 16 GiB of RSS and was OOM-killed on a 24 GiB machine
        accumulate_grad_batches=MICRO_BATCHES,
        gradient_clip_val=1.0,
        log_every_n_steps=1,
        val_check_interval=MICRO_BATCHES * max_steps,  # counted in micro-batches: once, after the last step
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
    summary["plot"] = str(plot_metrics(log_dir, title=f"GRPO with a calculator tool, SmolLM2-135M ({engine})"))
    summary["completions"] = str(log_dir / "completions.csv")
    summary["log_dir"] = str(log_dir)
    summary["seconds"] = time.perf_counter() - start
    summary["settings"] = dict(max_steps=max_steps, prompts_per_step=prompts_per_step, num_generations=num_generations,
                               max_new_tokens=max_new_tokens, max_tokens=max_tokens, max_turns=max_turns,
                               learning_rate=learning_rate, val_size=val_size, train_size=train_size,
                               temperature=temperature, eval_samples=eval_samples, loss_type=loss_type, engine=engine,
                               seed=seed, rewards=REWARDS, weights=WEIGHTS, tools=["calculator"])
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
