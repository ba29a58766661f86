"""LoRA through PEFT (``GRPOModule(lora=LoraConfig(...))``) on the tiny Llama, one process.

One real 2-step GRPO run (fixed completions, KL to the reference policy, checkpoints, adapter and merged export) is
shared by most tests: only adapter weights move, the optimizer holds exactly the adapters (a count worked by hand),
checkpoints hold no base weight and load back strictly, the reference policy is the base model from disk (adapters
off, no copy), the exports load with PEFT and transformers and compute the adapted model's logits. Merged weights
are checked against a hand-worked example, the LoRA options against the CLI parser, and the unsupported settings
(quantization on CPU, FSDP1, Megatron) against their error messages.
"""

from __future__ import annotations

import contextlib
import io

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_grpo import GRPOConfig, GRPOModule
from lightning_grpo.cli import GRPOCLI
from lightning_grpo.data import PromptDataModule
from lightning_grpo.models.hf_weights import hf_weights, merged_state_dict
from lightning_grpo.models.loading import load_policy
from lightning_grpo.models.lora import AdapterDisabledReference, LoraSettings, as_lora_config, check_quantized_engine
from lightning_grpo.protocols.engine import EngineCapabilities
from lightning_grpo.protocols.rollout import StopFlag
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.rollout.adapter import as_rollout_engine
from lightning_grpo.rollout.engine_registry import EngineSpec, make_engine
from lightning_grpo.rollout.engines.hf import HFRolloutEngine
from lightning_grpo.strategies import FSDP1Backend, GRPOModels
from lightning_grpo.training.experience import Experience
from support.algorithm import FixedRolloutEngine, fixed_completions, write_prompts
from support.fixtures import make_cpu_trainer, read_metrics_rows

LORA = dict(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj", "up_proj"],
            modules_to_save=["lm_head"])
#: Trainable tensors of LORA on the tiny Llama (hidden 64, 1 KV head of 32, MLP 128, 2 layers, vocabulary 2048):
#: per layer q_proj A (4x64) + B (64x4) = 512, v_proj A (4x64) + B (32x4) = 384, up_proj A (4x64) + B (128x4) = 768,
#: so 2 * 1664 = 3328, plus the trainable copy of lm_head, 2048 x 64 = 131072.
ADAPTER_PARAMS = 2 * (512 + 384 + 768) + 2048 * 64


def by_position(prompts, completions, **kwargs):
    return [[1.0, 0.0, 0.5, 0.25][i % 4] for i in range(len(completions))]


def _is_adapter(name: str) -> bool:
    return "lora_A" in name or "lora_B" in name or "modules_to_save" in name


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_llama_path):
    """A 2-step GRPO run with LoRA and beta > 0: the module, the trainer and the parameters before training."""
    root = tmp_path_factory.mktemp("lora_run")
    L.seed_everything(0, verbose=False)
    module = GRPOModule(tiny_llama_path, reward_funcs=[by_position], learning_rate=1e-2, lora=LoraConfig(**LORA),
                        config=GRPOConfig(num_generations=4, max_new_tokens=8, beta=0.1),
                        export_dir=str(root / "export"), export_merged=True)
    eos = module.tokenizer.eos_token_id
    module.rollout_engine = FixedRolloutEngine(fixed_completions([9, 3, 5, 1, 9, 2, 8, 4], 8, eos), eos)
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    trainer = L.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=str(root), num_sanity_val_steps=0,
                        callbacks=[ModelCheckpoint(dirpath=str(root / "ckpt"), save_last=True)])
    prompts = write_prompts(root / "prompts.jsonl")
    trainer.fit(module, datamodule=PromptDataModule(dataset=prompts, prompts_per_step=2, val_size=0))
    assert trainer.global_step == 2
    return {"module": module, "trainer": trainer, "before": before, "root": root}


def _experience(module: GRPOModule, seed: int = 0) -> Experience:
    generator = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(100, 1000, (4, 6), generator=generator)
    completion_ids = torch.randint(100, 1000, (4, 7), generator=generator)
    completion_mask = torch.ones(4, 7, dtype=torch.long)
    completion_mask[1, 4:] = 0
    return Experience(prompt_ids=prompt_ids, prompt_mask=torch.ones_like(prompt_ids), completion_ids=completion_ids,
                      completion_mask=completion_mask, advantages=torch.zeros(4))


