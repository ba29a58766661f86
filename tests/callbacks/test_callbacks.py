"""Rollout events forwarded to callbacks (order and arguments, HF and vLLM engines), the completion table through
CSVLogger and TensorBoardLogger (read back from disk), a curriculum callback, and the progress bar."""

import csv
import glob
import json
import os
import warnings

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch.utils.data import DataLoader, Dataset

from lightning_grpo import GRPOConfig, GRPOModule
from lightning_grpo import functional as F
from lightning_grpo.callbacks import CompletionTable, GRPOCallback, GRPOProgressBar
from lightning_grpo.data import PromptDataModule
from lightning_grpo.data.datamodule import collate_prompts
from lightning_grpo.events import ExperienceReady, RolloutEnd
from support.fixtures import alternating_reward


def _length(prompts, completions, **kwargs):
    return [len(c) / 100 for c in completions]


def _module(path, engine="hf", **config):
    config = {"num_generations": 4, "max_new_tokens": 6, "max_prompt_length": 256,
              "engine": {"name": engine, "kv_cache_space_gib": 0.25}, **config}
    return GRPOModule(path, reward_funcs=[alternating_reward, _length], config=GRPOConfig.from_dict(config),
                      learning_rate=1e-3)


class Recorder(GRPOCallback):
    """Every GRPO event and Lightning's batch/optimizer hooks, in call order."""

    def __init__(self):
        self.calls, self.rollouts, self.experiences, self.batches = [], [], [], []

    def on_weights_synced(self, trainer, module, version):
        self.calls.append(("on_weights_synced", version))

    def on_rollout_end(self, trainer, module, rollout):
        self.calls.append(("on_rollout_end", trainer.global_step))
        self.rollouts.append(rollout)

    def on_experience(self, trainer, module, event):
        self.calls.append(("on_experience", trainer.global_step))
        self.experiences.append(event)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.calls.append(("train_batch", trainer.global_step))
        self.batches.append(batch)

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.calls.append(("optimizer_step", trainer.global_step))


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.engine)])
def test_hooks_are_called_in_the_documented_order_with_their_arguments(tmp_path, tiny_tied_llama_path, engine,
                                                                      cpu_trainer):
    if engine == "vllm":
        pytest.importorskip("vllm")
    recorder = Recorder()
    trainer = cpu_trainer(2, callbacks=[recorder], accumulate_grad_batches=2)
    trainer.fit(_module(tiny_tied_llama_path, engine), datamodule=PromptDataModule(prompts_per_step=2, val_size=0))

    step = [("on_rollout_end", 0), ("on_experience", 0), ("train_batch", 0), ("train_batch", 0),
            ("optimizer_step", 0)]
    first_sync = [("on_weights_synced", 0)] if engine == "vllm" else []  # the HF engine is the policy itself
    second = [(name, 1) for name, _ in step]
    assert recorder.calls == first_sync + step + [("on_weights_synced", 1)] + second

    for rollout, event in zip(recorder.rollouts, recorder.experiences, strict=True):
        assert isinstance(rollout, RolloutEnd) and isinstance(event, ExperienceReady)
        assert event.rollout is rollout
        assert len(rollout.completions) == 8 and len(rollout.prompts) == 8 and rollout.num_generations == 4
        assert rollout.prompts[0] == rollout.prompts[3] != rollout.prompts[4]  # prompt-major groups of G
        assert rollout.reward_names == ["alternating_reward", "_length"]
        expected = torch.tensor([[float(i % 2 == 0), len(c) / 100] for i, c in enumerate(rollout.completions)])
        torch.testing.assert_close(rollout.per_function, expected)
        torch.testing.assert_close(rollout.rewards, expected.sum(dim=1))
        assert rollout.columns["answer"][0] == rollout.columns["answer"][3]
        assert rollout.lengths.tolist() == [int(m.sum()) for m in event.experience.completion_mask]
        torch.testing.assert_close(event.advantages, F.group_advantages(rollout.rewards, 4))
    # the experience trained on is the one the event carried
    torch.testing.assert_close(torch.cat([b.advantages for b in recorder.batches[:2]]).sort().values,
                               recorder.experiences[0].advantages.sort().values)


