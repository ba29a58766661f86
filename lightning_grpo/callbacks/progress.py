"""A progress bar that counts what GRPO counts: optimizer steps against ``max_steps`` (or prompt batches against
the epoch), the current phase with its elapsed time, tokens generated so far during a rollout, and reward and
accuracy on the bar.

Lightning's bar counts training "batches", which for GRPO are experience micro-batches (several per optimizer
step), prints a total of ``-1`` epochs for a step-limited run, shows a meaningless ``v_num`` and does not move while
a rollout generates. This one is a :class:`~lightning.pytorch.callbacks.TQDMProgressBar` whose main bar advances
once per optimizer step; a background thread refreshes its description every ``refresh_s`` seconds with the phase
(``rollout``, ``scoring`` (rewards, old/ref logprobs, advantages), ``training``, ``validation``), its elapsed
seconds and, during a rollout, ``~N tok`` (the engine's count, :attr:`lightning_grpo.protocols.rollout.StopFlag.ticks`).

When standard output is not a terminal (CI, SLURM and ``nohup`` logs, ``scripts/train.sh > log``) a redrawn bar
would write a line every second; there the bar prints one plain line per optimizer step instead (its step, the
metrics the bar shows, and the seconds spent in each phase of the step), one per validation, and none in between.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable, Optional, Protocol, Union, runtime_checkable

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from typing_extensions import override

from lightning_grpo.callbacks.grpo_callback import GRPOCallback
from lightning_grpo.events import ExperienceReady, RolloutEnd


@runtime_checkable
class CountsGeneratedTokens(Protocol):
    """A module that can say how many tokens its engine has generated so far (``GRPOModule``)."""

    @property
    def generated_tokens_estimate(self) -> int:
        """Tokens generated so far, all rollouts (an estimate; read differences)."""
        ...


def token_counter(module: L.LightningModule) -> Optional[Callable[[], int]]:
    """How to read ``module``'s generated-token count (a :class:`CountsGeneratedTokens` module: ``GRPOModule``),
    decided once; None for a module that generates nothing (its steps have no rollout phase)."""
    if isinstance(module, CountsGeneratedTokens):
        counter: CountsGeneratedTokens = module
        return lambda: counter.generated_tokens_estimate
    return None


#: Metrics shown on the bar, in this order, when logged.
SHOWN = ("reward", "val/accuracy", "val/pass@1", "loss")
#: The phases of an optimizer step whose seconds the plain lines give.
PHASES = ("rollout", "scoring", "training")


def _number(value: Any) -> str:
    try:
        return f"{float(value):.4g}"
    except (TypeError, ValueError):
        return str(value)


class GRPOProgressBar(TQDMProgressBar, GRPOCallback):
    """See the module docstring.

    Args:
        refresh_s: seconds between the background refreshes of the phase line (> 0).
        leave: keep the finished bar on screen.
        interactive: True: the redrawn bar; False: a plain line per optimizer step and per validation; None: True
            when standard output is a terminal (decided when a fit, validation or test starts).

    Raises:
        ValueError: ``refresh_s`` <= 0.
    """

    def __init__(self, refresh_s: float = 1.0, leave: bool = True, interactive: Optional[bool] = None) -> None:
        super().__init__(refresh_rate=1, leave=leave)
        if refresh_s <= 0:
            raise ValueError(f"refresh_s must be > 0, got {refresh_s}")
        self.refresh_s = refresh_s
        self.interactive = interactive
        self._phase_seconds: dict[str, float] = {}
        self.phase, self._phase_start, self._ticks_start = "setup", time.monotonic(), 0
        self._tokens: Callable[[], int] = lambda: 0  # the module's generated-token count (picked at train start)
        self._step_phase = "rollout"  # a step's first phase: "training" for a module that generates nothing
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ what the bar counts
    @property
    @override
    def total_train_batches(self) -> Union[int, float]:
        """Optimizer steps to go in this fit (``max_steps``), else prompt batches per epoch."""
        trainer = self.trainer
        if trainer.max_steps and trainer.max_steps > 0:
            return trainer.max_steps
        try:
            return len(trainer.train_dataloader)  # prompt batches
        except TypeError:  # no DataLoader yet, or one without a length
            return float("inf")

    @override
    def get_metrics(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> dict[str, Any]:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return {k: metrics[k] for k in SHOWN if k in metrics}

    def set_phase(self, phase: str) -> None:
        """Start a new phase (its elapsed time and token count start at 0); the phase that ends adds its seconds
        to the step's (the plain lines' ``rollout 12s``)."""
        now = time.monotonic()
        self._phase_seconds[self.phase] = self._phase_seconds.get(self.phase, 0.0) + now - self._phase_start
        self.phase, self._phase_start = phase, now
        self._ticks_start = self._ticks()

    @property
    def is_interactive(self) -> bool:
        """Whether this bar redraws (see ``interactive``)."""
        return sys.stdout.isatty() if self.interactive is None else self.interactive

    def step_line(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> str:
        """The plain line of the optimizer step just finished: ``step 3/10 | reward 0.41 | loss 0.012 | rollout
        12s, scoring 3s, training 5s``."""
        total = self.total_train_batches
        parts = [f"step {trainer.global_step}/{total if total != float('inf') else '?'}"]
        parts += [f"{k} {_number(v)}" for k, v in self.get_metrics(trainer, pl_module).items()]
        phases = ", ".join(f"{k} {v:.0f}s" for k, v in self._phase_seconds.items() if k in PHASES)
        return " | ".join(parts + ([phases] if phases else []))

    def _print(self, line: str) -> None:
        if self.is_enabled:  # rank 0 only (Lightning disables the bar on the other ranks)
            print(line, flush=True)

    # ------------------------------------------------------------------ plain lines (not a terminal): no bars
    @override
    def init_train_tqdm(self) -> Tqdm:
        return super().init_train_tqdm() if self.is_interactive else Tqdm(disable=True)

    @override
    def init_validation_tqdm(self) -> Tqdm:
        return super().init_validation_tqdm() if self.is_interactive else Tqdm(disable=True)

    @override
    def init_sanity_tqdm(self) -> Tqdm:
        return super().init_sanity_tqdm() if self.is_interactive else Tqdm(disable=True)

    @override
    def init_test_tqdm(self) -> Tqdm:
        return super().init_test_tqdm() if self.is_interactive else Tqdm(disable=True)

    @override
    def init_predict_tqdm(self) -> Tqdm:
        return super().init_predict_tqdm() if self.is_interactive else Tqdm(disable=True)

    def description(self) -> str:
        """``<phase> <elapsed>s`` and, during a rollout, ``~<tokens> tok``."""
        text = f"{self.phase} {time.monotonic() - self._phase_start:.0f}s"
        if self.phase == "rollout":
            text += f" ~{self._ticks() - self._ticks_start} tok"
        return text

    def _ticks(self) -> int:
        return self._tokens()

    # ------------------------------------------------------------------ Lightning hooks
    @override
    def on_train_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        super().on_train_start(trainer, pl_module)
        counter = token_counter(pl_module)
        self._tokens = counter or (lambda: 0)
        self._step_phase = "rollout" if counter is not None else "training"
        self.train_progress_bar.reset(total=self.total_train_batches)
        self.train_progress_bar.initial = 0
        self.train_progress_bar.n = trainer.global_step
        self.set_phase(self._step_phase)
        self._phase_seconds = {}
        self._stop.clear()
        if self.is_interactive:
            self._thread = threading.Thread(target=self._refresh_loop, name="grpo-progress", daemon=True)
            self._thread.start()

    @override
    def on_train_epoch_start(self, trainer: "L.Trainer", *_: Any) -> None:
        self.train_progress_bar.set_description(f"Epoch {trainer.current_epoch}")

    @override
    def on_train_batch_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule", outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        bar = self.train_progress_bar
        # an optimizer step ended in this batch: the GRPO loop's batches are experience micro-batches (several a step),
        # another module's may be accumulated; both count steps in ``trainer.global_step``
        if trainer.global_step > bar.n:
            bar.n = trainer.global_step
            self.set_phase(self._step_phase)
            if not self.is_interactive:
                self._print(self.step_line(trainer, pl_module))
                self._phase_seconds = {}
        bar.set_postfix(self.get_metrics(trainer, pl_module), refresh=False)
        bar.refresh()

    @override
    def on_rollout_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule", rollout: RolloutEnd) -> None:
        self.set_phase("scoring")

    @override
    def on_experience(self, trainer: "L.Trainer", pl_module: "L.LightningModule", event: ExperienceReady) -> None:
        self.set_phase("training")

    @override
    def on_validation_start(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        super().on_validation_start(trainer, pl_module)
        self._previous_phase = self.phase
        self.set_phase("validation")

    @override
    def on_validation_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        super().on_validation_end(trainer, pl_module)
        if not self.is_interactive and not trainer.sanity_checking:
            shown = {k: v for k, v in self.get_metrics(trainer, pl_module).items() if k.startswith("val")}
            self._print(" | ".join([f"validation at step {trainer.global_step}"]
                                   + [f"{k} {_number(v)}" for k, v in shown.items()]))
        if trainer.state.fn == "fit":
            self.set_phase(self._step_phase)
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))

    @override
    def on_train_end(self, trainer: "L.Trainer", pl_module: "L.LightningModule") -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.refresh_s)
            self._thread = None
        self.train_progress_bar.n = trainer.global_step
        self.train_progress_bar.set_description(f"done {trainer.global_step} steps")
        super().on_train_end(trainer, pl_module)

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            bar = self._train_progress_bar
            if bar is not None and not bar.disable:
                bar.set_description(self.description(), refresh=True)