def _logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    was_training = model.training
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    model.train(was_training)
    return logits


def test_a_step_changes_only_adapter_weights(run):
    module, before = run["module"], run["before"]
    trainable = {n for n, p in module.policy.named_parameters() if p.requires_grad}
    assert trainable and all(_is_adapter(n) for n in trainable)
    for name, param in module.policy.named_parameters():
        if name in trainable:
            assert not torch.equal(param, before[name]), f"adapter {name} did not move"
        else:
            assert torch.equal(param, before[name]), f"base weight {name} changed"


def test_the_optimizer_holds_exactly_the_adapters(run):
    module, trainer = run["module"], run["trainer"]
    params = [p for group in trainer.optimizers[0].param_groups for p in group["params"]]
    trainable = [p for p in module.policy.parameters() if p.requires_grad]
    assert {id(p) for p in params} == {id(p) for p in trainable}
    assert sum(p.numel() for p in params) == ADAPTER_PARAMS
    assert len(trainer.optimizers[0].state) == len(trainable)  # AdamW moments for the adapters only


def test_checkpoint_holds_only_adapters_and_loads_back_strictly(run, tiny_llama_path):
    checkpoint = torch.load(run["root"] / "ckpt" / "last.ckpt", weights_only=True)  # plain data (hparams too)
    state = checkpoint["state_dict"]
    assert len(state) == 13  # 2 layers x 3 targets x (A, B) + lm_head's trainable copy
    assert all(key.startswith("policy.") and _is_adapter(key) for key in state)
    assert checkpoint["hyper_parameters"]["lora"]["r"] == 4
    assert checkpoint["hyper_parameters"]["lora"]["target_modules"] == ["q_proj", "up_proj", "v_proj"]

    fresh = GRPOModule(tiny_llama_path, reward_funcs=[by_position], lora=LoraConfig(**LORA), export_dir="")
    fresh.load_state_dict(state)  # strict: the frozen base weights may be absent, nothing else
    trained = run["module"].state_dict()
    assert trained.keys() == state.keys()
    for key, value in state.items():
        assert torch.equal(fresh.state_dict()[key], value)
    with pytest.raises(RuntimeError, match="Missing key.*lora_B"):
        fresh.load_state_dict({k: v for k, v in state.items() if "layers.1.mlp.up_proj.lora_B" not in k})
    with pytest.raises(RuntimeError, match=r"Unexpected key.*\"policy.model.norm.weight\""):  # full fine-tuning's
        fresh.load_state_dict({**state, "policy.model.norm.weight": torch.ones(64)})
    # the stored hyperparameters (plain data) rebuild the same LoRA module
    restored = GRPOModule(tiny_llama_path, reward_funcs=[by_position], lora=checkpoint["hyper_parameters"]["lora"])
    restored.load_state_dict(state)
    assert restored.policy.peft_config["default"] == run["module"].policy.peft_config["default"]
    assert all(torch.equal(restored.state_dict()[key], value) for key, value in state.items())


def test_reference_is_the_base_model_with_adapters_off_and_no_copy(run, tiny_llama_path):
    module = run["module"]
    ref = module.ref_model
    assert isinstance(ref, AdapterDisabledReference) and ref.policy is module.policy
    assert {id(p) for p in ref.parameters()} == {id(p) for p in module.policy.parameters()}  # no second copy
    trainable = {n for n, p in module.policy.named_parameters() if p.requires_grad}
    experience = _experience(module)
    reference = module.logprobs.batched(ref, experience, micro_batch_size=2)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    expected = module.logprobs.batched(base, experience, micro_batch_size=2)
    torch.testing.assert_close(reference, expected, atol=1e-6, rtol=0)
    adapted = module.logprobs.batched(module.policy, experience, micro_batch_size=2)
    assert (adapted - expected).abs().max() > 1e-3  # the adapters are on outside the reference pass
    assert module.policy.training and {n for n, p in module.policy.named_parameters() if p.requires_grad} == trainable


