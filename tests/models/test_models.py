"""The embedded default model: structure, tokenizer, exact equality with the GGUF it came from, a known answer."""

import json
import re
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_grpo.models import embedded as models
from lightning_grpo.models.embedded import DEFAULT_MODEL_NAME, EOS_TOKEN, default_model_path, resolve_model_path


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    model = AutoModelForCausalLM.from_pretrained(smollm2_path)  # plain folder: no gguf_file, no quantizer
    model.eval()
    return model, AutoTokenizer.from_pretrained(smollm2_path)


def test_folder_layout_and_configs(smollm2_path):
    path = Path(smollm2_path)
    assert path.name == DEFAULT_MODEL_NAME
    for name in models.REQUIRED_FILES + ("chat_template.jinja",):
        assert (path / name).is_file(), name
    config = json.loads((path / "config.json").read_text())
    generation = json.loads((path / "generation_config.json").read_text())
    assert config["tie_word_embeddings"] is True
    assert "quantization_config" not in config
    assert config["eos_token_id"] == config["pad_token_id"] == 2
    assert generation["eos_token_id"] == 2 and generation["pad_token_id"] == 2
    assert (path / "model.safetensors").stat().st_mode & 0o777 == 0o644  # readable in a shared cache
    # an interrupted or finished build leaves no temporary sibling behind
    assert not [p.name for p in path.parent.iterdir() if p.name.startswith(f".{DEFAULT_MODEL_NAME}.tmp-")]


def test_architecture_and_tokenizer(smollm2):
    model, tokenizer = smollm2
    config = model.config
    assert model.dtype == torch.float32
    assert getattr(model, "hf_quantizer", None) is None
    assert (config.num_hidden_layers, config.hidden_size) == (30, 576)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert config.vocab_size == 49152
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert tokenizer.eos_token == tokenizer.pad_token == EOS_TOKEN
    assert tokenizer.eos_token_id == tokenizer.pad_token_id == 2
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    messages = [{"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow  # dequantizes the GGUF again (~20 s) and runs the real SmolLM2-135M twice
def test_logits_equal_gguf_model(smollm2, tmp_path):
    """The saved safetensors are the GGUF's dequantized weights: identical logits, bit for bit."""
    model, tokenizer = smollm2
    gguf_model, gguf_tokenizer = models.load_gguf_model(models.locate_gguf(tmp_path))
    messages = [{"role": "user", "content": "Natalia sold clips to 48 of her friends."}]
    kwargs = dict(add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = tokenizer.apply_chat_template(messages, **kwargs)["input_ids"]
    assert torch.equal(ids, gguf_tokenizer.apply_chat_template(messages, **kwargs)["input_ids"])
    with torch.no_grad():
        logits = model(ids).logits
        gguf_logits = gguf_model(ids).logits
    assert logits.shape == (1, ids.shape[1], 49152)
    assert torch.equal(logits, gguf_logits)


def test_greedy_answer(smollm2):
    model, tokenizer = smollm2
    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=30, do_sample=False)
    text = tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "5" in text, text


def test_second_call_reuses_folder(smollm2_path):
    path = Path(smollm2_path)
    before = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    assert default_model_path(path.parent) == smollm2_path
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == before


def test_env_cache_dir_and_resolve(smollm2_path, monkeypatch):
    monkeypatch.setenv(models.CACHE_ENV, str(Path(smollm2_path).parent))
    assert default_model_path() == smollm2_path
    assert resolve_model_path(None) == smollm2_path
    assert resolve_model_path("embedded") == smollm2_path
    assert resolve_model_path(smollm2_path) == smollm2_path  # an existing folder, as is


@pytest.mark.parametrize("name", ["/some/local/folder", "./no/such/folder", "a/b/c", "bad name", "owner/x--y"])
def test_resolve_rejects_what_is_neither_a_folder_nor_a_hub_id(name):
    with pytest.raises(ValueError, match=f"model '{re.escape(name)}' is neither an existing folder nor a hub id"):
        resolve_model_path(name)


def test_resolve_hub_ids_online_and_offline(tmp_path, monkeypatch):
    hub_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    assert resolve_model_path(hub_id) == hub_id  # online: left to from_pretrained
    assert resolve_model_path("gpt2") == "gpt2"  # a hub id without an owner
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=f"model '{hub_id}' is not an existing folder.*not in the Hugging Face"):
        resolve_model_path(hub_id)
    # the same id once its config.json is in the hub cache (models--<owner>--<name>/snapshots/<commit>/)
    snapshot = tmp_path / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    assert resolve_model_path(hub_id) == hub_id


def test_cli_prints_path(smollm2_path, capsys):
    models.main(["--cache-dir", str(Path(smollm2_path).parent)])
    assert capsys.readouterr().out.strip() == smollm2_path
