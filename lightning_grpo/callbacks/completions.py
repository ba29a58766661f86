"""The completion table: prompt, completion, each reward function's value, reward, advantage and length, every N
optimizer steps, through whatever loggers the trainer has. For multi-turn episodes the completion is the whole
transcript, turn by turn, each turn's boundary marked with who wrote it, its tokens and whether they were trained
(:meth:`lightning_grpo.protocols.episode.EpisodeRecord.transcript`), followed by ``turns``, ``tool_calls``,
``tool_errors`` and ``env_tokens`` columns; ``length`` counts the model's tokens. When the rollout carries each
token's weight version (``Experience.completion_versions``: streaming rollouts, rollout servers), a ``versions``
column gives each completion's span: ``"3"`` (one version) or ``"3-5"`` (its oldest and newest token's).

Where the rows go (history kept: each logged step adds rows, nothing is overwritten):

* always: ``<trainer.log_dir>/completions.jsonl`` and ``completions.csv`` (next to CSVLogger's ``metrics.csv``),
  appended;
* ``TensorBoardLogger``: a markdown table as text under the tag ``completions`` at the step (TensorBoard's text
  tab keeps every step);
* ``WandbLogger``: a ``wandb.Table`` logged as ``completions`` at the step;
* ``MLFlowLogger``: an artifact ``completions/step_<step>.jsonl``;
* with ``print_every_n_steps``: a few rows on the console, each cut to a few lines that fit the terminal's width
  (80 columns without one), so the progress and the summary stay readable (:func:`format_rows`).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import textwrap
from typing import Any, Callable, Optional

import lightning as L
from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger
from typing_extensions import override

from lightning_grpo.callbacks.grpo_callback import GRPOCallback
from lightning_grpo.events import ExperienceReady

#: Table columns before the reward functions' own.
LEADING = ("step", "group", "prompt", "completion")
#: Table columns after them.
TRAILING = ("reward", "advantage", "length")
#: More columns for multi-turn episodes.
EPISODE = ("turns", "tool_calls", "tool_errors", "env_tokens")
#: The column of each completion's weight-version span (rollouts that carry per-token versions).
VERSIONS = "versions"


def version_span(versions: list[int]) -> str:
    """A completion's weight versions as a span: ``"3"``, ``"3-5"`` (oldest-newest of its sampled tokens; -1, a
    token no engine sampled, left out), ``""`` when none is known."""
    known = [v for v in versions if v >= 0]
    if not known:
        return ""
    low, high = min(known), max(known)
    return str(low) if low == high else f"{low}-{high}"


def prompt_text(prompt: Any) -> str:
    """The text of a prompt: a string as is, a message list's last user message (else its last message)."""
    if isinstance(prompt, str):
        return prompt
    users = [m for m in prompt if m.get("role") == "user"] or list(prompt)
    return str(users[-1].get("content", "")) if users else ""


def _number(value: float) -> Optional[float]:
    return None if value != value else round(float(value), 4)  # NaN -> None (null in JSON, empty in CSV)


class CompletionTable(GRPOCallback):
    """Logs a table of completions every ``every_n_steps`` optimizer steps (see the module docstring).

    Args:
        every_n_steps: log the rollout trained on at optimizer steps 0, N, 2N, ... (>= 1).
        max_rows: rows per logged step (the first groups' completions), None for all.
        print_every_n_steps: also print ``print_rows`` rows on the console every this many steps; 0: never.
        print_rows: rows printed.
        filename: the base name of the JSONL and CSV files in ``trainer.log_dir``.

    Raises:
        ValueError: ``every_n_steps < 1``, ``max_rows < 1``, ``print_every_n_steps < 0``.
    """

    def __init__(self, every_n_steps: int = 1, max_rows: Optional[int] = None, print_every_n_steps: int = 0,
                 print_rows: int = 2, filename: str = "completions") -> None:
        if every_n_steps < 1 or (max_rows is not None and max_rows < 1) or print_every_n_steps < 0:
            raise ValueError(f"CompletionTable needs every_n_steps >= 1, max_rows >= 1 or None and "
                             f"print_every_n_steps >= 0, got {every_n_steps}, {max_rows}, {print_every_n_steps}")
        self.every_n_steps, self.max_rows = every_n_steps, max_rows
        self.print_every_n_steps, self.print_rows = print_every_n_steps, print_rows
        self.filename = filename
        self._writers: list[tuple[Any, TableWriter]] = []

    @override
    def setup(self, trainer: "L.Trainer", pl_module: "L.LightningModule", stage: str) -> None:
        """Pick, once, how each of the trainer's loggers receives the table (:func:`table_writers`)."""
        self._writers = table_writers(trainer.loggers)

    def rows(self, step: int, event: ExperienceReady) -> tuple[list[str], list[list]]:
        """``(columns, rows)`` of one rollout: ``step, group, prompt, completion, <reward fns>..., reward,
        advantage, length`` (multi-turn: then ``turns, tool_calls, tool_errors, env_tokens``; with per-token weight
        versions: then ``versions``)."""
        rollout, episodes = event.rollout, event.rollout.episodes
        versions = event.experience.completion_versions
        columns = list(LEADING) + list(rollout.reward_names) + list(TRAILING) + (list(EPISODE) if episodes else [])
        columns += [VERSIONS] if versions is not None else []
        per_function, rewards = rollout.per_function.tolist(), rollout.rewards.tolist()
        advantages, lengths = event.advantages.tolist(), rollout.lengths.tolist()
        trained = event.experience.completion_mask.any(dim=1).tolist()
        n = len(rollout.completions) if self.max_rows is None else min(self.max_rows, len(rollout.completions))
        rows = []
        for i in range(n):
            completion = episodes[i].transcript(bool(trained[i])) if episodes else rollout.completions[i]
            row = [step, i // rollout.num_generations, prompt_text(rollout.prompts[i]), completion]
            row += [_number(v) for v in per_function[i]] + [_number(rewards[i]), _number(advantages[i]),
                                                            int(lengths[i])]
            if episodes:
                e = episodes[i]
                row += [e.model_turns, e.tool_calls, e.tool_errors, sum(t.end - t.start for t in e.turns
                                                                        if t.source == "env")]
            if versions is not None:
                row.append(version_span(versions[i].tolist()))
            rows.append(row)
        return columns, rows

    @override
    def on_experience(self, trainer: "L.Trainer", pl_module: "L.LightningModule", event: ExperienceReady) -> None:
        step = trainer.global_step
        log_now = step % self.every_n_steps == 0
        print_now = self.print_every_n_steps and step % self.print_every_n_steps == 0
        if not (log_now or print_now):
            return
        # every process reads log_dir: under DDP/FSDP Lightning broadcasts it from rank 0 (rank 0 alone would hang)
        folder = trainer.log_dir or trainer.default_root_dir
        if not trainer.is_global_zero:
            return
        columns, rows = self.rows(step, event)
        if log_now:
            self._write_files(folder, columns, rows)
            for logger, write in self._writers:
                write(logger, step, columns, rows)
        if print_now:
            _print_rows(step, columns, rows[: self.print_rows])

    def _write_files(self, folder: str, columns: list[str], rows: list[list]) -> None:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{self.filename}.jsonl"), "a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(dict(zip(columns, row, strict=True)), ensure_ascii=False) + "\n")
        path = os.path.join(folder, f"{self.filename}.csv")
        new = not os.path.exists(path)
        with open(path, "a", encoding="utf-8", newline="") as f:
            writer = csv.writer(f)
            if new:
                writer.writerow(columns)
            writer.writerows(rows)