def test_exports_load_with_peft_and_merged_equals_the_adapted_model(run, tiny_llama_path):
    module, export = run["module"], run["root"] / "export"
    ids = _experience(module).prompt_ids
    adapted = _logits(module.policy, ids)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_llama_path), str(export))
    torch.testing.assert_close(_logits(loaded, ids), adapted, atol=1e-6, rtol=0)
    merged = AutoModelForCausalLM.from_pretrained(str(export / "merged"))
    assert not any("lora" in name or "base_layer" in name for name in merged.state_dict())
    torch.testing.assert_close(_logits(merged, ids), adapted, atol=1e-5, rtol=0)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_path)
    assert (_logits(base, ids) - adapted).abs().max() > 1e-3


def test_gradient_checkpointing_trains_the_adapters(tiny_llama_path):
    """Non-reentrant checkpointing through frozen embeddings still reaches the adapters; with B = 0 at the start
    only B has a gradient (dL/dA = B^T dL/dh x^T = 0), every B of every targeted layer."""
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    module = GRPOModule(tiny_llama_path, lora=lora, gradient_checkpointing=True, export_dir="",
                        config=GRPOConfig(num_generations=2))
    experience = _experience(module)
    experience.advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    module.compute_loss(experience).loss.backward()
    grads = {n: p.grad for n, p in module.policy.named_parameters() if p.requires_grad}
    assert module.policy.get_base_model().is_gradient_checkpointing and len(grads) == 12
    assert all(g is not None and g.abs().max() > 0 for n, g in grads.items() if "lora_B" in n)
    assert all(g is None or g.abs().max() == 0 for n, g in grads.items() if "lora_A" in n)


def test_hf_engine_samples_from_the_adapted_model(run, tiny_llama_path):
    """The HF engine generates with the PEFT model's transformers model (LoRA layers in place, its generation config
    neutralized): its sampler logprobs are the trainer's logprobs of the adapted policy."""
    module = run["module"]
    engine = make_engine(EngineSpec(module.config, module.hf_model, module.tokenizer, lambda: tiny_llama_path,
                                    StopFlag(), "hf"))
    assert engine.model is module.policy.get_base_model() and module.hf_model is engine.model
    engine.report_logprobs = True
    torch.manual_seed(0)
    out = engine.generate([[1, 2, 3, 4], [5, 6]], 2, SamplingConfig(max_new_tokens=6, temperature=1.0))
    experience = Experience(prompt_ids=out.prompt_ids, prompt_mask=out.prompt_mask, completion_ids=out.completion_ids,
                            completion_mask=out.completion_mask, advantages=torch.zeros(4))
    trainer_logprobs = module.logprobs.batched(module.policy, experience, micro_batch_size=4)
    torch.testing.assert_close(out.sampler_logprobs, trainer_logprobs * out.completion_mask, atol=1e-5, rtol=0)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(2, 2, bias=True)
        self.head = nn.Linear(2, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(x))


