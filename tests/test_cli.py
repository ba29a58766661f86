"""The ``lightning-grpo`` CLI: every GRPOConfig field has a documented ``--model.config.*`` option, YAML config
keys are checked by the parser, and the parsed config reaches the module and the data module."""

import ast
import contextlib
import dataclasses
import inspect
import io
import re

import pytest
import torch

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


# the optimizer a run steps: `--optimizer` / `--lr_scheduler`, or the module's own AdamW arguments; each reaches the
# trained weights (golden first steps; tests/strategies/test_megatron_strategy.py: under MegatronStrategy,
# tests/strategies/test_ddp.py and test_fsdp.py: DDP, FSDP2, FSDP1) or is refused naming the option
SGD_HALVED = ["--optimizer", "torch.optim.SGD", "--optimizer.lr", "0.5",
              "--lr_scheduler", "torch.optim.lr_scheduler.ConstantLR", "--lr_scheduler.factor", "0.5"]


def test_cli_optimizer_and_lr_scheduler_step_the_trained_weights(tmp_path, tiny_llama_path):
    """SGD(lr=0.5) with ConstantLR(factor=0.5): the first step moves every weight by exactly -0.25 * its gradient."""
    from support.first_step import assert_first_step, cli_first_step

    probe, cli = cli_first_step(tiny_llama_path, tmp_path, *SGD_HALVED)
    assert type(cli.trainer.optimizers[0]) is torch.optim.SGD
    assert_first_step(probe, lambda grad: -0.25 * grad)


def test_module_adamw_arguments_step_the_trained_weights(tmp_path, tiny_llama_path):
    """GRPOModule(learning_rate=0.01): AdamW's first step (bias-corrected moments g and g^2) moves every weight by
    exactly -0.01 * g / (|g| + 1e-8)."""
    from support.first_step import assert_first_step, cli_first_step

    probe, _ = cli_first_step(tiny_llama_path, tmp_path, "--model.learning_rate", "0.01")
    assert_first_step(probe, lambda grad: -0.01 * grad / (grad.abs() + 1e-8))


@pytest.mark.parametrize("args, message", [
    (["--lr_scheduler", "torch.optim.lr_scheduler.ConstantLR"],
     r"--lr_scheduler torch.optim.lr_scheduler.ConstantLR needs --optimizer"),
    (["--optimizer", "torch.optim.SGD", "--model.learning_rate", "1e-05"],
     r"--model.learning_rate=1e-05 is an argument of GRPOModule's own AdamW, which --optimizer torch.optim.SGD "
     r"replaces"),
    (["--optimizer", "torch.optim.SGD", "--model.warmup_steps", "3"], r"--model.warmup_steps=3 is an argument"),
])
def test_cli_optimizer_options_that_would_be_ignored_are_refused(tiny_llama_path, args, message):
    with pytest.raises(ValueError, match=message):
        GRPOCLI(GRPOModule, PromptDataModule, run=False, save_config_callback=None,
                args=["--model.model", tiny_llama_path, "--model.reward_funcs", "[gsm8k_accuracy]", *args])


def test_cli_optimizer_with_a_configure_optimizers_override_is_refused(tiny_llama_path):
    from lightning_grpo.cli import use_cli_optimizer

    class OwnOptimizer(GRPOModule):
        def configure_optimizers(self):
            return torch.optim.SGD(self.trained_parameters(), lr=0.1)

    module = OwnOptimizer(tiny_llama_path, reward_funcs=["gsm8k_accuracy"], export_dir="")
    with pytest.raises(ValueError, match=r"--optimizer torch.optim.SGD and OwnOptimizer.configure_optimizers both"):
        use_cli_optimizer(module, {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1}}, None)


def test_an_optimizer_that_misses_or_outlives_the_trained_parameters_is_refused(tmp_path, tiny_llama_path):
    """An optimizer over parameters the policy does not hold (a copy's: what an optimizer built before the backend
    converted or sharded the policy holds) and one that leaves trainable parameters out fail the fit at its start."""
    import copy

    import lightning as L

    from support.first_step import write_prompts

    class Stale(GRPOModule):
        def configure_optimizers(self):
            return torch.optim.SGD(copy.deepcopy(self.policy).parameters(), lr=0.1)

    class Partial(GRPOModule):
        def configure_optimizers(self):
            return torch.optim.SGD(self.trained_parameters()[1:], lr=0.1)

    data = PromptDataModule(dataset=write_prompts(tmp_path / "p.jsonl"), prompts_per_step=2, val_size=0)
    messages = {Stale: r"configure_optimizers returned an optimizer over 21 parameters that the trained policy "
                       r"\(LlamaForCausalLM\) does not hold",
                Partial: r"1 trainable parameters of the policy are in no optimizer that configure_optimizers "
                         r"returned \(model.embed_tokens.weight\)"}
    for cls, message in messages.items():
        module = cls(tiny_llama_path, reward_funcs=["gsm8k_accuracy"], export_dir="",
                     config=GRPOConfig(num_generations=2, engine=EngineConfig(name="hf")))
        trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
        with pytest.raises(ValueError, match=message):
            trainer.fit(module, datamodule=data)


def test_the_cli_destroys_the_default_process_group_it_ends_with_unless_an_engine_still_uses_it(tmp_path):
    """``end_distributed`` after a subcommand: an initialized default group is destroyed (True); none: nothing to do
    (False); while an in-process vLLM engine is counted live (``GroupLease.built``), the group is kept (False)."""
    import torch.distributed as dist

    from lightning_grpo.cli import end_distributed
    from lightning_grpo.rollout.engines.vllm.process_groups import GroupLease, live_engines

    assert not dist.is_initialized()
    assert end_distributed() is False
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        lease = GroupLease()
        lease.built()
        assert live_engines() == 1
        assert end_distributed() is False and dist.is_initialized()
        with lease.guard():  # the engine's shutdown: the group is the caller's, so it stays
            pass
        assert live_engines() == 0 and dist.is_initialized()
        assert end_distributed() is True and not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