def markdown_table(columns: list[str], rows: list[list]) -> str:
    """A markdown table (TensorBoard renders it); ``|`` and newlines in cells are escaped."""

    def cell(value: Any) -> str:
        return "" if value is None else str(value).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


#: ``write(logger, step, columns, rows)``: one logger's way of receiving the table.
TableWriter = Callable[[Any, int, list[str], list[list]], None]


def _tensorboard(logger: Any, step: int, columns: list[str], rows: list[list]) -> None:
    logger.experiment.add_text("completions", markdown_table(columns, rows), global_step=step)


def _wandb(logger: Any, step: int, columns: list[str], rows: list[list]) -> None:
    logger.log_table(key="completions", columns=columns, data=rows, step=step)


def _mlflow(logger: Any, step: int, columns: list[str], rows: list[list]) -> None:
    text = "".join(json.dumps(dict(zip(columns, r, strict=True)), ensure_ascii=False) + "\n" for r in rows)
    logger.experiment.log_text(logger.run_id, text, f"completions/step_{step:06d}.jsonl")


#: The loggers that receive the table, and how; others (``CSVLogger``: the files next to ``metrics.csv`` are the
#: table) get nothing more.
WRITERS: tuple[tuple[type, TableWriter], ...] = (
    (TensorBoardLogger, _tensorboard), (WandbLogger, _wandb), (MLFlowLogger, _mlflow),
)


def table_writers(loggers: list[Any]) -> list[tuple[Any, TableWriter]]:
    """``(logger, writer)`` for each of ``loggers`` that :data:`WRITERS` names (its first matching class)."""
    picked = [(logger, next((w for cls, w in WRITERS if isinstance(logger, cls)), None)) for logger in loggers]
    return [(logger, writer) for logger, writer in picked if writer is not None]


#: Console lines of one printed row's prompt and completion (each cut with "…" beyond).
PROMPT_LINES, COMPLETION_LINES = 2, 4


def _clip(text: str, width: int, lines: int, indent: str = "") -> list[str]:
    """``text`` with its whitespace collapsed, wrapped to ``width`` columns after ``indent`` (continuation lines two
    spaces deeper), at most ``lines`` lines, the last one ending in "…" when cut."""
    wrapped = textwrap.wrap(" ".join(str(text).split()), width=width, initial_indent=indent,
                            subsequent_indent=indent + "  ") or [indent]
    if len(wrapped) > lines:
        wrapped = wrapped[:lines]
        wrapped[-1] = wrapped[-1][: width - 1] + "…"
    return wrapped


def format_rows(step: int, columns: list[str], rows: list[list], width: int) -> list[str]:
    """The console form of a few rows, every line at most ``width`` characters (at least 40): a title, then per row a
    line of its numbers (the reward functions' values, reward, advantage, length) and the prompt and completion cut
    to :data:`PROMPT_LINES` and :data:`COMPLETION_LINES` lines. The whole rows are in the CSV/JSONL files."""
    width = max(40, width)
    lines = [f"completions at step {step} ({len(rows)} shown; all rows in completions.csv)"[:width]]
    values = columns[len(LEADING):]
    for row in rows:
        cells = dict(zip(columns, row, strict=True))
        numbers = ", ".join(f"{name}={'' if cells[name] is None else cells[name]}" for name in values)
        lines += _clip(f"- group {cells['group']}: {numbers}", width, 2)
        lines += _clip(f"prompt: {cells['prompt']}", width, PROMPT_LINES, indent="  ")
        lines += _clip(f"completion: {cells['completion']}", width, COMPLETION_LINES, indent="  ")
    return lines


def _print_rows(step: int, columns: list[str], rows: list[list]) -> None:
    width = shutil.get_terminal_size(fallback=(80, 24)).columns  # $COLUMNS first; 80 without a terminal
    print("\n".join(format_rows(step, columns, rows, width)), flush=True)