def test_merged_weights_golden():
    """W0 = [[1, 2], [3, 4]], A = [[1, 1]], B = [[1], [2]], lora_alpha / r = 2: W = W0 + 2 B A = [[3, 4], [7, 8]]."""
    model = _Tiny()
    with torch.no_grad():
        model.proj.weight.copy_(torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
        model.proj.bias.copy_(torch.tensor([0.5, -0.5]))
    peft = get_peft_model(model, LoraConfig(r=1, lora_alpha=2, target_modules=["proj"], modules_to_save=["head"]))
    with torch.no_grad():
        peft.base_model.model.proj.lora_A["default"].weight.copy_(torch.tensor([[1.0, 1.0]]))
        peft.base_model.model.proj.lora_B["default"].weight.copy_(torch.tensor([[1.0], [2.0]]))
        peft.base_model.model.head.modules_to_save["default"].weight.fill_(7.0)
    merged = merged_state_dict(peft)
    assert sorted(merged) == ["head.weight", "proj.bias", "proj.weight"]
    torch.testing.assert_close(merged["proj.weight"], torch.tensor([[3.0, 4.0], [7.0, 8.0]]), atol=0, rtol=0)
    torch.testing.assert_close(merged["proj.bias"], torch.tensor([0.5, -0.5]), atol=0, rtol=0)
    assert (merged["head.weight"] == 7.0).all()  # the trained copy, not original_module
    assert dict(hf_weights(peft, tie_word_embeddings=False)).keys() == merged.keys()
    x = torch.tensor([[1.0, -2.0]])
    plain = _Tiny()
    plain.load_state_dict(merged)
    torch.testing.assert_close(plain(x), peft(x), atol=1e-6, rtol=0)
    with peft.disable_adapter():  # adapters off: the base weights are sent unchanged
        torch.testing.assert_close(dict(hf_weights(peft, False))["proj.weight"], torch.tensor([[1.0, 2.0], [3.0, 4.0]]))
    assert torch.equal(peft.base_model.model.proj.base_layer.weight, torch.tensor([[1.0, 2.0], [3.0, 4.0]]))


def test_dora_is_refused_when_merging():
    peft = get_peft_model(_Tiny(), LoraConfig(r=1, target_modules=["proj"], use_dora=True))
    with pytest.raises(NotImplementedError, match="LoRA layer .*proj.*plain LoRA on linear layers only"):
        merged_state_dict(peft)


def test_lora_block_in_yaml_reaches_the_module_through_the_cli(tmp_path, tiny_llama_path):
    path = tmp_path / "lora.yaml"
    path.write_text(
        f"model:\n  model: {tiny_llama_path}\n  reward_funcs: [gsm8k_accuracy]\n  export_merged: true\n"
        "  lora:\n    r: 4\n    lora_alpha: 8\n    lora_dropout: 0.1\n    target_modules: [q_proj, v_proj, up_proj]\n"
        "    modules_to_save: [lm_head]\n"
    )
    cli = GRPOCLI(GRPOModule, PromptDataModule, run=False,
                  args=["--config", str(path), "--model.lora.lora_alpha", "16", "--model.export_dir", ""])
    policy = cli.model.policy
    assert isinstance(policy, PeftModel)
    config = policy.peft_config["default"]
    assert (config.r, config.lora_alpha, config.lora_dropout) == (4, 16, 0.1)
    assert set(config.target_modules) == {"q_proj", "v_proj", "up_proj"} and config.task_type == "CAUSAL_LM"
    assert sum(p.numel() for p in policy.parameters() if p.requires_grad) == ADAPTER_PARAMS
    assert cli.model.hparams["lora"]["lora_alpha"] == 16 and cli.model.hparams["export_merged"] is True
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        GRPOCLI(GRPOModule, PromptDataModule, run=False, args=["--help"])
    assert "--model.lora" in out.getvalue()


def test_quantization_needs_cuda_and_lora(tiny_llama_path):
    lora = LoraConfig(**LORA)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"quantization='4bit' needs bitsandbytes on a CUDA device.*device is cpu"):
            GRPOModule(tiny_llama_path, lora=lora, quantization="4bit")
    with pytest.raises(ValueError, match="quantization='8bit' freezes a quantized base: it needs lora"):
        GRPOModule(tiny_llama_path, quantization="8bit")
    with pytest.raises(ValueError, match="quantization='3bit': choose None, '4bit' or '8bit'"):
        GRPOModule(tiny_llama_path, lora=lora, quantization="3bit")
    with pytest.raises(ValueError, match="quantization='4bit': a quantized base is not merged with its adapters; use "
                       "export_merged=False"):
        GRPOModule(tiny_llama_path, lora=lora, quantization="4bit", export_merged=True)
    class OwnWeights(FixedRolloutEngine):
        capabilities = EngineCapabilities()  # its own weights, as vLLM's engines declare

    quantized = LoraSettings(lora, quantization_config=object())  # what lora_settings returns for a quantized base
    check_quantized_engine(quantized, HFRolloutEngine(AutoModelForCausalLM.from_pretrained(tiny_llama_path),
                                                      AutoTokenizer.from_pretrained(tiny_llama_path)))
    with pytest.raises(ValueError, match="a quantized base is not merged with its adapters, so an engine with its own "
                       "weights cannot sample from it: use GRPOConfig.engine.name='hf'"):
        check_quantized_engine(quantized, as_rollout_engine(OwnWeights(torch.zeros(1, 1), 0)))
    with pytest.raises(ValueError, match="export_merged=True .* needs lora"):
        GRPOModule(tiny_llama_path, export_merged=True)
    with pytest.raises(TypeError, match="lora must be a peft.LoraConfig, a dict of its fields or None, got int"):
        GRPOModule(tiny_llama_path, lora=4)
    module = AutoModelForCausalLM.from_pretrained(tiny_llama_path)
    with pytest.raises(ValueError, match="quantization is applied when loading from a folder or hub id, not to an nn"):
        load_policy(module, tiny_llama_path, quantization_config=object())


