"""encode_prompts: exactly one BOS where the model expects one, for raw strings and chat messages alike.

Tokenizers (all local, built from the SmolLM2 tokenizer files; no hub):

* ``smollm2``: SmolLM2's own (BOS ``<|im_start|>`` never added to raw text; a ChatML template);
* ``llama``: Llama style, adds BOS ``<|endoftext|>`` (id 0) to raw text, no chat template;
* ``llama_chatml``: the same with the ChatML template, which does not write BOS;
* ``llama_bos_template``: the same with a template that writes ``{{ bos_token }}`` itself;
* ``bos_template_only``: does not add BOS to raw text, but its template writes it.

Expected ids are built from two independent references: the tokenizer's bare text encoding
(``add_special_tokens=False``) and ``apply_chat_template``'s output.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from lightning_grpo.rollout.prompts import adds_bos, encode_prompts

TEXT = "Natalia sold clips to 48 of her friends. How many clips did she sell?"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
BOS_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizers(smollm2_path, tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    chatml = AutoTokenizer.from_pretrained(smollm2_path).chat_template
    built = {}
    for name, add_bos, template in [
        ("llama", True, None),
        ("llama_chatml", True, chatml),
        ("llama_bos_template", True, BOS_TEMPLATE),
        ("bos_template_only", False, BOS_TEMPLATE),
    ]:
        tokenizer = AutoTokenizer.from_pretrained(smollm2_path, add_bos_token=add_bos, bos_token="<|endoftext|>")
        tokenizer.chat_template = template
        tokenizer.save_pretrained(str(root / name))
        built[name] = AutoTokenizer.from_pretrained(str(root / name))  # as a user would load it
    built["smollm2"] = AutoTokenizer.from_pretrained(smollm2_path)
    assert [adds_bos(built[n]) for n in ("smollm2", "llama", "llama_bos_template", "bos_template_only")] == [
        False, True, True, False]
    assert built["llama"].chat_template is None and built["llama"].bos_token_id == 0
    return built


def _text(tokenizer) -> list[int]:
    return list(tokenizer(TEXT, add_special_tokens=False)["input_ids"])


def _chat(tokenizer) -> list[int]:
    return list(tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False))


# (tokenizer, prompt kind, leading BOS ids, expected ids from the references); BOS is id 0, except SmolLM2's
# <|im_start|> (id 1), which opens every ChatML turn and is never added to raw text
CASES = [
    ("smollm2", "string", 0, lambda t: _text(t)),
    ("smollm2", "messages", 1, lambda t: _chat(t)),
    ("llama", "string", 1, lambda t: [0] + _text(t)),
    ("llama_chatml", "string", 1, lambda t: [0] + _text(t)),
    ("llama_chatml", "messages", 1, lambda t: [0] + _chat(t)),  # the template writes no BOS: one is prepended
    ("llama_bos_template", "string", 1, lambda t: [0] + _text(t)),
    ("llama_bos_template", "messages", 1, lambda t: _chat(t)),  # the template's own BOS, not a second one
    ("bos_template_only", "string", 0, lambda t: _text(t)),
    ("bos_template_only", "messages", 1, lambda t: _chat(t)),
]


@pytest.mark.parametrize("name,kind,leading,expected", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_exactly_the_bos_the_model_expects(tokenizers, name, kind, leading, expected):
    tokenizer = tokenizers[name]
    prompt = TEXT if kind == "string" else MESSAGES
    (ids,), truncated = encode_prompts(tokenizer, [prompt], max_prompt_length=4096)
    assert truncated == 0
    assert ids == expected(tokenizer)
    bos = tokenizer.bos_token_id
    assert next(i for i, t in enumerate(ids) if t != bos) == leading
    if kind == "string":
        assert bos not in ids[leading:]


def test_string_and_messages_agree_on_bos(tokenizers):
    for name in ("llama_chatml", "llama_bos_template"):
        tokenizer = tokenizers[name]
        (text_ids, chat_ids), _ = encode_prompts(tokenizer, [TEXT, MESSAGES], 4096)
        assert text_ids[:2] == [0, _text(tokenizer)[0]] and chat_ids[0] == 0 and chat_ids[1] != 0


def test_a_bos_already_in_the_text_is_not_doubled(tokenizers):
    tokenizer = tokenizers["llama"]
    (ids,), _ = encode_prompts(tokenizer, ["<|endoftext|>" + TEXT], 4096)
    assert ids == [0] + _text(tokenizer)
    (ids,), _ = encode_prompts(tokenizer, ["<|endoftext|><|endoftext|>" + TEXT], 4096)
    assert ids == [0] + _text(tokenizer)
    doubled = tokenizers["llama_bos_template"]
    doubled.chat_template = "{{ bos_token }}" + BOS_TEMPLATE
    try:
        (ids,), _ = encode_prompts(doubled, [MESSAGES], 4096)
    finally:
        doubled.chat_template = BOS_TEMPLATE
    assert ids == _chat(doubled)


def test_left_truncation_keeps_the_bos(tokenizers):
    llama, smollm2 = tokenizers["llama"], tokenizers["smollm2"]
    body = _text(llama)
    (short, long), truncated = encode_prompts(llama, ["Hi", TEXT], max_prompt_length=5)
    assert truncated == 1
    assert short == [0] + _text_of(llama, "Hi") and long == [0] + body[-4:]
    (long,), truncated = encode_prompts(smollm2, [TEXT], max_prompt_length=5)
    assert truncated == 1 and long == _text(smollm2)[-5:]  # no BOS to keep: the last 5 tokens
    (chat,), _ = encode_prompts(tokenizers["llama_bos_template"], [MESSAGES], max_prompt_length=6)
    assert chat == [0] + _chat(tokenizers["llama_bos_template"])[-5:]
    (one,), _ = encode_prompts(llama, [TEXT], max_prompt_length=1)
    assert one == body[-1:]
    (exact,), truncated = encode_prompts(llama, [TEXT], max_prompt_length=len(body) + 1)
    assert truncated == 0 and exact == [0] + body


def _text_of(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_bad_prompts_get_clear_errors(tokenizers):
    with pytest.raises(ValueError, match=r"prompts\[1\] is a list of chat messages.*no chat template.*"
                                         r"tokenizer.chat_template.*raw strings"):
        encode_prompts(tokenizers["llama"], [TEXT, MESSAGES], 64)
    with pytest.raises(ValueError, match=r"prompts\[0\] is an empty list"):
        encode_prompts(tokenizers["smollm2"], [[]], 64)
    with pytest.raises(TypeError, match=r"prompts\[0\] must be a string or a list of chat messages.*int"):
        encode_prompts(tokenizers["smollm2"], [5], 64)
    with pytest.raises(ValueError, match="max_prompt_length=0"):
        encode_prompts(tokenizers["smollm2"], [TEXT], 0)
