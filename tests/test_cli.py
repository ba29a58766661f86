"""The ``lightning-grpo`` CLI: every GRPOConfig field has a documented ``--model.config.*`` option, YAML config
keys are checked by the parser, and the parsed config reaches the module and the data module."""

import ast
import contextlib
import dataclasses
import inspect
import io
import re

import pytest

from lightning_grpo.cli import GRPOCLI, main
from lightning_grpo.config import (
    CorrectionConfig,
    DistillationConfig,
    EngineConfig,
    EpisodeConfig,
    EvalConfig,
    GRPOConfig,
    StreamingConfig,
)
from lightning_grpo.data import PromptDataModule
from lightning_grpo.module import GRPOModule

#: The config groups: flag prefix -> dataclass (the nested groups are fields of GRPOConfig).
GROUPS = {"": GRPOConfig, "engine.": EngineConfig, "eval.": EvalConfig, "episode.": EpisodeConfig,
          "correction.": CorrectionConfig, "distillation.": DistillationConfig, "streaming.": StreamingConfig}


def _field_docstrings(cls: type = GRPOConfig) -> dict[str, str]:
    """The string written below each field of ``cls``, read from the source (independently of jsonargparse)."""
    tree = ast.parse(inspect.getsource(inspect.getmodule(cls)))
    body = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == cls.__name__).body
    docs = {}
    for statement, following in zip(body, body[1:], strict=False):
        if (isinstance(statement, ast.AnnAssign) and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant) and isinstance(following.value.value, str)):
            docs[statement.target.id] = following.value.value
    return docs


def _run(args: list[str]) -> tuple[int, str, str]:
    """``lightning-grpo <args>`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_info:
        main(args)
    return exit_info.value.code, out.getvalue(), err.getvalue()


def _squeeze(text: str) -> str:
    return re.sub(r"\s+", "", text)  # help text is wrapped (also after hyphens) at the terminal width


def test_every_config_field_has_a_docstring():
    for cls in GROUPS.values():
        docs = _field_docstrings(cls)
        missing = [f.name for f in dataclasses.fields(cls) if not docs.get(f.name, "").strip()]
        assert not missing, f"{cls.__name__} fields without a docstring below them: {missing}"


def test_fit_help_shows_every_config_field_with_its_docstring():
    code, out, _ = _run(["fit", "--help"])
    assert code == 0
    for prefix, cls in GROUPS.items():
        docs = _field_docstrings(cls)
        for field in dataclasses.fields(cls):
            if f"{field.name}." in GROUPS:
                continue  # a group: its fields are checked one by one
            flag = re.escape(f"--model.config.{prefix}{field.name}")
            entry = re.search(rf"^\s+{flag}\s(.*?)(?=^\s+--|\Z)", out, re.MULTILINE | re.DOTALL)
            assert entry is not None, f"{flag} has no help entry"
            first_words = " ".join(docs[field.name].split()[:6])
            assert _squeeze(first_words) in _squeeze(entry.group(1)), (field.name, first_words, entry.group(1))
    # one example in full: the help of num_generations, its type and default
    assert "G, completions sampled per prompt (a \"group\"); >= 2, group statistics need two. (type: int, default: 8)" \
        in " ".join(out.split())


def test_misspelled_config_key_in_yaml_is_a_parser_error(tmp_path, tiny_llama_path):
    path = tmp_path / "typo.yaml"
    path.write_text(f"model:\n  model: {tiny_llama_path}\n  config:\n    num_generation: 4\n")
    code, _, err = _run(["fit", "--config", str(path)])
    assert code == 2
    assert "does not accept option 'model.config.num_generation'" in err
    assert "Traceback" not in err


def test_yaml_and_command_line_config_reach_the_module_and_the_data(tmp_path, tiny_llama_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        f"model:\n  model: {tiny_llama_path}\n  reward_funcs: [gsm8k_accuracy]\n"
        "  config:\n    num_generations: 4\n    max_prompt_length: 96\n    loss_type: dr_grpo\n"
    )
    cli = GRPOCLI(GRPOModule, PromptDataModule, run=False,
                  args=["--config", str(path), "--model.config.temperature", "0.5", "--model.export_dir", ""])
    assert cli.model.config == GRPOConfig(num_generations=4, max_prompt_length=96, loss_type="dr_grpo",
                                          temperature=0.5)
    assert cli.datamodule.max_prompt_length == 96 and cli.datamodule.tokenizer == tiny_llama_path  # the links
    assert cli.model.hparams["config"]["num_generations"] == 4


def test_python_callers_may_still_pass_the_config_as_a_dict(tiny_llama_path):
    module = GRPOModule(tiny_llama_path, reward_funcs=["gsm8k_accuracy"], config={"num_generations": 3})
    assert module.config == GRPOConfig(num_generations=3)
    default = GRPOModule(tiny_llama_path, reward_funcs=["gsm8k_accuracy"])
    assert default.config == GRPOConfig()


def test_top_level_help_names_every_subcommand():
    code, out, _ = _run(["--help"])
    assert code == 0
    for subcommand in ("fit", "validate", "test", "serve", "health", "launch", "plot"):
        assert re.search(rf"^\s+{subcommand}\b|[ ,]{subcommand}[ ,]", out, re.MULTILINE), (subcommand, out[:600])
    for subcommand in ("serve", "health", "launch", "plot"):
        assert f"lightning-grpo {subcommand} --help" in out
