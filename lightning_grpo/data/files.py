"""Local data files (JSON lines, JSON, Parquet, CSV) read with ``datasets``, with errors that name the file, the line
and the problem.

``datasets`` itself reports an empty JSON-lines file as a bare ``StopIteration`` and a malformed line as
"Expected object or value at position 32" (a byte offset, no file); here they become
``dataset <path> has no rows`` and ``dataset <path> line <n> is not valid JSON (...)``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping, Optional, Union

import datasets

#: Suffixes of the files read line by line (or as one document) when ``datasets`` fails on them.
JSON_SUFFIXES = (".jsonl", ".json")
_EXCERPT = 80


def load_local_files(builder: str, files: Mapping[str, Union[str, Path]]) -> datasets.DatasetDict:
    """``datasets.load_dataset(builder, data_files=files)`` with one file per split.

    Args:
        builder: the ``datasets`` builder: "json", "parquet" or "csv".
        files: split name -> an existing file.

    Returns:
        The splits, each with at least one row.

    Raises:
        ValueError: a file has no rows (``dataset <path> has no rows``); a JSON file with a line that is not a JSON
            object (``dataset <path> line <n> ...``, with the JSON error and the start of the line); any other
            error of ``datasets`` (``dataset <path> could not be read: <error>``).
    """
    paths = {split: Path(path) for split, path in files.items()}
    for path in paths.values():
        if _is_blank(path):
            raise ValueError(f"dataset {path} has no rows")
    try:
        loaded = datasets.load_dataset(builder, data_files={split: str(path) for split, path in paths.items()})
    except Exception as err:  # any reading error: re-raised naming the file (and line)
        _raise_json_problem(list(paths.values()) if builder == "json" else [], err)
        raise ValueError(f"dataset {', '.join(map(str, paths.values()))} could not be read: {err}") from err
    for split, path in paths.items():
        if len(loaded[split]) == 0:
            raise ValueError(f"dataset {path} has no rows")
    return loaded


def load_local_folder(folder: Union[str, Path]) -> datasets.DatasetDict:
    """``datasets.load_dataset(folder)`` (splits from the file names).

    Raises:
        ValueError: as :func:`load_local_files`, for the JSON files in ``folder`` (searched recursively) or the
            folder as a whole; or a split with no rows.
    """
    folder = Path(folder)
    try:
        loaded = datasets.load_dataset(str(folder))
    except Exception as err:  # any reading error: re-raised naming the file (and line)
        _raise_json_problem(sorted(p for p in folder.rglob("*") if p.suffix.lower() in JSON_SUFFIXES), err)
        raise ValueError(f"dataset {folder} could not be read: {err}") from err
    for split, rows in loaded.items():
        if len(rows) == 0:
            raise ValueError(f"dataset {folder} has no rows in split {split!r}")
    return loaded


def json_problem(path: Union[str, Path]) -> Optional[str]:
    """What is wrong with a JSON-lines (or JSON) file, or None when every line parses.

    ``.jsonl``: the first non-blank line that is not valid JSON or not a JSON object. ``.json``: accepted when the
    whole file is one JSON document; otherwise read as JSON lines when its first line is an object, else the
    document's own error.

    Returns:
        ``"has no rows"``, ``"line <n> is not valid JSON (<error>, column <c>): <start of the line>"``,
        ``"line <n> is not a JSON object: ..."``, ``"is not valid JSON (<error>, line <n> column <c>)"`` or None.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    numbered = [(number, line) for number, line in enumerate(lines, start=1) if line.strip()]
    if not numbered:
        return "has no rows"
    if path.suffix.lower() == ".json":
        try:
            json.loads(text)
            return None
        except json.JSONDecodeError as err:
            if _line_problem(*numbered[0]) is not None:  # not JSON lines either: report the document's error
                return f"is not valid JSON ({err.msg}, line {err.lineno} column {err.colno})"
    for number, line in numbered:
        problem = _line_problem(number, line)
        if problem is not None:
            return problem
    return None


def _line_problem(number: int, line: str) -> Optional[str]:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as err:
        return f"line {number} is not valid JSON ({err.msg}, column {err.colno}): {line[:_EXCERPT]!r}"
    if not isinstance(value, dict):
        return f"line {number} is not a JSON object: {line[:_EXCERPT]!r}"
    return None


def _raise_json_problem(paths: list[Path], err: BaseException) -> None:
    for path in paths:
        problem = json_problem(path)
        if problem is not None:
            raise ValueError(f"dataset {path} {problem}") from err


def _is_blank(path: Path) -> bool:
    """Whether the file is empty or only whitespace (read until the first other byte)."""
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 16):
            if chunk.strip():
                return False
    return True
