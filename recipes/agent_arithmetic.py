"""An unmodified OpenAI Agents SDK agent learns to use its calculator: GRPO through the agent gateway, with the embedded
SmolLM2-135M-Instruct, on a CPU (docs/agents.md).

    python recipes/agent_arithmetic.py                   # validate, train 7 steps, validate, report
    python recipes/agent_arithmetic.py --max-steps 1 --prompts-per-step 2 --num-generations 2 --val-size 4  # smoke

The agent (:func:`solve`) is written as the Agents SDK's documentation has a user write one for a model behind another
OpenAI-compatible endpoint: a ``@function_tool`` calculator, an ``Agent`` with instructions and that tool, an
``OpenAIChatCompletionsModel`` on an ``AsyncOpenAI(base_url=..., api_key=...)`` client, ``Runner.run``. The trainer
only gives it the gateway's ``base_url``, its session's ``api_key`` and the dataset row; the agent returns nothing
and the reward functions score its final output. The task is recipes/arithmetic_tools.py's (products of two 3-digit
numbers, sums of two 4-digit numbers, seeded, train and held-out questions disjoint), the reward its strict accuracy
of the final answer (``#### <number>`` on the last line); tool use is never rewarded itself. The held-out score is the
greedy accuracy of the same agent before and after training (validation runs the agent too).

The agent's input is one worked example (a question, a calculator call, its output, the answer: the SDK's input
items) and then the question. SmolLM2's chat template renders neither tools nor tool calls, so the gateway describes
the calculator in the system message after the agent's instructions
(:class:`recipes.arithmetic_tools.ShortToolInstructions`, the Hermes ``<tool_call>`` format) and writes the example's
call in that format: the model sees recipes/arithmetic_tools.py's prompt.
"""

from __future__ import annotations

import os

# vLLM's CPU engine cuts this process's torch threads to 1 (training included) unless OMP_NUM_THREADS is set: use
# every core this process may run on, before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", str(len(os.sched_getaffinity(0))))

import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Optional  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402

from lightning_grpo import GRPOConfig, GRPOModule  # noqa: E402
from lightning_grpo.callbacks import CompletionTable, GRPOProgressBar  # noqa: E402
from lightning_grpo.config import EngineConfig, EpisodeConfig, EvalConfig  # noqa: E402
from lightning_grpo.data import PromptDataModule  # noqa: E402
from lightning_grpo.episodes import AgentRollout  # noqa: E402
from lightning_grpo.episodes import calculator as evaluate  # noqa: E402
from lightning_grpo.evaluation.plot import plot_metrics  # noqa: E402
from lightning_grpo.rollout.engine_registry import resolve_engine_name  # noqa: E402
from recipes.arithmetic_tools import (  # noqa: E402
    REWARDS,
    WEIGHTS,
    ShortToolInstructions,
    summarize,
    tool_arithmetic_rows,
)
from recipes.arithmetic_tools import table as tools_table  # noqa: E402

# ----------------------------------------------------------------------------------------------------------------
# The agent: plain OpenAI Agents SDK code (https://openai.github.io/openai-agents-python/models/, "Using other LLM
# providers"); nothing in it knows it is being trained.
set_tracing_disabled(True)  # no OpenAI key: the SDK's traces would be uploaded to OpenAI

INSTRUCTIONS = "You answer arithmetic questions with the calculator."
TASK = "{question} Use the calculator, then give the final answer on the last line as #### <number>."
#: A worked example before the question, as the SDK's input items: the question, a calculator call, its output, the
#: answer (recipes/arithmetic_tools.py's few-shot conversation).
EXAMPLE = [
    {"role": "user", "content": TASK.format(question="What is 314 * 271?")},
    {"type": "function_call", "call_id": "call_example", "name": "calculator",
     "arguments": '{"expression": "314 * 271"}'},
    {"type": "function_call_output", "call_id": "call_example", "output": "85094"},
    {"role": "assistant", "content": "314 * 271 = 85094\n#### 85094"},
]


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: the expression, e.g. 12 * 34.
    """
    return str(evaluate(expression))


async def solve(base_url: str, api_key: str, row: dict) -> None:
    """One episode: the agent answers the row's question (its final output is what the reward functions score)."""
    model = OpenAIChatCompletionsModel(model="policy", openai_client=AsyncOpenAI(base_url=base_url, api_key=api_key))
    agent = Agent(name="Calculator assistant", instructions=INSTRUCTIONS, tools=[calculator], model=model)
    question = {"role": "user", "content": TASK.format(question=row["question"])}
    await Runner.run(agent, [*EXAMPLE, question], max_turns=3)
# ----------------------------------------------------------------------------------------------------------------


