"""The engine registry and the declared engine seam: names -> factories, "auto", user engines with only the core
members (adapted, and trained with end to end), and capability-driven behaviour instead of type checks."""

import pytest
import torch

import lightning_grpo.rollout.engine_registry as registry
from lightning_grpo import EngineConfig, GRPOConfig, GRPOModule
from lightning_grpo.data import PromptDataModule
from lightning_grpo.protocols.engine import EngineCapabilities, RolloutEngine
from lightning_grpo.protocols.rollout import StopFlag
from lightning_grpo.rollout.adapter import CoreEngineAdapter, as_rollout_engine
from lightning_grpo.rollout.engine_registry import EngineSpec, engine_dtype, engine_names, make_engine, register_engine
from lightning_grpo.rollout.engines.hf import HFRolloutEngine
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

    def sync_weights(self, weights):
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
    engine = module.make_rollout_engine()
    assert module.make_rollout_engine() is engine  # made once
    assert isinstance(module.rollout_engine, CoreEngineAdapter) and isinstance(module.rollout_engine.engine, CoreOnly)
    (spec,) = made
    assert spec.model is module.policy and spec.checkpoint() == tiny_llama_path and spec.stop is module.rollout.stop
    assert spec.name == "mine" and spec.resolved == {}  # nothing resolved by the factory (no KV cache to size)
    assert module.resolved.kv_cache_space_gib is None
    assert module.rollout.engine_version == -1  # its own weights: synced before the first rollout


def test_the_hf_engine_declares_itself(tiny_llama_path):
    module = GRPOModule(tiny_llama_path)
    engine = make_engine(EngineSpec(module.config, module.hf_model, module.tokenizer, lambda: tiny_llama_path,
                                    StopFlag(), "hf"))
    assert isinstance(engine, HFRolloutEngine) and isinstance(engine, RolloutEngine)
    assert engine.capabilities == EngineCapabilities(uses_policy_parameters=True, seeds_per_request=False,
                                                     sync_is_collective=False)
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


def _made_engines(monkeypatch) -> list:
    """Register the engine "mine" (a recording engine with its own weights); the list of those made."""
    monkeypatch.setattr(registry, "_REGISTERED", {})
    made = []

    def factory(spec: EngineSpec) -> RecordingEngine:
        eos = spec.tokenizer.eos_token_id
        made.append(RecordingEngine(fixed_completions([9, 3, 5, 1, 9, 2, 8, 4], 8, eos), eos))
        return made[-1]

    register_engine("mine", factory)
    return made


def _closes(engine: RecordingEngine) -> int:
    return [e[0] for e in engine.log].count("close")


def test_the_engine_the_module_made_is_closed_when_the_fit_ends_and_made_anew_after(tiny_llama_path, tmp_path,
                                                                                   monkeypatch):
    """An engine made from ``config.engine`` is closed when a fit ends, so a finished fit holds no engine memory (nor
    the default process group an in-process vLLM makes); the next stage makes a new engine, which gets the trained
    weights before its first rollout. A validation keeps its engine (for a fit that may follow) until
    ``close_rollout_engine``."""
    made = _made_engines(monkeypatch)
    module = GRPOModule(tiny_llama_path, reward_funcs=[_reward], export_dir="", learning_rate=1e-3,
                        config=GRPOConfig(num_generations=4, max_new_tokens=8, engine=EngineConfig(name="mine")))
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    quiet_trainer(tmp_path, 1).fit(module, datamodule=PromptDataModule(dataset=prompts, prompts_per_step=2,
                                                                       val_size=0))
    (first,) = made
    assert first.log[-1] == ("close",) and _closes(first) == 1
    assert module.rollout_engine is None
    trained = weights_of(module.policy)
    module.rollout.close()  # idempotent
    assert _closes(first) == 1

    quiet_trainer(tmp_path, 1, limit_val_batches=1).validate(
        module, datamodule=PromptDataModule(dataset=prompts, prompts_per_step=2, val_split="train", val_size=2,
                                   val_batch_size=2))
    second = made[1]
    assert second is not first and len(made) == 2
    kinds = [e[0] for e in second.log]
    assert kinds.index("sync") < kinds.index("generate") and second.log[kinds.index("sync")][1] == trained
    assert _closes(second) == 0 and module.rollout_engine is second  # kept for a following stage
    module.close_rollout_engine()
    assert _closes(second) == 1 and module.rollout_engine is None