def test_completion_table_through_csv_and_tensorboard_keeps_every_step(tmp_path, tiny_llama_path, cpu_trainer):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    recorder, table = Recorder(), CompletionTable(every_n_steps=2, print_every_n_steps=1, print_rows=1)
    csv_logger = CSVLogger(str(tmp_path), name="logs")
    tb_logger = TensorBoardLogger(str(tmp_path), name="tb")
    trainer = cpu_trainer(3, callbacks=[recorder, table], logger=[csv_logger, tb_logger])
    trainer.fit(_module(tiny_llama_path), datamodule=PromptDataModule(prompts_per_step=2, val_size=0))

    folder = csv_logger.log_dir
    assert os.path.exists(os.path.join(folder, "metrics.csv"))  # the table sits next to metrics.csv
    with open(os.path.join(folder, "completions.csv"), newline="") as f:
        rows = list(csv.DictReader(f))
    header = ["step", "group", "prompt", "completion", "alternating_reward", "_length", "reward", "advantage", "length"]
    assert list(rows[0]) == header
    assert [int(r["step"]) for r in rows] == [0] * 8 + [2] * 8  # steps 0 and 2, history kept
    for rows_of_step, rollout, event in ((rows[:8], recorder.rollouts[0], recorder.experiences[0]),
                                         (rows[8:], recorder.rollouts[2], recorder.experiences[2])):
        assert [r["completion"] for r in rows_of_step] == rollout.completions
        assert [int(r["group"]) for r in rows_of_step] == [0, 0, 0, 0, 1, 1, 1, 1]
        assert [float(r["alternating_reward"]) for r in rows_of_step] == [1.0, 0.0] * 4
        assert [float(r["advantage"]) for r in rows_of_step] == pytest.approx(event.advantages.tolist(), abs=1e-4)
        assert [float(r["reward"]) for r in rows_of_step] == pytest.approx(rollout.rewards.tolist(), abs=1e-4)
        assert [int(r["length"]) for r in rows_of_step] == rollout.lengths.tolist()
        assert rows_of_step[0]["prompt"] == rollout.prompts[0][-1]["content"]
    with open(os.path.join(folder, "completions.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    assert [r["completion"] for r in lines] == [r["completion"] for r in rows]

    (events,) = glob.glob(os.path.join(tb_logger.log_dir, "events.out.tfevents.*"))
    accumulator = EventAccumulator(events, size_guidance={"tensors": 0})
    accumulator.Reload()
    texts = accumulator.Tensors("completions/text_summary")
    assert [t.step for t in texts] == [0, 2]
    markdown = texts[1].tensor_proto.string_val[0].decode()
    assert markdown.startswith("| " + " | ".join(header) + " |")
    assert markdown.count("\n") == 1 + 8  # header rule + 8 rows


class LevelDataset(Dataset):
    """Prompts of the current ``level``, read when a batch is drawn."""

    def __init__(self):
        self.level = 0

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"prompt": f"level {self.level} question {i}", "answer": str(self.level)}


class LevelData(L.LightningDataModule):
    def __init__(self):
        super().__init__()
        self.prompts_per_step, self.dataset = 2, LevelDataset()

    def train_dataloader(self):
        return DataLoader(self.dataset, batch_size=2, collate_fn=collate_prompts)


def _solved_below_level_1(prompts, completions, **kwargs):
    return [1.0 if p.startswith("level 0") else 0.0 for p in prompts]


class Curriculum(GRPOCallback):
    """Raises the dataset's level once the rollout's accuracy reaches 0.9."""

    def __init__(self, dataset):
        self.dataset, self.seen = dataset, []

    def on_rollout_end(self, trainer, module, rollout):
        self.seen.append(sorted({p.split(" question")[0] for p in rollout.prompts}))
        if rollout.per_function[:, 0].mean() >= 0.9:
            self.dataset.level += 1


def test_curriculum_callback_changes_the_next_prompts(tmp_path, tiny_llama_path, cpu_trainer):
    data = LevelData()
    curriculum = Curriculum(data.dataset)
    module = GRPOModule(tiny_llama_path, reward_funcs=[_solved_below_level_1],
                        config=GRPOConfig(num_generations=2, max_new_tokens=4, max_prompt_length=64))
    cpu_trainer(3, callbacks=[curriculum]).fit(module, datamodule=data)
    # level 0 is solved (accuracy 1) -> level 1, which is not (accuracy 0) -> stays
    assert curriculum.seen == [["level 0"], ["level 1"], ["level 1"]]


def test_progress_bar_counts_optimizer_steps_and_phases(tmp_path, tiny_llama_path, cpu_trainer):
    class Phases(Callback):
        def __init__(self, bar):
            self.bar, self.seen = bar, []

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.seen.append(self.bar.phase)

    bar = GRPOProgressBar(refresh_s=0.05, interactive=True)
    phases = Phases(bar)
    trainer = cpu_trainer(2, callbacks=[bar, phases], enable_progress_bar=True, accumulate_grad_batches=2,
                       val_check_interval=4, check_val_every_n_epoch=None)
    trainer.fit(_module(tiny_llama_path), datamodule=PromptDataModule(prompts_per_step=2, val_size=2,
                                                                      val_batch_size=2))
    assert bar.train_progress_bar.total == 2 and bar.train_progress_bar.n == 2  # optimizer steps, not micro-batches
    assert phases.seen == ["training"] * 4  # training starts after on_experience
    metrics = bar.get_metrics(trainer, trainer.lightning_module)
    assert "v_num" not in metrics and set(metrics) <= {"reward", "val/accuracy", "val/pass@1", "loss"}
    assert "reward" in metrics and "val/accuracy" in metrics
    bar.set_phase("rollout")
    assert bar.description().startswith("rollout 0s ~0 tok")
    trainer.lightning_module.rollout.stop.tick(12)
    assert bar.description().endswith("~12 tok")


def test_progress_bar_prints_one_line_per_optimizer_step_when_not_a_terminal(tiny_llama_path, cpu_trainer, capsys):
    """Standard output is not a terminal under pytest (as in CI or ``train.sh > log``): no bar is drawn, no line is
    written between steps; each optimizer step (2 micro-batches here) prints one line, each validation one."""
    bar = GRPOProgressBar(refresh_s=0.01)  # a redrawn bar would write a line every 0.01 s
    assert not bar.is_interactive
    trainer = cpu_trainer(3, callbacks=[bar], enable_progress_bar=True, accumulate_grad_batches=2,
                          val_check_interval=4, check_val_every_n_epoch=None)
    trainer.fit(_module(tiny_llama_path), datamodule=PromptDataModule(prompts_per_step=2, val_size=2,
                                                                      val_batch_size=2))
    out = capsys.readouterr().out
    assert "\r" not in out and "it/s" not in out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split(" | ")[0] for line in steps] == ["step 1/3", "step 2/3", "step 3/3"]
    for line in steps:
        fields = dict(part.rsplit(" ", 1) for part in line.split(" | ")[1:-1])
        assert set(fields) >= {"reward", "loss"} and float(fields["reward"]) >= 0
        assert [phase.split()[0] for phase in line.split(" | ")[-1].split(", ")] == ["rollout", "scoring", "training"]
    (validation,) = [line for line in out.splitlines() if line.startswith("validation at step ")]  # not the sanity
    assert validation.startswith("validation at step 2 | val/accuracy ")  # check's, which Lightning runs first


