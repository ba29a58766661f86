"""``lightning-grpo``: LightningCLI over GRPOModule and PromptDataModule.

    lightning-grpo fit --config recipes/gsm8k_grpo.yaml --model.config.num_generations 4 --trainer.max_steps 10
    lightning-grpo test --config recipes/eval.yaml --model.model outputs/.../hf_model     # or --ckpt_path x.ckpt
    lightning-grpo plot outputs/gsm8k_grpo                # PNG of the newest metrics.csv under the folder
    lightning-grpo serve --model PATH --port 8000         # a rollout server (engine.name="vllm_server")
    lightning-grpo health http://127.0.0.1:8000 --wait 60  # the rollout servers' /health, once they answer
    lightning-grpo launch --nodes 2 --devices-per-node 8 --servers 2 --hosts n0,n1,n2,n3 --secret-file secret \
        --config recipes/gsm8k_grpo.yaml --dry-run        # the commands of a multi-node run (--slurm: an sbatch)

``fit --validate_before_fit true`` validates once before training (the held-out "before"); every ``fit`` ends by
printing the before/after table of :mod:`lightning_grpo.evaluation.report` and the paths of the plot, the completion
table and
the checkpoint (global rank 0, with a ``CSVLogger``).

Every field of the Trainer, the module (``--model.*``, ``--model.config.*``) and the data (``--data.*``) can be
set in the YAML and overridden on the command line. ``lightning-grpo fit --help`` shows each ``--model.config.*``
field with the attribute docstring written below it in :class:`lightning_grpo.config.GRPOConfig`.

``--optimizer CLASS`` (and ``--lr_scheduler CLASS``, stepped once per optimizer step) replace the module's AdamW
(:func:`use_cli_optimizer`): built when Lightning calls ``configure_optimizers``, over the parameters the trainer's
backend trains.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import warnings
from pathlib import Path
from types import MethodType
from typing import Any, Mapping, Optional, Sequence

import torch
from jsonargparse import DefaultHelpFormatter, set_parsing_settings
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, instantiate_class
from typing_extensions import override

from lightning_grpo.config import GRPOConfig
from lightning_grpo.data import PromptDataModule
from lightning_grpo.evaluation.plot import plot_metrics
from lightning_grpo.evaluation.report import fit_report
from lightning_grpo.launch.command import launch_main
from lightning_grpo.launch.health import health_main
from lightning_grpo.models.embedded import resolve_model_path
from lightning_grpo.module import GRPOModule
from lightning_grpo.rollout.server.app import serve_main
from lightning_grpo.runtime.checkpointing import use_last_checkpoint_fallback


def _tokenizer_source(model: object, tokenizer: object) -> Optional[str]:
    """The tokenizer the data module measures prompts with: ``--model.tokenizer``, else the model's folder."""
    if isinstance(tokenizer, str):
        return tokenizer
    return resolve_model_path(model) if model is None or isinstance(model, str) else None


def _max_prompt_length(config: object) -> int:
    """``model.config.max_prompt_length`` whatever form the parser holds the config in."""
    if config is None:
        return GRPOConfig().max_prompt_length
    if isinstance(config, dict):
        return int(config.get("max_prompt_length", GRPOConfig().max_prompt_length))
    return int(getattr(config, "max_prompt_length", GRPOConfig().max_prompt_length))


#: The hyperparameters of a checkpoint that ``validate`` / ``test`` / ``predict --ckpt_path`` take: the ones that
#: define the weights (what the state dict is loaded into). Everything else (rewards, generation and evaluation
#: settings, the engine) comes from the config and command line given, which is what is being evaluated.
WEIGHT_HPARAMS = ("model", "lora", "dtype", "quantization")

#: The arguments of ``GRPOModule``'s own optimizer (AdamW with a linear warmup), which ``--optimizer`` replaces.
MODULE_OPTIMIZER_ARGUMENTS = ("learning_rate", "weight_decay", "adam_betas", "warmup_steps")