def test_a_validation_before_the_fit_hands_its_engine_to_the_fit(tiny_llama_path, tmp_path, monkeypatch):
    """validate-then-fit (``lightning-grpo fit --validate_before_fit true``) makes one engine: the fit reuses the
    validation's (no second construction), and the fit's end closes it once."""
    made = _made_engines(monkeypatch)
    module = GRPOModule(tiny_llama_path, reward_funcs=[_reward], export_dir="", learning_rate=1e-3,
                        config=GRPOConfig(num_generations=4, max_new_tokens=8, engine=EngineConfig(name="mine")))
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    data = PromptDataModule(dataset=prompts, prompts_per_step=2, val_split="train", val_size=2, val_batch_size=2)
    trainer = quiet_trainer(tmp_path, 2, limit_val_batches=1)
    trainer.validate(module, datamodule=data)
    trainer.fit(module, datamodule=data)
    (engine,) = made
    assert [e[0] for e in engine.log].count("generate") == 1 + 2  # the validation's rollout, the fit's two
    assert _closes(engine) == 1 and engine.log[-1] == ("close",) and module.rollout_engine is None


def test_a_failed_fit_closes_the_engine_the_module_made(tiny_llama_path, tmp_path, monkeypatch):
    """Lightning runs no ``LightningModule.teardown`` after an exception: the module's ``on_exception`` callback
    closes the engine it made (and a given engine stays open)."""
    made = _made_engines(monkeypatch)

    def broken(prompts, completions, **kwargs):
        raise KeyError("a reward that fails")

    module = GRPOModule(tiny_llama_path, reward_funcs=[broken], export_dir="",
                        config=GRPOConfig(num_generations=4, max_new_tokens=8, engine=EngineConfig(name="mine")))
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    with pytest.raises(RuntimeError, match="reward function 'broken' raised KeyError"):
        quiet_trainer(tmp_path, 1).fit(module, datamodule=PromptDataModule(dataset=prompts, prompts_per_step=2,
                                                                           val_size=0))
    (engine,) = made
    assert _closes(engine) == 1 and module.rollout_engine is None

    given = RecordingEngine(fixed_completions([9, 3, 5, 1], 8, 2), 2)
    module.rollout_engine = given
    with pytest.raises(RuntimeError, match="reward function 'broken' raised KeyError"):
        quiet_trainer(tmp_path, 1).fit(module, datamodule=PromptDataModule(dataset=prompts, prompts_per_step=2,
                                                                           val_size=0))
    assert _closes(given) == 0 and module.rollout_engine is given and len(made) == 1


class DeclaresPolicyParameters(CoreOnly):
    """A user engine with the core members that declares it generates with the policy's own parameters (and nothing
    else): its syncs are skipped, as the HF engine's."""

    uses_policy_parameters = True


def test_a_core_only_engine_that_declares_uses_policy_parameters_trains_as_one(tiny_llama_path, tmp_path, caplog):
    """Each capability a user engine declares is honoured (the bug: the adapter answered False for every one):
    ``uses_policy_parameters=True`` means no sync before the first rollout and asynchronous rollouts are refused;
    the undeclared ones take the defaults, logged once."""
    module = GRPOModule(tiny_llama_path, reward_funcs=[_reward], export_dir="", learning_rate=1e-3,
                        config=GRPOConfig(num_generations=4, max_new_tokens=8))
    eos = module.tokenizer.eos_token_id
    user = DeclaresPolicyParameters(fixed_completions([9, 3, 5, 1, 9, 2, 8, 4], 8, eos), eos)
    with caplog.at_level("INFO", logger="lightning_grpo.rollout.adapter"):
        module.rollout_engine = user
    adapter = module.rollout_engine
    assert isinstance(adapter, CoreEngineAdapter)
    assert adapter.capabilities == EngineCapabilities(uses_policy_parameters=True, seeds_per_request=False,
                                                      sync_is_collective=False, returns_routed_experts=False)
    defaults = [r.getMessage() for r in caplog.records]
    assert defaults == ["rollout engine DeclaresPolicyParameters declares no seeds_per_request, sync_is_collective, "
                        "returns_routed_experts, accepts_images: taking seeds_per_request=False, "
                        "sync_is_collective=False, returns_routed_experts=False, accepts_images=False (RolloutEngine's "
                        "defaults)"]
    assert module.rollout.engine_version == 0  # it is the policy: nothing to push before the first rollout
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    trainer = quiet_trainer(tmp_path, 2)
    trainer.fit(module, datamodule=PromptDataModule(dataset=write_prompts(tmp_path / "prompts.jsonl"),
                                                    prompts_per_step=2, val_size=0))
    # it is the policy: its sync_weights is never called, before the first rollout or after the step (as the HF
    # engine's); an engine with its own weights is synced before each of the two rollouts
    assert trainer.global_step == 2 and user.synced == 0
    assert any(not torch.equal(p, before[n]) for n, p in module.policy.named_parameters()), "the policy did not train"
    asynchronous = GRPOModule(tiny_llama_path, config=GRPOConfig(num_generations=4, max_staleness=2))
    with pytest.raises(ValueError, match="max_staleness=2 needs a rollout engine with its own copy of the weights"):
        asynchronous.rollout_engine = DeclaresPolicyParameters(fixed_completions([9], 8, eos), eos)


