"""The engine registry and the declared engine seam: names -> factories, "auto", user engines with only the core
members (adapted, and trained with end to end), and capability-driven behaviour instead of type checks."""

import pytest
import torch

import lightning_grpo.rollout.registry as registry
from lightning_grpo import EngineConfig, GRPOConfig, GRPOModule
from lightning_grpo.data import PromptDataModule
from lightning_grpo.protocols.engine import RolloutEngine
from lightning_grpo.protocols.rollout import StopFlag
from lightning_grpo.rollout.adapter import CoreEngineAdapter, as_rollout_engine
from lightning_grpo.rollout.engines.hf import HFRolloutEngine
from lightning_grpo.rollout.registry import EngineSpec, engine_names, make_engine, register_engine
from lightning_grpo.rollout.worker import RolloutWorker
from support.algorithm import FixedRolloutEngine, Recorder, fixed_completions, quiet_trainer, write_prompts
from support.engines import RecordingEngine, weights_of


class CoreOnly:
    """A user's engine with only the documented core: ``generate``, ``sync_weights`` and ``pad_token_id``. Its
    completions are fixed ids; it counts its syncs."""

    def __init__(self, completion_ids: torch.Tensor, eos_id: int) -> None:
        self._fixed = FixedRolloutEngine(completion_ids, eos_id)
        self.pad_token_id = eos_id
        self.synced = 0

    def generate(self, prompt_ids, num_generations, sampling):
        return self._fixed.generate(prompt_ids, num_generations, sampling)

    def sync_weights(self, model):
        self.synced += 1


def _reward(prompts, completions, **kwargs):
    return [[1.0, 0.0, 0.5, 0.25][i % 4] for i in range(len(completions))]


def test_built_in_names_and_unknown_names(tiny_llama_path):
    assert engine_names()[:3] == ["hf", "vllm", "vllm_server"] and engine_names()[-1] == "auto"
    with pytest.raises(ValueError, match=r"^GRPOConfig.engine.name='sglang' is invalid: choose one of hf, vllm, "
                                         r"vllm_server, auto$"):
        GRPOModule(tiny_llama_path, config=GRPOConfig(engine=EngineConfig(name="sglang")))
    with pytest.raises(ValueError, match="rollout engine name 'hf' is taken"):
        register_engine("hf", lambda spec: None)


def test_auto_is_resolved_when_the_engine_is_made(monkeypatch):
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: None)  # a machine without vLLM
    assert registry.resolve_engine_name("auto") == "hf"
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda name: object())
    assert registry.resolve_engine_name("auto") == "vllm"


def test_a_registered_engine_is_made_from_its_name(tiny_llama_path, monkeypatch):
    monkeypatch.setattr(registry, "_REGISTERED", {})
    made = []

    def factory(spec: EngineSpec) -> CoreOnly:
        made.append(spec)
        return CoreOnly(torch.zeros(1, 1, dtype=torch.long), 0)

    register_engine("mine", factory)
    assert "mine" in engine_names()
    module = GRPOModule(tiny_llama_path, config=GRPOConfig(engine=EngineConfig(name="mine")))
    module.rollout.start(module.policy, module.model_path)
    assert isinstance(module.rollout_engine, CoreEngineAdapter) and isinstance(module.rollout_engine.engine, CoreOnly)
    (spec,) = made
    assert spec.policy is module.policy and spec.model_path == tiny_llama_path and spec.stop is module.rollout.stop
    assert module.rollout.engine_version == -1  # its own weights: synced before the first rollout


def test_the_hf_engine_declares_itself(tiny_llama_path):
    module = GRPOModule(tiny_llama_path)
    engine = make_engine(EngineSpec(module.config, module.policy, module.tokenizer, tiny_llama_path, StopFlag()))
    assert isinstance(engine, HFRolloutEngine) and isinstance(engine, RolloutEngine)
    assert (engine.uses_policy_parameters, engine.seeds_per_request) == (True, False)
    assert as_rollout_engine(engine) is engine  # a full engine is not wrapped
    engine.set_lockstep(True)
    assert engine.synced_gpus is True


