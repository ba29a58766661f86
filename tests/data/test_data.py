"""PromptDataModule: real GSM8K / MATH-500 rows, seeded order, local files, the prompt-length filter, errors."""

import json
import logging
import re
from pathlib import Path

import pytest
from jsonargparse import ArgumentParser
from transformers import AutoTokenizer

from lightning_grpo.data import PromptDataModule
from lightning_grpo.data import datamodule as data_module
from lightning_grpo.data.datamodule import (
    DATA_DIR_ENV,
    DEFAULT_SYSTEM_PROMPT,
    collate_prompts,
    default_data_dirs,
    gsm8k_final_answer,
)

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"  # <repo>/../shared/data
GSM8K = SHARED_DATA / "gsm8k"
MATH500 = SHARED_DATA / "math500"


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        pytest.skip(f"{path} is absent (the shared data folder is not next to the repository)")
    with path.open() as f:
        return [json.loads(line) for line in f]


def _write_jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _questions(loader, n_batches: int) -> list[str]:
    it = iter(loader)
    return [q for _ in range(n_batches) for q in next(it)["question"]]


@pytest.fixture(scope="module")
def gsm8k_rows():
    return _read_jsonl(GSM8K / "train.jsonl"), _read_jsonl(GSM8K / "test.jsonl")


@pytest.fixture(scope="module")
def gsm8k(gsm8k_rows):
    dm = PromptDataModule("gsm8k", prompts_per_step=4, val_size=50, val_batch_size=16)  # default data_dir search
    dm.setup("fit")
    return dm


# ----------------------------------------------------------------------------------------- gsm8k


def test_gsm8k_final_answer():
    assert gsm8k_final_answer("Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72") == "72"
    assert gsm8k_final_answer("...\n#### 1,200") == "1200"
    assert gsm8k_final_answer("a #### 3 then\n#### -5") == "-5"
    assert gsm8k_final_answer("...\n#### 1,5") == "1,5"  # keeps its meaning: not 15 (nor 1.5)
    assert gsm8k_final_answer("...\n#### $1,000.50") == "1000.5"
    with pytest.raises(ValueError, match="no '####'"):
        gsm8k_final_answer("The answer is 5")
    with pytest.raises(ValueError, match="nothing after"):
        gsm8k_final_answer("#### ")


def test_default_data_dirs(monkeypatch, tmp_path):
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path))
    dirs = default_data_dirs()
    assert dirs[0] == tmp_path.resolve()
    assert SHARED_DATA.resolve() in dirs  # repo-relative ../shared/data
    monkeypatch.chdir(tmp_path)  # from any working directory: <repo root>/../shared/data by the package's path
    assert SHARED_DATA.resolve() in default_data_dirs()


def test_gsm8k_sizes_and_first_row(gsm8k, gsm8k_rows):
    train_rows, test_rows = gsm8k_rows
    assert len(gsm8k.train_dataset) == len(train_rows) == 7473
    assert len(gsm8k.val_dataset) == 50
    first = gsm8k.train_dataset[0]
    assert first["answer"] == "72"  # "Natalia sold clips to 48 of her friends in April, ..."
    assert first["question"] == train_rows[0]["question"]
    assert first["solution"] == train_rows[0]["answer"]
    system, user = first["prompt"]
    assert system == {"role": "system", "content": DEFAULT_SYSTEM_PROMPT}
    assert user["role"] == "user"
    assert user["content"].startswith(train_rows[0]["question"] + "\n\n")
    assert user["content"].endswith("#### <number>")


def test_gsm8k_batch_matches_raw_rows(gsm8k, gsm8k_rows):
    raw = {row["question"]: row["answer"] for row in gsm8k_rows[0]}
    batch = next(iter(gsm8k.train_dataloader()))
    assert set(batch) == {"prompt", "answer", "question", "solution"}
    assert all(len(values) == 4 for values in batch.values())
    for question, answer, solution in zip(batch["question"], batch["answer"], batch["solution"], strict=True):
        expected = raw[question].split("####")[-1].strip().replace(",", "")
        assert answer == expected
        assert solution == raw[question]
        float(answer)  # a plain number