def use_cli_optimizer(module: GRPOModule, optimizer: Optional[Mapping[str, Any]],
                      lr_scheduler: Optional[Mapping[str, Any]]) -> None:
    """Make ``module.configure_optimizers`` build the CLI's ``--optimizer`` (and ``--lr_scheduler``) when Lightning
    calls it: over :meth:`GRPOModule.trained_parameters`, i.e. after the trainer's backend converted or sharded the
    policy in ``configure_model`` (LightningCLI itself builds the optimizer at once, over the parameters the module
    holds before: ``MegatronStrategy`` and FSDP2 train other ones, and the run would never change the trained
    weights). The scheduler steps once per optimizer step (``interval="step"``, as the module's warmup; a
    ``ReduceLROnPlateau`` watches its ``monitor``).

    Args:
        module: the CLI's module.
        optimizer: ``{"class_path", "init_args"}`` of ``--optimizer`` (a ``torch.optim.Optimizer``), or None.
        lr_scheduler: the same of ``--lr_scheduler``, or None.

    Raises:
        ValueError: ``--lr_scheduler`` without ``--optimizer`` (LightningCLI would drop it); with ``--optimizer``, a
            module whose class overrides ``configure_optimizers`` (two optimizers chosen), or one of the module's own
            optimizer arguments (:data:`MODULE_OPTIMIZER_ARGUMENTS`) set to other than its default (it would be
            ignored): each names the option and its value.
    """
    if not optimizer:
        if lr_scheduler:
            raise ValueError(
                f"--lr_scheduler {lr_scheduler['class_path']} needs --optimizer: the CLI schedules the optimizer it "
                "builds, and GRPOModule's own AdamW has its own schedule (--model.warmup_steps); give --optimizer "
                "(e.g. --optimizer torch.optim.AdamW --optimizer.lr 1e-6) or drop --lr_scheduler")
        return
    name = optimizer["class_path"]
    if type(module).configure_optimizers is not GRPOModule.configure_optimizers:
        raise ValueError(f"--optimizer {name} and {type(module).__name__}.configure_optimizers both choose the "
                         "optimizer: drop --optimizer, or the configure_optimizers override")
    defaults = inspect.signature(GRPOModule.__init__).parameters
    for argument in MODULE_OPTIMIZER_ARGUMENTS:
        default, value = defaults[argument].default, module.hparams.get(argument, defaults[argument].default)
        if (tuple(value) if isinstance(value, (list, tuple)) else value) != default:
            raise ValueError(
                f"--model.{argument}={value!r} is an argument of GRPOModule's own AdamW, which --optimizer {name} "
                f"replaces, so it would be ignored: set the optimizer's own options (--optimizer.lr, "
                f"--optimizer.weight_decay, ...; a schedule with --lr_scheduler) and leave model.{argument} at its "
                f"default ({default!r})")

    def configure_optimizers(self: GRPOModule) -> Any:
        built = instantiate_class(self.trained_parameters(), optimizer)
        if not lr_scheduler:
            return built
        scheduler = instantiate_class(built, lr_scheduler)
        chosen = LightningCLI.configure_optimizers(self, built, scheduler)  # with a ReduceLROnPlateau's monitor
        config = chosen["lr_scheduler"] if isinstance(chosen, dict) else {"scheduler": scheduler}
        return {"optimizer": built, "lr_scheduler": {**config, "interval": "step"}}

    module.configure_optimizers = MethodType(configure_optimizers, module)  # type: ignore[method-assign]


class GRPOCLI(LightningCLI):
    """LightningCLI with the GRPO module and prompt data module as the defaults.

    ``--ckpt_path``: Lightning applies the checkpoint's hyperparameters over the parsed config. ``reward_weights`` is
    never taken from the checkpoint (it belongs with ``reward_funcs``, which checkpoints do not hold: a checkpoint of
    two weighted rewards evaluated with one reward would otherwise fail); ``validate``, ``test`` and ``predict`` take
    only :data:`WEIGHT_HPARAMS`, so ``--config recipes/eval.yaml`` evaluates with its own settings. ``resolved``
    (what the run made of the config's "auto" values) is a record, not an argument: it is left out.
    """

    @override
    def _parse_ckpt_path(self) -> None:
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if not ckpt_path or not Path(ckpt_path).is_file():
            return  # "last"/"best" and missing files are Lightning's to resolve later
        hparams = torch.load(ckpt_path, weights_only=True, map_location="cpu", mmap=True).get("hyper_parameters", {})
        if "_class_path" in hparams:  # a subclass of the module: Lightning's own handling
            super()._parse_ckpt_path()
            return
        # "resolved" records what a run made of the config's "auto" values (lifecycle), not an argument of the module
        hparams = {k: v for k, v in hparams.items() if k not in ("_instantiator", "reward_weights", "resolved")}
        if subcommand != "fit":
            hparams = {k: v for k, v in hparams.items() if k in WEIGHT_HPARAMS}
        if hparams:
            try:
                self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)
            except SystemExit:
                sys.stderr.write("Parsing of ckpt_path hyperparameters failed!\n")
                raise

    @override
    def _add_configure_optimizers_method_to_model(self, subcommand: Optional[str]) -> None:
        """``--optimizer`` / ``--lr_scheduler``, built when Lightning calls ``configure_optimizers``
        (:func:`use_cli_optimizer`; Lightning's own builds them here, before the backend converts or shards the
        policy)."""
        if self.auto_configure_optimizers:
            use_cli_optimizer(self.model, self._get(self.config_init, "optimizer"),
                              self._get(self.config_init, "lr_scheduler"))

    @override
    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        # GRPOConfig documents each field by the string below it (as litgpt does); jsonargparse reads those only
        # with attribute docstrings on, which must be set before the model's arguments are added to the parser.
        set_parsing_settings(docstring_parse_attribute_docstrings=True)
        # the parser builds model.lora's default LoftQConfig, which peft.LoraConfig then warns that it ignores
        warnings.filterwarnings("ignore", message="`loftq_config` specified but will be ignored", category=UserWarning)
        return super().init_parser(**kwargs)

    @override
    def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001 - jsonargparse parser
        # the data module drops over-long prompts, measured with the policy's tokenizer and the same limit
        parser.link_arguments("model.config", "data.max_prompt_length", compute_fn=_max_prompt_length)
        parser.link_arguments(("model.model", "model.tokenizer"), "data.tokenizer", compute_fn=_tokenizer_source)
        parser.add_argument("--validate_before_fit", type=bool, default=False,
                            help="fit: run the validation once before training (the held-out 'before' score); "
                                 "skipped when resuming (--ckpt_path)")

    def before_fit(self) -> None:
        use_last_checkpoint_fallback(self.trainer)
        config = self.config.get(self.subcommand, {})
        if config.get("validate_before_fit") and not config.get("ckpt_path"):  # a resumed run had its "before"
            self.trainer.validate(self.model, datamodule=self.datamodule)

    def before_validate(self) -> None:
        use_last_checkpoint_fallback(self.trainer)

    def after_validate(self) -> None:
        self.model.close_rollout_engine()  # a validation keeps its engine for a following fit: none follows here

    def before_test(self) -> None:
        use_last_checkpoint_fallback(self.trainer)

    def after_test(self) -> None:
        self.model.close_rollout_engine()

    def after_fit(self) -> None:
        report = fit_report(self.trainer)
        if report:
            print(report)


