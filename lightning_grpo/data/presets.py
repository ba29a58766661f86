"""The dataset presets: where GSM8K and MATH-500 live (offline folder, hub fallback), their columns, and the
instruction each prompt gets (see :class:`lightning_grpo.data.PromptDataModule`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

#: Default system message of every prompt.
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant that solves math problems carefully."
#: Placeholder replaced by the question in ``instruction``.
QUESTION_PLACEHOLDER = "{question}"
GSM8K_INSTRUCTION = (
    "{question}\n\nSolve the problem step by step. "
    "Then write the final answer as a number on the last line, in the form:\n#### <number>"
)
MATH_INSTRUCTION = "{question}\n\nSolve the problem step by step, and put the final answer in \\boxed{}."

AnswerFormat = Literal["gsm8k", "raw"]


@dataclass(frozen=True)
class Preset:
    """Where a named dataset lives (offline folder and hub fallback) and how its rows are read."""

    folder: str
    files: dict[str, str]
    hub_id: str
    hub_config: Optional[str]
    train_split: str
    val_split: str
    question_field: str
    answer_field: str
    solution_field: str
    answer_format: AnswerFormat
    instruction: str
    accuracy_reward: str = "gsm8k_accuracy"  #: the registered reward that checks answers when evaluating on it


PRESETS: dict[str, Preset] = {
    "gsm8k": Preset(
        folder="gsm8k",
        files={"train": "train.jsonl", "test": "test.jsonl"},
        hub_id="openai/gsm8k",
        hub_config="main",
        train_split="train",
        val_split="test",
        question_field="question",
        answer_field="answer",
        solution_field="answer",
        answer_format="gsm8k",
        instruction=GSM8K_INSTRUCTION,
    ),
    "math500": Preset(
        folder="math500",
        files={"test": "test.jsonl"},
        hub_id="HuggingFaceH4/MATH-500",
        hub_config=None,
        train_split="test",
        val_split="test",
        question_field="problem",
        answer_field="answer",
        solution_field="solution",
        answer_format="raw",
        instruction=MATH_INSTRUCTION,
        accuracy_reward="math_accuracy",
    ),
}