def test_gsm8k_commas_removed(gsm8k, gsm8k_rows):
    with_commas = [i for i, row in enumerate(gsm8k_rows[0]) if "," in row["answer"].split("####")[-1]]
    assert len(with_commas) == 79
    rows = gsm8k.train_dataset.select(with_commas[:5])
    for i, answer in zip(with_commas[:5], rows["answer"], strict=True):
        assert answer == gsm8k_rows[0][i]["answer"].split("####")[-1].strip().replace(",", "")
        assert "," not in answer and int(answer) >= 1000


def test_train_loader_drop_last_and_full_batches(gsm8k_rows):
    dm = PromptDataModule("gsm8k", data_dir=str(SHARED_DATA), prompts_per_step=1000, val_size=0)
    dm.setup("fit")
    loader = dm.train_dataloader()
    sizes = [len(batch["question"]) for batch in loader]
    assert sizes == [1000] * 7  # 7473 // 1000; the last 473 shuffled prompts wait for the next epoch
    assert dm.val_dataloader() == []


def test_seeded_order(gsm8k, gsm8k_rows):
    order = _questions(gsm8k.train_dataloader(), 3)
    same = PromptDataModule("gsm8k", prompts_per_step=4, seed=42)
    same.setup("fit")
    other = PromptDataModule("gsm8k", prompts_per_step=4, seed=43)
    other.setup("fit")
    assert _questions(same.train_dataloader(), 3) == order
    assert _questions(other.train_dataloader(), 3) != order
    assert order != [row["question"] for row in gsm8k_rows[0][:12]]  # shuffled, not file order


def test_val_loader_first_rows_in_order(gsm8k, gsm8k_rows):
    test_rows = gsm8k_rows[1]
    batches = list(gsm8k.val_dataloader())
    assert [len(b["question"]) for b in batches] == [16, 16, 16, 2]
    questions = [q for b in batches for q in b["question"]]
    answers = [a for b in batches for a in b["answer"]]
    assert questions == [row["question"] for row in test_rows[:50]]
    assert answers == [row["answer"].split("####")[-1].strip().replace(",", "") for row in test_rows[:50]]
    assert answers[0] == "18"  # Janet's ducks


# ----------------------------------------------------------------------------------------- math500