class _Regression(L.LightningModule):
    """``y = w x`` from ``w = 0`` by SGD (lr 0.1) on the mean squared error: a module that generates nothing."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.zeros_(self.linear.weight)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.linear(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_progress_bar_prints_a_plain_modules_optimizer_steps(cpu_trainer, capsys):
    """Any LightningModule may be trained with the bar (docs/architecture.md): 4 batches accumulated 2 a step are
    2 lines, each with the step's last batch's loss and no rollout phase. By hand: x = 0..7, y = 2x, batches of 2;
    step 1 ends on x = (2, 3) at w = 0: loss (4² + 6²) / 2 = 26; its gradient (-2 - 26) / 2 = -14 makes w = 1.4;
    step 2 ends on x = (6, 7): loss (3.6² + 4.2²) / 2 = 15.3."""
    x = torch.arange(8.0).reshape(8, 1)
    loader = DataLoader(torch.utils.data.TensorDataset(x, 2 * x), batch_size=2)
    trainer = cpu_trainer(2, callbacks=[GRPOProgressBar()], enable_progress_bar=True, accumulate_grad_batches=2)
    trainer.fit(_Regression(), train_dataloaders=loader)
    lines = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line[:2] for line in lines] == [["step 1/2", "loss 26"], ["step 2/2", "loss 15.3"]]
    assert [line[2].split()[0] for line in lines] == ["training", "training"]


def test_a_misspelled_event_hook_is_reported_when_the_class_is_defined():
    message = (r"Typo defines on_rolout_end, which is neither a Lightning callback hook nor a rollout event "
               r"\(on_weights_synced, on_rollout_end, on_experience\)")
    with pytest.warns(UserWarning, match=message):
        class Typo(GRPOCallback):
            def on_rolout_end(self, trainer, module, rollout):
                pass

    with warnings.catch_warnings():
        warnings.simplefilter("error")

        class Fine(GRPOCallback):
            def on_rollout_end(self, trainer, module, rollout):
                pass

            def on_train_start(self, trainer, module):
                pass


def test_an_event_hook_on_a_plain_callback_is_reported_at_setup(tmp_path, tiny_llama_path, cpu_trainer):
    class Plain(Callback):
        def on_rollout_end(self, trainer, module, rollout):
            raise AssertionError("never called")

    module = GRPOModule(tiny_llama_path, reward_funcs=[lambda prompts, completions, **kw: [1.0] * len(completions)],
                        config=GRPOConfig(num_generations=2, max_new_tokens=4), export_dir="")
    trainer = cpu_trainer(1, callbacks=[Plain()], logger=False)
    with pytest.warns(UserWarning, match="Plain defines on_rollout_end but is not a lightning_grpo.callbacks."
                                         "GRPOCallback"):
        trainer.fit(module, datamodule=PromptDataModule(prompts_per_step=1, val_size=0))
    assert trainer.global_step == 1


def test_printed_completions_fit_an_80_column_console_without_a_terminal(capsys, monkeypatch):
    """The recipe's ``print_every_n_steps`` table on a non-TTY at 80 columns: 2 rows of a long one-shot prompt
    and a long completion take at most 2 + 2 * (2 + 2 + 4) lines, none wider than 80, and keep every number."""
    from lightning_grpo.callbacks.completions import COMPLETION_LINES, PROMPT_LINES, _print_rows

    monkeypatch.setenv("COLUMNS", "80")
    columns = ["step", "group", "prompt", "completion", "gsm8k_accuracy", "gsm8k_format", "reward", "advantage",
               "length"]
    prompt = "Question: Natalia sold clips to 48 of her friends in April. " * 30 + "\nAnswer step by step."
    rows = [[5, 0, prompt, "Let us think step by step. " * 60, 1.0, 0.0, 1.0, 0.8734, 160],
            [5, 0, prompt, "#### 72", 0.0, None, 0.0, -0.25, 3]]
    _print_rows(5, columns, rows)
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert len(lines) <= 1 + 2 * (2 + PROMPT_LINES + COMPLETION_LINES)
    text = "\n".join(lines)
    for value in ("gsm8k_accuracy=1.0", "advantage=0.8734", "length=160", "advantage=-0.25", "gsm8k_format=,",
                  "completion: #### 72"):
        assert value in text, value
    assert text.count("…") == 3  # both prompts and the long completion were cut


def test_completion_table_has_each_completions_version_span_when_the_rollout_carries_versions():
    """Per-token weight versions (streaming rollouts) give a ``versions`` column: one version, or oldest-newest of
    the sampled tokens (-1, padding, left out); without versions the table keeps its columns."""
    from lightning_grpo.callbacks.completions import CompletionTable, version_span
    from lightning_grpo.events import ExperienceReady, RolloutEnd
    from lightning_grpo.training.experience import Experience

    ids = torch.ones(3, 3, dtype=torch.long)
    versions = torch.tensor([[3, 3, -1], [3, 4, 5], [-1, -1, -1]])
    experience = Experience(prompt_ids=ids, prompt_mask=ids, completion_ids=ids, completion_mask=ids,
                            advantages=torch.tensor([0.5, -0.5, 0.0]), completion_versions=versions)
    rollout = RolloutEnd(prompts=["p"] * 3, completions=["a", "b", "c"], rewards=torch.tensor([1.0, 0.0, 0.0]),
                         per_function=torch.tensor([[1.0], [0.0], [0.0]]), reward_names=["acc"],
                         lengths=torch.tensor([2, 3, 0]), truncated=torch.zeros(3, dtype=torch.bool),
                         num_generations=3)
    columns, rows = CompletionTable().rows(7, ExperienceReady(experience, rollout, rollout.rewards))
    assert columns == ["step", "group", "prompt", "completion", "acc", "reward", "advantage", "length", "versions"]
    assert [row[-1] for row in rows] == ["3", "3-5", ""]
    assert rows[1] == [7, 0, "p", "b", 0.0, 0.0, -0.5, 3, "3-5"]
    experience.completion_versions = None
    columns, rows = CompletionTable().rows(7, ExperienceReady(experience, rollout, rollout.rewards))
    assert "versions" not in columns and len(rows[0]) == len(columns)
    assert version_span([]) == "" and version_span([9, 9]) == "9"