def write_splits(folder: Path, train_size: int, test_size: int, seed: int) -> Path:
    """recipes/arithmetic_tools.py's questions (its worked example left out: the agent's input holds one) as
    ``folder/{train,test}.jsonl``."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    for split, rows in tool_arithmetic_rows(train_size, test_size, seed).items():
        with open(folder / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps({"question": r["question"], "answer": r["answer"]}) + "\n" for r in rows)
    return folder


def table(summary: dict[str, Any]) -> str:
    """The printed before/after table (recipes/arithmetic_tools.py's, without sampled evaluation; "tool error rate"
    counts the calls that did not parse, "model turns" the agent's model calls)."""
    return "\n".join(line for line in tools_table(summary).split("\n") if not line.startswith("held-out pass@1"))


#: Micro-batches per optimizer step (gradient accumulation).
MICRO_BATCHES = 4


def main(max_steps: int = 7, prompts_per_step: int = 4, num_generations: int = 8, max_new_tokens: int = 48,
         max_tokens: int = 160, max_turns: int = 3, learning_rate: float = 1e-5, val_size: int = 64,
         train_size: int = 2000, temperature: float = 1.0, loss_type: str = "grpo", engine: Optional[str] = None,
         root: str = "outputs/agent_arithmetic", model: str = "embedded", seed: int = 42) -> dict[str, Any]:
    """Validate, train ``max_steps`` GRPO steps on the agent's episodes, validate again; print the table and paths;
    return the summary (:func:`recipes.arithmetic_tools.summarize` plus ``seconds``, ``plot``, ``completions``,
    ``log_dir``, ``settings``)."""
    start = time.perf_counter()
    L.seed_everything(seed)
    data_dir = write_splits(Path(root) / "data", train_size, val_size, seed)
    module = GRPOModule(
        model=model,
        reward_funcs=REWARDS,
        reward_weights=WEIGHTS,
        agent=AgentRollout(solve, tool_parser=ShortToolInstructions(), timeout_s=300),
        config=GRPOConfig(num_generations=num_generations, max_prompt_length=512, max_new_tokens=max_new_tokens,
                          temperature=temperature, beta=0.0, loss_type=loss_type,
                          episode=EpisodeConfig(max_turns=max_turns, max_tokens=max_tokens),
                          engine=EngineConfig(name=engine or "auto"),
                          eval=EvalConfig(max_new_tokens=max_new_tokens)),
        learning_rate=learning_rate,
    )
    data = PromptDataModule(str(data_dir), prompts_per_step=prompts_per_step, val_size=val_size,
                            val_batch_size=val_size, seed=seed, system_prompt=None, answer_format="raw")
    logger = CSVLogger(root, name="lightning_logs")
    trainer = L.Trainer(
        max_steps=max_steps,
        accumulate_grad_batches=MICRO_BATCHES,  # 4 micro-batches of 8 episodes a step
        gradient_clip_val=1.0,
        log_every_n_steps=1,
        val_check_interval=MICRO_BATCHES * max_steps,  # counted in micro-batches: once, after the last step
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=logger,
        callbacks=[CompletionTable(every_n_steps=1, print_every_n_steps=10, print_rows=2), GRPOProgressBar()],
        default_root_dir=root,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    engine = resolve_engine_name(module.config.engine.name)
    trainer.validate(module, datamodule=data)  # the held-out score before training, logged at step 0
    trainer.fit(module, datamodule=data)
    log_dir = Path(logger.log_dir)
    summary = summarize(log_dir / "metrics.csv")
    summary["plot"] = str(plot_metrics(log_dir, title=f"GRPO of an OpenAI Agents SDK agent, SmolLM2-135M ({engine})"))
    summary["completions"] = str(log_dir / "completions.csv")
    summary["log_dir"] = str(log_dir)
    summary["seconds"] = time.perf_counter() - start
    summary["settings"] = dict(max_steps=max_steps, prompts_per_step=prompts_per_step, num_generations=num_generations,
                               max_new_tokens=max_new_tokens, max_tokens=max_tokens, max_turns=max_turns,
                               learning_rate=learning_rate, val_size=val_size, train_size=train_size,
                               temperature=temperature, loss_type=loss_type, engine=engine, seed=seed,
                               rewards=REWARDS, weights=WEIGHTS, agent="recipes.agent_arithmetic:solve")
    print(table(summary))
    print(f"plot: {summary['plot']}\ncompletions: {summary['completions']}\ntook {summary['seconds'] / 60:.1f} min")
    return summary


def parse_args(argv: Optional[list[str]] = None) -> dict[str, Any]:
    """:func:`main`'s keyword arguments from the command line (``--max-steps 2``, ...)."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = main.__code__.co_varnames[: main.__code__.co_argcount]
    for name, default in zip(names, main.__defaults__ or (), strict=True):
        parser.add_argument("--" + name.replace("_", "-"), type=type(default) if default is not None else str,
                            default=default)
    return vars(parser.parse_args(argv))


if __name__ == "__main__":
    main(**parse_args(sys.argv[1:]))