def test_an_engine_missing_a_core_member_is_named():
    class NoSync:
        pad_token_id = 0

        def generate(self, prompt_ids, num_generations, sampling):
            raise AssertionError

    with pytest.raises(TypeError, match="^NoSync is not a rollout engine: it lacks sync_weights "):
        as_rollout_engine(NoSync())
    with pytest.raises(TypeError, match="it lacks generate, sync_weights, pad_token_id"):
        RolloutWorker(GRPOConfig(), tokenizer=None).engine = object()


def test_a_user_engine_with_only_the_core_members_trains(tiny_llama_path, tmp_path):
    """Two optimizer steps with an engine that has only ``generate``, ``sync_weights`` and ``pad_token_id``: it is
    synced before its first rollout and after each step (its own weights), and the steps train."""
    module = GRPOModule(tiny_llama_path, reward_funcs=[_reward], export_dir="", learning_rate=1e-3,
                        config=GRPOConfig(num_generations=4, max_new_tokens=8))
    eos = module.tokenizer.eos_token_id
    user = CoreOnly(fixed_completions([9, 3, 5, 1, 9, 2, 8, 4], 8, eos), eos)
    module.rollout_engine = user
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    recorder = Recorder()
    trainer = quiet_trainer(tmp_path, 2, callbacks=[recorder])
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    trainer.fit(module, datamodule=PromptDataModule(dataset=prompts, prompts_per_step=2, val_size=0))
    assert trainer.global_step == 2 and user.synced == 2  # before rollout 1 (version -1) and rollout 2
    assert [len(b) for b in recorder.batches] == [8, 8]
    assert all(m["loss"] == m["loss"] and m["reward"] == pytest.approx(0.4375) for m in recorder.metrics)
    changed = [n for n, p in module.policy.named_parameters() if not torch.equal(p, before[n])]
    assert changed, "the policy did not train"
    # the engine was given: the module keeps it after the fit (the caller closes it)
    assert isinstance(module.rollout_engine, CoreEngineAdapter) and module.rollout_engine.engine is user


def test_the_engine_the_module_made_is_closed_when_the_fit_ends_and_made_anew_after(tiny_llama_path, tmp_path,
                                                                                   monkeypatch):
    """An engine made from ``config.engine`` lives for one fit (or validate/test): teardown closes it, so a finished
    fit holds no engine memory (nor the default process group an in-process vLLM makes); the next stage makes a new
    engine, which gets the trained weights before its first rollout."""
    monkeypatch.setattr(registry, "_REGISTERED", {})
    made = []

    def factory(spec: EngineSpec) -> RecordingEngine:
        eos = spec.tokenizer.eos_token_id
        made.append(RecordingEngine(fixed_completions([9, 3, 5, 1, 9, 2, 8, 4], 8, eos), eos))
        return made[-1]

    register_engine("mine", factory)
    module = GRPOModule(tiny_llama_path, reward_funcs=[_reward], export_dir="", learning_rate=1e-3,
                        config=GRPOConfig(num_generations=4, max_new_tokens=8, engine=EngineConfig(name="mine")))
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    quiet_trainer(tmp_path, 1).fit(module, datamodule=PromptDataModule(dataset=prompts, prompts_per_step=2,
                                                                       val_size=0))
    (first,) = made
    assert first.log[-1] == ("close",) and [e[0] for e in first.log].count("close") == 1
    assert module.rollout_engine is None
    trained = weights_of(module.policy)
    module.rollout.close()  # idempotent
    assert [e[0] for e in first.log].count("close") == 1

    quiet_trainer(tmp_path, 1, limit_val_batches=1).validate(
        module, datamodule=PromptDataModule(dataset=prompts, prompts_per_step=2, val_split="train", val_size=2,
                                   val_batch_size=2))
    second = made[1]
    assert second is not first and len(made) == 2
    kinds = [e[0] for e in second.log]
    assert kinds.index("sync") < kinds.index("generate") and second.log[kinds.index("sync")][1] == trained
    assert kinds[-1] == "close" and module.rollout_engine is None
