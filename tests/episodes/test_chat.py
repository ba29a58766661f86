"""The chat template's turn format: each environment turn encoded once, placed after the model's EOS, so that the
episode's ids equal ``apply_chat_template`` of the whole conversation (SmolLM2's template and Qwen2.5's, which
renders tools and tool results itself); the documented fallbacks for templates without tools or a tool role."""

import copy
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from lightning_grpo.episodes import ChatFormat, HermesToolCallParser, as_tools

EOS = 2  # <|im_end|> of SmolLM2's tokenizer
TRL_TEMPLATES = Path(pytest.importorskip("trl").__file__).parent / "chat_templates"


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="module")
def qwen_tokenizer(smollm2_tokenizer):
    """SmolLM2's vocabulary (it has ChatML's special tokens) with Qwen2.5's chat template (TRL ships a copy)."""
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = (TRL_TEMPLATES / "qwen2_5.jinja").read_text()
    return tokenizer


def _chat(tokenizer, tools=("calculator",)):
    return ChatFormat(tokenizer, [EOS], [t.schema for t in as_tools(list(tools))], HermesToolCallParser())


def test_smollm2_environment_turn_ids(smollm2_tokenizer):
    chat = _chat(smollm2_tokenizer)
    assert not chat.renders_tools and chat.tool_role
    ids = chat.env_turn_ids([{"role": "tool", "name": "calculator", "content": "42"}])
    # the "\n" after the model's <|im_end|> (the separator verl PR #6921 dropped) starts the environment turn
    assert ids == [198, 1, 19324, 198, 36, 34, 2, 198, 1, 520, 9531, 198]
    assert smollm2_tokenizer.decode(ids) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    two = chat.env_turn_ids([{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}])
    assert smollm2_tokenizer.decode(two) == ("\n<|im_start|>tool\n1<|im_end|>\n<|im_start|>tool\n2<|im_end|>\n"
                                             "<|im_start|>assistant\n")


def _conversation_ids(chat, tokenizer, prompt, turns):
    """The episode's ids as the runner builds them: the prompt, each model turn's ids through its EOS (here the
    canonical encoding of its text), each environment turn's ids."""
    ids = chat.encode_prompts([prompt], 4096)[0][0]
    for role, content in turns:
        if role == "assistant":
            ids = ids + tokenizer.encode(content, add_special_tokens=False) + [EOS]
        else:
            ids = ids + chat.env_turn_ids([{"role": role, "name": "calculator", "content": content}])
    return ids


@pytest.mark.parametrize("template", ["smollm2", "qwen2_5"])
def test_concatenation_equals_the_whole_conversation(template, smollm2_tokenizer, qwen_tokenizer):
    tokenizer = smollm2_tokenizer if template == "smollm2" else qwen_tokenizer
    chat = _chat(tokenizer)
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 123 * 456?"}]
    turns = [("assistant", '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123 * 456"}}\n'
                           "</tool_call>"),
             ("tool", "56088"),
             ("assistant", '<tool_call>\n{"name": "calculator", "arguments": {"expression": "56088 + 1"}}\n'
                           "</tool_call>"),
             ("tool", "56089"),
             ("assistant", "#### 56088")]
    ours = _conversation_ids(chat, tokenizer, prompt, turns)
    messages = chat.prompt_messages(prompt) + [{"role": r, "name": "calculator", "content": c} if r == "tool"
                                               else {"role": r, "content": c} for r, c in turns]
    tools = chat.tool_schemas if chat.renders_tools else None
    whole = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=False)
    # the template ends the last assistant turn with "<|im_end|>\n": the model's turn ends at its EOS
    assert whole[len(ours):] == tokenizer.encode("\n", add_special_tokens=False)
    assert ours == whole[: len(ours)]


def test_qwen_template_renders_tools_and_tool_results(qwen_tokenizer):
    chat = _chat(qwen_tokenizer)
    assert chat.renders_tools and chat.tool_role
    prompt_text = qwen_tokenizer.decode(chat.encode_prompts([[{"role": "user", "content": "hi"}]], 4096)[0][0])
    assert '"name": "calculator"' in prompt_text and prompt_text.count("# Tools") == 1  # the template's, not ours
    turn = qwen_tokenizer.decode(chat.env_turn_ids([{"role": "tool", "name": "calculator", "content": "7"}]))
    assert turn == "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_prompt_gets_the_tools_where_the_template_has_none(smollm2_tokenizer):
    chat = _chat(smollm2_tokenizer)
    instructions = HermesToolCallParser().instructions(chat.tool_schemas)
    with_system = chat.prompt_messages([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert with_system == [{"role": "system", "content": "S\n\n" + instructions}, {"role": "user", "content": "U"}]
    without = chat.prompt_messages([{"role": "user", "content": "U"}])
    assert without == [{"role": "system", "content": instructions}, {"role": "user", "content": "U"}]
    assert _chat(smollm2_tokenizer, tools=()).prompt_messages([{"role": "user", "content": "U"}]) == [
        {"role": "user", "content": "U"}]
    with pytest.raises(TypeError, match="list of chat messages"):
        chat.encode_prompts(["a raw string"], 100)


def test_fallback_when_the_template_rejects_the_tool_role(smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('roles must "
                               "alternate') }}{% endif %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
                               "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
                               "{{ '<|im_start|>assistant\\n' }}{% endif %}")
    chat = _chat(tokenizer)
    assert not chat.tool_role
    turn = tokenizer.decode(chat.env_turn_ids([{"role": "tool", "content": "9"}]))
    assert turn == "\n<|im_start|>user\n<tool_response>\n9\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_a_template_without_eos_at_the_turn_end_is_refused(smollm2_tokenizer):
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
                               "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    with pytest.raises(ValueError, match="does not end with an EOS id"):
        _chat(tokenizer).env_turn_ids([{"role": "user", "content": "obs"}])
    no_template = copy.deepcopy(smollm2_tokenizer)
    no_template.chat_template = None
    with pytest.raises(ValueError, match="chat template"):
        _chat(no_template)
