"""The seeded arithmetic task (disjoint, reproducible, right answers) and ``lightning-grpo plot``."""

import csv

import pytest

from lightning_grpo.cli import main
from lightning_grpo.data import PromptDataModule
from lightning_grpo.data.synthetic import TEST_SIZE, arithmetic_rows, arithmetic_splits
from lightning_grpo.evaluation.plot import find_metrics_csv, plot_metrics, read_curves


@pytest.mark.parametrize("level", [1, 2, 3, 4])
def test_arithmetic_splits_are_disjoint_reproducible_and_right(level):
    rows = arithmetic_rows(250, 100, seed=3, level=level)
    assert all(r["fewshot"][1]["content"] == "12 + 7 = 19\n#### 19" for r in rows["train"][:3])
    assert rows == arithmetic_rows(250, 100, seed=3, level=level)
    assert rows != arithmetic_rows(250, 100, seed=4, level=level)
    train = {r["question"] for r in rows["train"]}
    test = {r["question"] for r in rows["test"]}
    assert len(train) == 250 and len(test) == 100 and not train & test
    for row in rows["train"][:200] + rows["test"]:
        a, op, b = row["question"].removeprefix("What is ").removesuffix("?").split()
        assert int(row["answer"]) == eval(f"{int(a)} {op} {int(b)}")  # noqa: S307 - our own digits
    with pytest.raises(ValueError, match="distinct questions"):
        arithmetic_rows(10**6, 1, level=level)


def test_arithmetic_data_module_holds_out_the_test_split():
    data = PromptDataModule("arithmetic", prompts_per_step=4, val_size=50)
    data.setup("fit")
    splits = arithmetic_splits("arithmetic", 42)
    assert len(splits["test"]) == 391 // 3 and len(splits["train"]) == 391 - 391 // 3  # 16 * 16 + 136 - 1 questions
    assert len(arithmetic_splits("arithmetic-3", 42)["test"]) == TEST_SIZE
    assert len(data.train_dataset) == len(splits["train"]) and len(data.val_dataset) == 50
    assert not set(data.train_dataset["question"]) & {r["question"] for r in splits["test"]}
    assert data.val_dataset[0]["answer"] == splits["test"][0]["answer"]
    prompt = data.train_dataset[0]["prompt"]  # system, the worked example (user, assistant), the question
    assert [m["role"] for m in prompt] == ["system", "user", "assistant", "user"]
    assert prompt[2]["content"] == "12 + 7 = 19\n#### 19"
    instruction = " Give the final answer on the last line as #### <number>."
    assert prompt[3]["content"] == data.train_dataset[0]["question"] + instruction
    assert "What is 12 + 7?" not in set(data.train_dataset["question"]) | {r["question"] for r in splits["test"]}
    with pytest.raises(ValueError, match="arithmetic-<level"):
        arithmetic_splits("arithmetic-7", 0)
    with pytest.raises(ValueError, match="level must be 1, 2, 3 or 4"):
        arithmetic_rows(1, 1, level=0)


def _write_metrics(path):
    rows = [
        {"step": 0, "reward": 0.1, "rewards/acc/mean": 0.0, "kl": "", "val/accuracy": "", "timing/step_s": 5},
        {"step": 1, "reward": 0.4, "rewards/acc/mean": 0.5, "kl": 0.01, "val/accuracy": "", "timing/step_s": 4},
        {"step": 1, "reward": "", "rewards/acc/mean": "", "kl": "", "val/accuracy": 0.3, "timing/step_s": ""},
    ]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_plot_reads_the_csv_and_writes_a_png(tmp_path, capsys):
    run = tmp_path / "logs" / "version_0"
    run.mkdir(parents=True)
    _write_metrics(run / "metrics.csv")
    curves = read_curves(run / "metrics.csv")
    assert curves["reward"] == [(0.0, 0.1), (1.0, 0.4)]
    assert curves["val/accuracy"] == [(1.0, 0.3)] and curves["kl"] == [(1.0, 0.01)]
    assert find_metrics_csv(tmp_path) == run / "metrics.csv"
    png = plot_metrics(tmp_path)
    assert png == run / "metrics.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    main(["plot", str(run / "metrics.csv"), "--out", str(tmp_path / "x.png")])
    assert capsys.readouterr().out.strip() == str(tmp_path / "x.png") and (tmp_path / "x.png").stat().st_size > 1000
    with pytest.raises(FileNotFoundError, match="no metrics.csv"):
        find_metrics_csv(tmp_path / "nothing")
