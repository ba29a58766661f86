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


@pytest.mark.parametrize("fixture, tied", [("tiny_llama_path", False), ("tiny_tied_llama_path", True)])
def test_tiny_llama_fixtures(request, fixture, tied):
    path = request.getfixturevalue(fixture)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.head_dim) == (2, 64, 2, 32)
    assert (config.num_key_value_heads, config.intermediate_size, config.vocab_size) == (1, 128, 2048)
    assert len(tokenizer) == 2048
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied
    assert model.generation_config.eos_token_id == model.generation_config.pad_token_id == tokenizer.eos_token_id == 2
    smollm2_tokenizer = AutoTokenizer.from_pretrained(request.getfixturevalue("smollm2_path"))
    assert tokenizer.chat_template == smollm2_tokenizer.chat_template


def test_a_cut_tokenizer_keeps_the_first_tokens_the_specials_and_the_template(tmp_path, smollm2_path):
    """``save_tiny_tokenizer``: ids below the cut are SmolLM2's own; any text still round-trips (in more tokens, all
    below the cut); the chat template renders the same text with the same special ids."""
    from lightning_grpo.models.testing import save_tiny_tokenizer

    full = AutoTokenizer.from_pretrained(smollm2_path)
    cut = AutoTokenizer.from_pretrained(save_tiny_tokenizer(smollm2_path, tmp_path / "cut", 300))
    assert len(cut) == 300 and cut.get_vocab() == {t: i for t, i in full.get_vocab().items() if i < 300}
    specials = (cut.eos_token_id, cut.pad_token_id, cut.bos_token_id)
    assert specials == (full.eos_token_id, full.pad_token_id, full.bos_token_id) == (2, 2, 1)
    text = "Janet’s ducks lay 16 eggs per day — 🦆 #### 18"
    ids = cut(text)["input_ids"]
    assert cut.decode(ids) == text and max(ids) < 300 and len(ids) > len(full(text)["input_ids"])
    assert full.convert_ids_to_tokens(ids) == cut.convert_ids_to_tokens(ids)  # the same tokens, fewer merges
    chat = [{"role": "user", "content": "What is 7 times 6?"}]
    rendered = cut.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rendered == full.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert cut(rendered)["input_ids"][:1] == full(rendered)["input_ids"][:1] == [1]  # <|im_start|>
    with pytest.raises(ValueError, match=r"vocab_size=49152 is invalid"):
        save_tiny_tokenizer(smollm2_path, tmp_path / "whole", 49152)
    with pytest.raises(ValueError, match=r"vocab_size=100 is invalid: the first 100 ids .* byte alphabet"):
        save_tiny_tokenizer(smollm2_path, tmp_path / "too_small", 100)