def plot_main(args: Sequence[str]) -> None:
    """``lightning-grpo plot <metrics.csv or log dir> [--out PNG] [--title T]``: prints the PNG's path."""
    parser = argparse.ArgumentParser(prog="lightning-grpo plot", description=plot_metrics.__doc__)
    parser.add_argument("path", help="a metrics.csv, or a folder (the newest metrics.csv under it)")
    parser.add_argument("--out", default=None, help="the PNG (default: metrics.png next to the CSV)")
    parser.add_argument("--title", default=None)
    parsed = parser.parse_args(list(args))
    print(plot_metrics(parsed.path, parsed.out, parsed.title))


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, DefaultHelpFormatter):
    """jsonargparse's help, with the description's line breaks kept."""


#: The top-level help's description: Lightning's subcommands and ours.
DESCRIPTION = """GRPO training of language models with PyTorch Lightning (lightning-grpo).

subcommands:
  fit, validate, test, predict   Lightning's (lightning-grpo fit --help lists every option)
  serve                          a vLLM rollout server (lightning-grpo serve --help)
  health                         rollout servers' /health, waiting until they answer (lightning-grpo health --help)
  launch                         the commands of a multi-node run, or its sbatch (lightning-grpo launch --help)
  plot                           a PNG of a run's metrics.csv (lightning-grpo plot --help)
"""


def main(args: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if args is None else args)
    if argv[:1] == ["plot"]:
        plot_main(argv[1:])
        return
    if argv[:1] == ["serve"]:
        serve_main(argv[1:])
        return
    if argv[:1] == ["health"]:
        health_main(argv[1:])
        return
    if argv[:1] == ["launch"]:
        launch_main(argv[1:])
        return
    GRPOCLI(
        GRPOModule,
        PromptDataModule,
        args=args,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"description": DESCRIPTION, "formatter_class": _HelpFormatter},
    )
    end_distributed()


def end_distributed() -> bool:
    """After a Lightning subcommand: destroy the default process group (and every group made from it) when one is
    initialized and no in-process vLLM engine still samples with it (``process_groups.live_engines``: the CLI's
    ``after_*`` hooks close the engines the module made). Left to the interpreter's teardown, a rank of a torchrun
    launch was seen to abort at exit ("terminate called without an active exception", SIGABRT) after a finished fit:
    its launcher then reports a failed run and the other nodes wait out torchelastic's 300 s exit barrier. Returns
    whether it destroyed the group."""
    import torch.distributed as dist

    from lightning_grpo.rollout.engines.vllm.process_groups import live_engines

    if not (dist.is_available() and dist.is_initialized()) or live_engines() > 0:
        return False
    dist.destroy_process_group()
    return True


if __name__ == "__main__":
    main()