def test_fsdp1_and_megatron_refuse_lora(tiny_llama_path):
    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama_path), LoraConfig(**LORA))
    with pytest.raises(ValueError, match=r"lora=.* not supported with Lightning's FSDP1 strategy.*grpo_fsdp2"):
        FSDP1Backend(strategy=None).configure(GRPOModels(policy, lora=True))
    pytest.importorskip("megatron.core")
    from lightning_grpo.strategies.megatron.policy import MegatronPolicy
    from lightning_grpo.strategies.megatron.strategy import MegatronStrategy

    with pytest.raises(ValueError, match=r"lora=.* not supported with MegatronStrategy"):
        MegatronPolicy.from_hf(policy)
    with pytest.raises(ValueError, match=r"lora=.* not supported with MegatronStrategy"):
        MegatronStrategy().configure(GRPOModels(policy, lora=True))


@pytest.mark.parametrize("lora, message", [
    (dict(rank=8, target_modules=["q_proj"]), r"unknown LoraConfig field\(s\) 'rank' \(did you mean 'r'\?\)"),
    (dict(r=4, lora_alpah=8, target_modules=["q_proj"]), r"'lora_alpah' \(did you mean 'lora_alpha'\?\)"),
])
def test_an_unknown_lora_key_is_an_error_not_peft_defaults(tiny_llama_path, lora, message):
    with pytest.raises(ValueError, match=message):
        GRPOModule(tiny_llama_path, reward_funcs=[by_position], lora=lora, export_dir="")
    stored = LoraSettings(as_lora_config(LORA)).hparams  # a checkpoint's stored config (peft_type, ...) loads back
    assert as_lora_config(stored).r == 4 and as_lora_config(stored).lora_alpha == 8


@pytest.mark.parametrize("lora, message", [
    (dict(r=4, target_modules=["q_proj", "v_porj"]), r"target_modules \['v_porj'\] match no module"),
    (dict(r=4, target_modules=["q_proj"], modules_to_save=["lm_haed"]),
     r"modules_to_save entry 'lm_haed' matches no module"),
])
def test_a_lora_target_that_matches_nothing_is_an_error(tiny_llama_path, lora, message):
    with pytest.raises(ValueError, match=rf"lora: {message} .* linear layers are named \[.*'v_proj'"):
        GRPOModule(tiny_llama_path, reward_funcs=[by_position], lora=lora, export_dir="")


def _train_adapters(policy: nn.Module) -> None:
    """B = 0.1 (PEFT starts B at 0, where dropout on the adapter's input has no effect)."""
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.fill_(0.1)