def test_math500_preset():
    rows = _read_jsonl(MATH500 / "test.jsonl")
    dm = PromptDataModule("math500", prompts_per_step=8, val_size=10, system_prompt=None)
    dm.setup("fit")
    assert len(dm.train_dataset) == 500
    assert dm.train_dataset["answer"] == [row["answer"] for row in rows]
    assert dm.train_dataset["solution"] == [row["solution"] for row in rows]
    assert dm.val_dataset["question"] == [row["problem"] for row in rows[:10]]
    first = dm.train_dataset[0]
    assert first["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)"
    assert first["level"] == 2 and first["subject"] == "Precalculus"  # other columns pass through
    (user,) = first["prompt"]  # system_prompt=None: user message only
    instruction = "\n\nSolve the problem step by step, and put the final answer in \\boxed{}."
    assert user["content"] == rows[0]["problem"] + instruction
    batch = next(iter(dm.train_dataloader()))
    assert len(batch["prompt"]) == 8 and batch["level"] and all(isinstance(v, int) for v in batch["level"])


# ----------------------------------------------------------------------------------------- local files


def test_local_jsonl(tmp_path):
    rows = [{"q": f"What is {i}+{i}?", "a": str(2 * i), "id": i} for i in range(6)]
    path = _write_jsonl(tmp_path / "tiny.jsonl", rows)
    dm = PromptDataModule(
        path, question_field="q", answer_field="a", prompts_per_step=2, instruction="Q: {question}", system_prompt="S"
    )
    dm.setup("fit")
    assert dm.val_dataset is None and dm.val_dataloader() == []  # a single file has only a "train" split
    assert dm.train_dataset["answer"] == ["0", "2", "4", "6", "8", "10"]
    assert dm.train_dataset["solution"] == dm.train_dataset["answer"]
    assert dm.train_dataset[3]["prompt"] == [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q: What is 3+3?"},
    ]
    batches = list(dm.train_dataloader())
    assert len(batches) == 3 and sorted(i for b in batches for i in b["id"]) == list(range(6))


def test_local_folder_with_splits_and_gsm8k_format(tmp_path):
    folder = tmp_path / "mydata"
    folder.mkdir()
    _write_jsonl(folder / "train.jsonl", [{"question": f"q{i}", "answer": f"work\n#### {i},000"} for i in range(4)])
    _write_jsonl(folder / "test.jsonl", [{"question": "t", "answer": "so\n#### 7"}])
    dm = PromptDataModule(str(folder), answer_format="gsm8k", prompts_per_step=4, val_size=5)
    dm.setup("fit")
    assert dm.train_dataset["answer"] == ["0", "1000", "2000", "3000"]  # "0,000" is the number 0
    assert dm.val_dataset["answer"] == ["7"] and dm.val_dataset["solution"] == ["so\n#### 7"]


def test_too_long_prompts_dropped(tmp_path, smollm2_path, caplog):
    short = [{"question": f"What is {i} times {i}?" + " Be brief." * i, "answer": str(i * i)} for i in range(6)]
    long = [{"question": "Please read carefully. " * 200 + f"What is {i}?", "answer": str(i)} for i in range(2)]
    rows = short[:3] + long[:1] + short[3:] + long[1:]
    path = _write_jsonl(tmp_path / "mixed.jsonl", rows)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    dm_all = PromptDataModule(path, prompts_per_step=1)
    dm_all.setup("fit")
    lengths = [
        len(tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True)["input_ids"])
        for p in dm_all.train_dataset["prompt"]
    ]
    short_lengths = [lengths[i] for i in (0, 1, 2, 4, 5, 6)]
    assert short_lengths == sorted(set(short_lengths))  # distinct, growing: one token less drops only the last
    limit = short_lengths[-1]  # the longest short prompt is kept (<= limit)
    assert min(lengths[3], lengths[7]) > 800 > limit
    dm = PromptDataModule(path, prompts_per_step=1, tokenizer=smollm2_path, max_prompt_length=limit)
    with caplog.at_level(logging.WARNING, logger="lightning_grpo.data.datamodule"):
        dm.setup("fit")
    assert dm.train_dataset["question"] == [row["question"] for row in short]
    assert f"Dropped 2 of 8 train prompts longer than max_prompt_length={limit}" in caplog.text
    dm_one = PromptDataModule(path, prompts_per_step=1, tokenizer=smollm2_path, max_prompt_length=limit - 1)
    dm_one.setup("fit")
    assert dm_one.train_dataset["question"] == [row["question"] for row in short[:5]]


def test_jsonargparse_signature():
    parser = ArgumentParser()
    parser.add_class_arguments(PromptDataModule, "data")
    cfg = parser.parse_args(["--data.dataset=math500", "--data.prompts_per_step=8", "--data.max_prompt_length=256",
                             "--data.tokenizer=some/tok", "--data.answer_format=raw"])
    assert cfg.data.dataset == "math500" and cfg.data.prompts_per_step == 8 and cfg.data.max_prompt_length == 256
    dm = parser.instantiate_classes(cfg).data
    assert isinstance(dm, PromptDataModule) and dm.question_field == "problem" and dm.hparams.prompts_per_step == 8


def test_collate_prompts():
    batch = collate_prompts([{"prompt": [1], "answer": "1", "level": 2}, {"prompt": [2], "answer": "2", "level": 3}])
    assert batch == {"prompt": [[1], [2]], "answer": ["1", "2"], "level": [2, 3]}


# ----------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(prompts_per_step=0), "prompts_per_step"),
        (dict(val_size=-1), "val_size"),
        (dict(val_batch_size=0), "val_batch_size"),
        (dict(num_workers=-1), "num_workers"),
        (dict(max_prompt_length=0, tokenizer="x"), "max_prompt_length"),
        (dict(max_prompt_length=128), "needs `tokenizer`"),
        (dict(instruction="Solve it."), "instruction must contain"),
        (dict(answer_format="boxed"), "answer_format"),
    ],
)
def test_bad_arguments(kwargs, field):
    with pytest.raises(ValueError, match=field):
        PromptDataModule("gsm8k", **kwargs)


