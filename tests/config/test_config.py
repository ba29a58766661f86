"""Non-finite and out-of-range hyperparameters fail at construction with the field (argument) and value named."""

import dataclasses
import math
import re

import pytest

from lightning_grpo.config import EngineConfig, GRPOConfig
from lightning_grpo.module import GRPOModule
from lightning_grpo.training.optim import DTYPE_NAMES, check_optimizer_arguments

FLOAT_FIELDS = [f.name for f in dataclasses.fields(GRPOConfig) if "float" in str(f.type)]


def test_the_float_fields_are_found():
    assert {"temperature", "top_p", "advantage_eps", "reward_clip", "beta", "delta"} <= set(FLOAT_FIELDS)


@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_non_finite_float_fields_raise_naming_the_field(name, value):
    with pytest.raises(ValueError, match=f"^GRPOConfig.{name}={value!r} is invalid: must be finite$"):
        GRPOConfig(**{name: value})


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"learning_rate": math.inf}, "learning_rate=inf is invalid: must be a finite number > 0"),
        ({"learning_rate": math.nan}, "learning_rate=nan is invalid"),
        ({"learning_rate": 0.0}, "learning_rate=0.0 is invalid"),
        ({"learning_rate": -1e-6}, "learning_rate=-1e-06 is invalid"),
        ({"weight_decay": math.inf}, "weight_decay=inf is invalid: must be a finite number >= 0"),
        ({"weight_decay": math.nan}, "weight_decay=nan is invalid"),
        ({"weight_decay": -0.1}, "weight_decay=-0.1 is invalid"),
        ({"adam_betas": (0.9, math.inf)}, "adam_betas=(0.9, inf) is invalid: must be two finite numbers, each in"),
        ({"adam_betas": (math.nan, 0.99)}, "adam_betas=(nan, 0.99) is invalid"),
        ({"adam_betas": (1.0, 0.99)}, "adam_betas=(1.0, 0.99) is invalid"),
        ({"adam_betas": (-0.1, 0.99)}, "adam_betas=(-0.1, 0.99) is invalid"),
        ({"adam_betas": (0.9,)}, "adam_betas=(0.9,) is invalid"),
        ({"adam_betas": 0.9}, "adam_betas=0.9 is invalid"),
        ({"warmup_steps": -1}, "warmup_steps=-1 is invalid: must be an int >= 0"),
        ({"warmup_steps": 1.5}, "warmup_steps=1.5 is invalid"),
        ({"dtype": "float8"}, "dtype='float8' is invalid: choose one of float32, bfloat16, float16"),
    ],
)
def test_bad_optimizer_arguments_raise_naming_the_argument(kwargs, message):
    arguments = {"learning_rate": 1e-6, "weight_decay": 0.0, "adam_betas": (0.9, 0.99), "warmup_steps": 0,
                 "dtype": "float32", **kwargs}
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        check_optimizer_arguments(**arguments)


@pytest.mark.parametrize("dtype", DTYPE_NAMES)
def test_good_optimizer_arguments_pass(dtype):
    assert check_optimizer_arguments(3e-4, 0.1, [0.0, 0.999], 10, dtype) is None


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"learning_rate": math.inf}, "learning_rate=inf is invalid"),
        ({"weight_decay": math.nan}, "weight_decay=nan is invalid"),
        ({"adam_betas": (0.9, math.inf)}, "adam_betas=(0.9, inf) is invalid"),
        ({"warmup_steps": -2}, "warmup_steps=-2 is invalid"),
        ({"dtype": "int8"}, "dtype='int8' is invalid"),
    ],
)
def test_grpo_module_checks_its_optimizer_arguments(tiny_llama_path, kwargs, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        GRPOModule(tiny_llama_path, reward_funcs=["gsm8k_accuracy"], **kwargs)


def test_the_config_keeps_auto_and_validates_no_engine_name():
    """"auto" is resolved when the engine is made (tests/rollout/test_registry.py), so a YAML means the same
    hyperparameters on every machine; the name is checked against the registry when the module is built."""
    assert GRPOConfig(engine=EngineConfig(name="auto")).engine.name == "auto"
    assert GRPOConfig.from_dict({"engine": {"name": "vllm", "sync_every": 3}}).engine == EngineConfig("vllm", 3)
    with pytest.raises(ValueError, match=r"^GRPOConfig.engine=\{'name': 'vllm'\} is invalid: must be a EngineConfig"):
        GRPOConfig(engine={"name": "vllm"})
    with pytest.raises(TypeError, match="unexpected keyword argument 'rank'"):
        GRPOConfig.from_dict({"engine": {"name": "vllm", "rank": 3}})


def _budget_recorder():
    from lightning.pytorch.callbacks import Callback

    from lightning_grpo.training.packing import sequence_token_counts

    class Tokens(Callback):
        def __init__(self):
            self.micro_batches = []

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.micro_batches.append(int(sequence_token_counts(batch.prompt_mask,
                                                                batch.completion_attention_mask).sum()))

    return Tokens()


def test_a_run_resolves_its_auto_values_and_leaves_the_config_as_given(tiny_llama_path, tmp_path, monkeypatch,
                                                                      caplog):
    """``GRPOConfig`` is the run's input: after a fit with ``max_tokens_per_microbatch="auto"`` and
    ``engine.name="auto"`` (on a machine without vLLM: "hf") it equals what was given, field by field; the resolved
    values are in ``module.resolved``, in the log and beside the config in the hyperparameters (and the checkpoint),
    and the chosen budget is the one the micro-batches keep to."""
    import torch

    import lightning_grpo.rollout.engine_registry as registry
    from lightning_grpo.data import PromptDataModule
    from support.algorithm import quiet_trainer, write_prompts

    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: None)  # "auto" -> "hf"
    config = GRPOConfig(num_generations=4, max_new_tokens=8, max_prompt_length=64, max_tokens_per_microbatch="auto",
                        engine=EngineConfig(name="auto"))
    given = dataclasses.asdict(config)
    module = GRPOModule(tiny_llama_path, reward_funcs=[lambda prompts, completions, **kw: [1.0, 0.0] * 4],
                        config=config, export_dir="")
    assert module.resolved.as_dict() == {"engine_name": "hf", "kv_cache_space_gib": None, "engine_dtype": None,
                                         "max_tokens_per_microbatch": None}
    tokens = _budget_recorder()
    trainer = quiet_trainer(tmp_path, 1, callbacks=[tokens])
    with caplog.at_level("INFO", logger="lightning_grpo"):
        trainer.fit(module, datamodule=PromptDataModule(dataset=write_prompts(tmp_path / "prompts.jsonl"),
                                                        prompts_per_step=2, val_size=0))
    budget = module.resolved.max_tokens_per_microbatch
    assert isinstance(budget, int) and budget > 0 and module.token_budget == budget
    assert dataclasses.asdict(module.config) == given == dataclasses.asdict(config)
    assert module.config.max_tokens_per_microbatch == "auto" and module.config.engine.name == "auto"
    resolved = {"engine_name": "hf", "kv_cache_space_gib": None, "engine_dtype": None,  # the HF engine: no dtype
                "max_tokens_per_microbatch": budget}
    assert module.hparams["resolved"] == resolved and module.hparams["config"] == given
    assert f"resolved settings: {resolved}" in caplog.text
    assert tokens.micro_batches and all(count <= budget for count in tokens.micro_batches)
    trainer.save_checkpoint(tmp_path / "run.ckpt")
    saved = torch.load(tmp_path / "run.ckpt", weights_only=True)["hyper_parameters"]
    assert saved["resolved"] == resolved and saved["config"] == given