def test_disable_dropout_makes_the_training_forward_the_old_logprobs_forward(tiny_llama_path, caplog):
    """lora_dropout 0.5 with 2 updates per rollout: by default a warning says the first ratio is not 1 (a train-mode
    forward differs from the eval-mode old logprobs); with ``disable_dropout`` every dropout is 0 and the two
    forwards are equal, so the ratio starts at exactly 1."""
    lora = dict(r=4, lora_alpha=8, lora_dropout=0.5, target_modules=["q_proj", "v_proj"])
    ids = torch.randint(100, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    default = GRPOModule(tiny_llama_path, reward_funcs=[by_position], lora=lora, export_dir="",
                         config=GRPOConfig(num_iterations=2))
    _train_adapters(default.policy)
    default.policy.train()
    with torch.no_grad():
        assert not torch.equal(default.policy(input_ids=ids).logits, _logits(default.policy, ids))
    from lightning_grpo.models.dropout import dropout_rates, warn_dropout_with_reused_rollouts

    assert set(dropout_rates(default.policy).values()) == {0.5} and len(dropout_rates(default.policy)) == 4
    with caplog.at_level("WARNING"):
        warn_dropout_with_reused_rollouts(default.policy, 2)
    assert "4 dropout layers with p > 0" in caplog.text and "GRPOConfig.disable_dropout=True" in caplog.text
    off = GRPOModule(tiny_llama_path, reward_funcs=[by_position], lora=lora, export_dir="",
                     config=GRPOConfig(num_iterations=2, disable_dropout=True))
    assert dropout_rates(off.policy) == {}
    _train_adapters(off.policy)
    off.policy.train()
    with torch.no_grad():
        assert torch.equal(off.policy(input_ids=ids).logits, _logits(off.policy, ids))


def test_a_lora_run_with_the_hf_engine_syncs_nothing_and_times_each_part_exactly(tmp_path, tiny_llama_path,
                                                                                  monkeypatch):
    """The HF engine generates with the policy itself (``uses_policy_parameters``): a LoRA run never reads the
    weights for it (no merged view: reading them would cost 5 s on this clock) and never calls its ``sync_weights``,
    so ``timing/sync_s`` is 0.0. On a clock that only the rewards move, a plain reward that "sleeps" 2 s and a pooled
    one whose single call "sleeps" 1 s give ``timing/reward_slow_s`` 2.0, ``timing/reward_judge_s`` 1.0 and
    ``timing/scoring_s`` 3.0 (they run one after the other) on the rollout's step, and 0.0 each on the second step of
    the same rollout (``num_iterations=2``), which scored nothing; the third step's rollout, after two optimizer
    steps, pushes nothing either."""
    import time

    from lightning_grpo.rewards import pooled
    from lightning_grpo.strategies import module_weights as weights_module

    clock = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    reads, syncs = [], []
    tensors = weights_module.ModuleWeights.tensors

    def read(self):
        reads.append(1)
        clock[0] += 5.0
        return tensors(self)

    monkeypatch.setattr(weights_module.ModuleWeights, "tensors", read)
    monkeypatch.setattr(HFRolloutEngine, "sync_weights", lambda self, weights: syncs.append(weights))

    def slow(prompts, completions, **kwargs):
        clock[0] += 2.0
        return [float(i % 2) for i in range(len(completions))]

    def judge(prompts, completions, **kwargs):
        clock[0] += 1.0
        return [0.5] * len(completions)

    engines: list = []

    class Engine(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            engines.append(type(module.rollout.own_engine).__name__)

    L.seed_everything(0, verbose=False)
    module = GRPOModule(tiny_llama_path, reward_funcs=[slow, pooled(judge, chunk_size=None, name="judge")],
                        lora=LoraConfig(**LORA), export_dir="",
                        config=GRPOConfig(num_generations=2, max_new_tokens=4, num_iterations=2))
    trainer = make_cpu_trainer(tmp_path, 3, enable_checkpointing=False, num_sanity_val_steps=0, callbacks=[Engine()])
    trainer.fit(module, datamodule=PromptDataModule(dataset=write_prompts(tmp_path / "p.jsonl"), prompts_per_step=2,
                                                    val_size=0))
    rows = [{k: float(v) for k, v in row.items() if k.startswith("timing/")}
            for row in read_metrics_rows(tmp_path, where="timing/step_s")]
    assert set(engines) == {"HFRolloutEngine"} and reads == [] and syncs == []  # the third step's rollout: no sync
    keys = ("timing/sync_s", "timing/reward_slow_s", "timing/reward_judge_s", "timing/scoring_s", "timing/step_s",
            "timing/other_s")
    # steps 1 and 3 score a rollout (2 + 1 s, one after the other); step 2 trains on step 1's rollout again
    assert [tuple(row[k] for k in keys) for row in rows] == [(0.0, 2.0, 1.0, 3.0, 3.0, 0.0),
                                                              (0.0, 0.0, 0.0, 0.0, 0.0, 0.0),
                                                              (0.0, 2.0, 1.0, 3.0, 3.0, 0.0)]