def test_unknown_preset():
    with pytest.raises(ValueError, match=r"dataset='gsm9k' is not a preset \(\['gsm8k', 'math500'\]\)"):
        PromptDataModule("gsm9k").setup("fit")


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(FileNotFoundError, match="nope.jsonl") as err:
        PromptDataModule(str(missing)).setup("fit")
    assert str(missing) in str(err.value)


def test_data_dir_without_preset(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        PromptDataModule("gsm8k", data_dir=str(tmp_path)).setup("fit")
    assert str(tmp_path / "gsm8k" / "train.jsonl") in str(err.value) and "dataset='gsm8k'" in str(err.value)


def test_no_offline_copy_falls_back_to_hub(tmp_path, monkeypatch):
    """Without any offline copy the preset goes to the hub; tests run offline, so unless the hub dataset is
    already in the local datasets cache this is a FileNotFoundError naming the paths tried and the hub id."""
    monkeypatch.setattr(data_module, "default_data_dirs", lambda: [tmp_path])
    dm = PromptDataModule("gsm8k", val_size=0)
    try:
        dm.setup("fit")
    except FileNotFoundError as err:
        assert "openai/gsm8k" in str(err) and str(tmp_path / "gsm8k" / "train.jsonl") in str(err)
    else:
        assert len(dm.train_dataset) == 7473


def test_missing_columns(tmp_path):
    path = _write_jsonl(tmp_path / "cols.jsonl", [{"problem": "p", "answer": "1"}] * 4)
    message = r"question_field='question' is not a column; available columns: \['problem', 'answer'\]"
    with pytest.raises(ValueError, match=message):
        PromptDataModule(path).setup("fit")
    with pytest.raises(ValueError, match=r"answer_field='final' is not a column"):
        PromptDataModule(path, question_field="problem", answer_field="final").setup("fit")


def test_bad_rows_and_splits(tmp_path):
    rows = [{"question": "q", "answer": "42"}, {"question": "r", "answer": "x\n#### 7"}]
    path = _write_jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(ValueError, match=r"Row 0 \(answer_format='gsm8k'\).*no '####'"):
        PromptDataModule(path, answer_format="gsm8k", prompts_per_step=1).setup("fit")
    with pytest.raises(ValueError, match=r"train_split='dev' not found; available splits: \['train'\]"):
        PromptDataModule(path, train_split="dev", prompts_per_step=1).setup("fit")
    with pytest.raises(ValueError, match=r"val_split='test' not found"):
        PromptDataModule(path, val_split="test", prompts_per_step=1).setup("fit")
    with pytest.raises(ValueError, match="has 2 prompts, fewer than prompts_per_step=3"):
        PromptDataModule(path, prompts_per_step=3).setup("fit")
    empty = _write_jsonl(tmp_path / "empty_answer.jsonl", [{"question": "q", "answer": " "}])
    with pytest.raises(ValueError, match="Row 0: answer_field 'answer' is empty"):
        PromptDataModule(empty, prompts_per_step=1).setup("fit")


def test_lightning_fit_consumes_batches(gsm8k):
    """Lightning accepts dict-of-lists batches and the ``[]`` val loader; it sees the seeded order."""
    import lightning as L
    import torch

    class Recorder(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(()))
            self.seen = []

        def training_step(self, batch, batch_idx):
            self.seen.append(list(batch["question"]))
            return self.weight * 0.0

        def validation_step(self, batch, batch_idx):
            raise AssertionError("val_size=0 must skip validation")

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    dm = PromptDataModule("gsm8k", prompts_per_step=4, val_size=0)
    module = Recorder()
    trainer = L.Trainer(
        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.fit(module, datamodule=dm)
    expected = _questions(gsm8k.train_dataloader(), 2)
    assert [q for batch in module.seen for q in batch] == expected


# ----------------------------------------------------------------------------------------- unreadable local files
@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_empty_jsonl_names_the_file(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=f"^dataset {re.escape(str(path))} has no rows$"):
        PromptDataModule(str(path), prompts_per_step=1).setup("fit")


def test_empty_preset_file_names_the_file(tmp_path):
    (tmp_path / "math500").mkdir()
    (tmp_path / "math500" / "test.jsonl").write_text("")
    with pytest.raises(ValueError, match=f"^dataset {re.escape(str(tmp_path / 'math500' / 'test.jsonl'))} has no"):
        PromptDataModule("math500", data_dir=str(tmp_path)).setup("fit")


def test_malformed_jsonl_line_names_the_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    lines = ['{"question": "a", "answer": "1"}', "", '{"question": "b", "answer": 2',
             '{"question": "c", "answer": "3"}']
    path.write_text("\n".join(lines) + "\n")  # line 3 lacks its closing brace
    message = (f"dataset {re.escape(str(path))} line 3 is not valid JSON "
               r"\(Expecting ',' delimiter, column 30\): '\{\"question\": \"b\", \"answer\": 2'")
    with pytest.raises(ValueError, match=message):
        PromptDataModule(str(path), prompts_per_step=1).setup("fit")
    folder = tmp_path / "folder"
    folder.mkdir()
    _write_jsonl(folder / "train.jsonl", [{"question": "q", "answer": "1"}])
    (folder / "test.jsonl").write_text('{"question": "q", "answer": "1"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=f"dataset {re.escape(str(folder / 'test.jsonl'))} line 2 is not a JSON obj"):
        PromptDataModule(str(folder), prompts_per_step=1).setup("fit")


def test_malformed_json_document_names_the_line(tmp_path):
    path = tmp_path / "doc.json"
    path.write_text('[{"question": "a", "answer": "1"},\n {"question": "b" "answer": "2"}]\n')
    with pytest.raises(ValueError, match=r"doc.json is not valid JSON \(Expecting ',' delimiter, line 2 column 19\)"):
        PromptDataModule(str(path), prompts_per_step=1).setup("fit")
    path.write_text('[{"question": "a", "answer": "1"},\n {"question": "b", "answer": "2"}]\n')  # a valid document
    dm = PromptDataModule(str(path), prompts_per_step=1, val_size=0)
    dm.setup("fit")
    assert dm.train_dataset["answer"] == ["1", "2"]


# ----------------------------------------------------------------------------------------- few-shot


def test_gsm8k_one_shot_example_is_the_first_train_row_and_never_trained_on(gsm8k_rows):
    train_rows, _ = gsm8k_rows
    dm = PromptDataModule("gsm8k", prompts_per_step=4, val_size=3, val_batch_size=3, num_fewshot=1)
    dm.setup("fit")
    assert len(dm.train_dataset) == len(train_rows) - 1 == 7472
    assert train_rows[0]["question"] not in set(dm.train_dataset["question"])
    # Natalia: "Natalia sold 48/2 = <<48/2=24>>24 clips in May. ..." -> calculator notes removed
    shot_user, shot_assistant = dm.fewshot
    assert shot_user == {"role": "user", "content": dm.instruction.replace("{question}", train_rows[0]["question"])}
    assert shot_assistant == {"role": "assistant", "content": "Natalia sold 48/2 = 24 clips in May.\n"
                              "Natalia sold 48+24 = 72 clips altogether in April and May.\n#### 72"}
    for prompt in (dm.train_dataset[0]["prompt"], dm.val_dataset[2]["prompt"]):  # train and val prompts
        assert [m["role"] for m in prompt] == ["system", "user", "assistant", "user"]
        assert prompt[1:3] == dm.fewshot


def test_num_fewshot_errors(tmp_path):
    with pytest.raises(ValueError, match="num_fewshot"):
        PromptDataModule("gsm8k", num_fewshot=-1)
    path = _write_jsonl(tmp_path / "two.jsonl", [{"question": "q1", "answer": "1"}, {"question": "q2", "answer": "2"}])
    dm = PromptDataModule(path, prompts_per_step=1, num_fewshot=2)
    with pytest.raises(ValueError, match="num_fewshot=2 leaves no train prompts"):
        dm.setup("fit")
