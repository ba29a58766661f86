"""Where a prompt dataset's raw splits come from: the GSM8K and MATH-500 presets (offline under the data folder, else
the hub), local JSONL / JSON / Parquet / CSV files and folders, the seeded arithmetic task, HumanEval, the shapes task
(images), or a hub id (:func:`load_splits`; :class:`~lightning_grpo.data.datamodule.PromptDataModule` formats them into
prompts)."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Optional

import datasets

from lightning_grpo.data.code_tasks import HUMANEVAL_NAME, humaneval_rows
from lightning_grpo.data.files import load_local_files, load_local_folder
from lightning_grpo.data.presets import PRESETS, Preset
from lightning_grpo.data.shapes import SHAPES_NAME, shapes_splits
from lightning_grpo.data.synthetic import SYNTHETIC_NAME, arithmetic_splits

log = logging.getLogger(__name__)

#: Environment variable naming the folder that holds the preset data (``<dir>/gsm8k/train.jsonl``, ...).
DATA_DIR_ENV = "LIGHTNING_GRPO_DATA_DIR"
#: File extensions read as local data files, with the ``datasets`` builder that reads them.
LOCAL_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}

#: The presets by their hub id (``openai/gsm8k`` gets the GSM8K preset's fields and formats).
PRESETS_BY_HUB_ID = {preset.hub_id: preset for preset in PRESETS.values()}
#: What a hub dataset id looks like (``owner/name``).
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def default_data_dirs() -> list[Path]:
    """Candidate folders for the preset data, in search order.

    ``$LIGHTNING_GRPO_DATA_DIR`` (when set), ``<cwd>/../shared/data`` and ``<repo root>/../shared/data``.
    """
    candidates = []
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        candidates.append(Path(env).expanduser())
    candidates.append(Path.cwd().parent / "shared" / "data")
    candidates.append(Path(__file__).resolve().parents[2].parent / "shared" / "data")  # <repo>/lightning_grpo/data
    unique: list[Path] = []
    for path in candidates:
        path = path.resolve()
        if path not in unique:
            unique.append(path)
    return unique


def load_preset(dataset: str, preset: Preset, data_dir: Optional[str],
                dataset_config: Optional[str]) -> datasets.DatasetDict:
    """A preset's splits: from ``data_dir`` (or the first of :func:`default_data_dirs` that holds them), else from
    the hub (only without an explicit ``data_dir``).

    Raises:
        FileNotFoundError: no offline copy (the paths tried are named) and no hub copy either.
    """
    dirs = [Path(data_dir).expanduser().resolve()] if data_dir is not None else default_data_dirs()
    tried = []
    for root in dirs:
        files = {split: root / preset.folder / name for split, name in preset.files.items()}
        tried.extend(str(path) for path in files.values())
        if all(path.is_file() for path in files.values()):
            log.info("Reading %s from %s", dataset, root / preset.folder)
            return load_local_files("json", files)
    if data_dir is not None:
        raise FileNotFoundError(f"dataset={dataset!r}: data_dir={data_dir!r} lacks {tried}")
    config = dataset_config or preset.hub_config
    log.info("No offline copy of %s (tried %s); loading %s from the hub", dataset, tried, preset.hub_id)
    try:
        return datasets.load_dataset(preset.hub_id, config)
    except Exception as err:  # offline, no network, ...
        raise FileNotFoundError(
            f"dataset={dataset!r}: no offline copy (tried {tried}; set data_dir or ${DATA_DIR_ENV}) and "
            f"the hub fallback {preset.hub_id!r} (config {config!r}) failed: {err}"
        ) from err


def load_splits(dataset: str, data_dir: Optional[str], dataset_config: Optional[str], preset: Optional[Preset],
                seed: int) -> datasets.DatasetDict:
    """The raw splits of ``dataset`` (see :class:`~lightning_grpo.data.datamodule.PromptDataModule`'s ``dataset``):
    the seeded arithmetic task, HumanEval, the shapes task, a preset, a local file or folder, or a hub id.

    Raises:
        ValueError: an unsupported file type or a name that is none of these (named).
        FileNotFoundError: a local path that does not exist; a preset without an offline or hub copy.
    """
    name = dataset
    if SYNTHETIC_NAME.fullmatch(name):
        splits = arithmetic_splits(name, seed).items()
        return datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits})
    if name == HUMANEVAL_NAME:
        return datasets.DatasetDict({"test": datasets.Dataset.from_list(humaneval_rows())})
    if SHAPES_NAME.fullmatch(name):  # the synthetic visual task (data/shapes.py)
        return datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in shapes_splits(seed).items()})
    if name in PRESETS:
        return load_preset(dataset, PRESETS[name], data_dir, dataset_config)
    path = Path(name).expanduser()
    if path.is_file():
        builder = LOCAL_BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise ValueError(
                f"dataset={name!r}: unsupported file type {path.suffix!r}; use one of {sorted(LOCAL_BUILDERS)}"
            )
        return load_local_files(builder, {"train": path.resolve()})
    if path.is_dir():
        return load_local_folder(path.resolve())
    looks_local = path.suffix.lower() in LOCAL_BUILDERS or name.startswith(("/", ".", "~"))
    if looks_local:
        raise FileNotFoundError(f"dataset={name!r}: no such file or folder (tried {str(path.resolve())!r})")
    if HUB_ID.fullmatch(name):
        config = dataset_config or (preset.hub_config if preset else None)
        log.info("Loading %s (config %s) from the hub", name, config)
        return datasets.load_dataset(name, config)
    raise ValueError(f"dataset={name!r} is not a preset ({sorted(PRESETS)}), not an existing file or folder "
                     f"(tried {str(path.resolve())!r}), and not a hub id 'owner/name'")