def test_an_engine_declaring_every_member_is_not_wrapped_and_lifecycle_methods_are_kept():
    class Sleeper(CoreOnly):
        def __init__(self):
            super().__init__(torch.zeros(1, 1, dtype=torch.long), 0)
            self.calls = []

        def sleep(self, level=1):
            self.calls.append(("sleep", level))

        def close(self):
            self.calls.append(("close",))

    sleeper = Sleeper()
    adapter = as_rollout_engine(sleeper)
    adapter.wake_up()  # not declared: a no-op
    adapter.sleep(2)
    adapter.close()
    assert sleeper.calls == [("sleep", 2), ("close",)]
    assert isinstance(adapter, CoreEngineAdapter) and as_rollout_engine(RecordingEngine(torch.zeros(1, 1), 0)) \
        is not None


def test_a_user_engine_may_declare_its_capabilities_as_one_record_but_not_twice(caplog):
    """A user engine's ``capabilities`` record is taken as it is (nothing defaulted, nothing logged); with every
    lifecycle method too it is a full engine and is not wrapped. Declaring the record and a capability one by one is
    an error naming both."""
    class Record(CoreOnly):
        capabilities = EngineCapabilities(seeds_per_request=True, sync_is_collective=True)

    with caplog.at_level("INFO", logger="lightning_grpo.rollout.adapter"):
        adapter = as_rollout_engine(Record(torch.zeros(1, 1, dtype=torch.long), 0))
    assert isinstance(adapter, CoreEngineAdapter) and caplog.records == []
    assert adapter.capabilities == EngineCapabilities(uses_policy_parameters=False, seeds_per_request=True,
                                                      sync_is_collective=True)
    full = RecordingEngine(torch.zeros(1, 1, dtype=torch.long), 0)  # every member, its capabilities as a record
    assert as_rollout_engine(full) is full

    class Both(Record):
        uses_policy_parameters = True

    with pytest.raises(TypeError, match="^Both declares capabilities and also uses_policy_parameters: declare them in "
                                        "one place"):
        as_rollout_engine(Both(torch.zeros(1, 1, dtype=torch.long), 0))


def test_the_engine_dtype_follows_the_trainers_compute_dtype(tiny_llama_path):
    """``engine.dtype="auto"`` is the dtype the trainer computes in (issue 44): a bf16 trainer's colocated engine is
    bfloat16 (the vLLM factory records it and sizes its KV cache at 2 bytes a value); an explicit dtype stays; without
    a trainer it is the policy's; a float64 trainer has no engine dtype to follow."""
    module = GRPOModule(tiny_llama_path)

    def resolved(dtype="auto", compute=None):
        config = GRPOConfig(engine=EngineConfig(name="vllm", dtype=dtype))
        return engine_dtype(EngineSpec(config, module.hf_model, module.tokenizer, lambda: tiny_llama_path,
                                       StopFlag(), "vllm", compute_dtype=compute))

    assert resolved() == "float32" and resolved(compute=torch.bfloat16) == "bfloat16"
    assert resolved("float32", torch.bfloat16) == "float32" and resolved("bfloat16") == "bfloat16"
    with pytest.raises(ValueError, match="engine.dtype='auto' resolves to the trainer's compute dtype torch.float64"):
        resolved(compute=torch.float64)
    with pytest.raises(ValueError, match="GRPOConfig.engine.dtype='float8' is invalid"):
        EngineConfig(dtype="float8")
