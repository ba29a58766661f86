"""A thinking model behind the agent gateway, with TRL's Qwen3 chat template (it ships in TRL's wheel; here on
SmolLM2's tokenizer, which has the same ``<|im_start|>``/``<|im_end|>`` tokens): reasoning is split into
``reasoning_content`` before tool calls are parsed (verl #6424: a call written inside ``<think>`` is not returned),
``history="keep"`` keeps past reasoning exactly as sampled in one sample where the template would drop it (prime-rl
#1334's failing prefix, NeMo-RL #2821's duplicated answer), ``history="strip"`` renders as the template does and
starts a new sample where that rendering no longer extends the sampled ids."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from lightning_grpo.protocols.sampling import SamplingConfig
from support.agents import CALL, EOS, TOOLS, client, encode
from support.agents import run_agents as _run_agents

TRL_TEMPLATES = Path(pytest.importorskip("trl").__file__).parent / "chat_templates"
DECOY = '<tool_call>\n{"name": "delete_everything", "arguments": {}}\n</tool_call>'
THINK = f"<think>\nI could write {DECOY} but the calculator is what I need.\n</think>\n\n"
QWEN3_TOOL_TAIL = "\n<|im_start|>user\n<tool_response>\n56088\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def qwen3(smollm2_path):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    tokenizer.chat_template = (TRL_TEMPLATES / "qwen3.jinja").read_text()
    return tokenizer


def _turns(tokenizer):
    """The model's turns: think + a calculator call; think + the answer; a plain answer to the follow-up."""
    return [encode(tokenizer, THINK + CALL) + [EOS], encode(tokenizer, "<think>\nDone.\n</think>\n\n56088") + [EOS],
            encode(tokenizer, "4") + [EOS]]


def _agent(answers):
    """A plain ``openai`` client agent: the question with the calculator, the tool's result, then a follow-up
    question; assistant messages are sent back as clients do, without ``reasoning_content``."""

    def agent(base_url, api_key, row):
        chat = client(base_url, api_key)
        messages = [{"role": "user", "content": "What is 123 * 456?"}]
        for follow_up in ({"role": "tool", "content": "56088"}, {"role": "user", "content": "And 2 + 2?"}, None):
            answer = chat.chat.completions.create(model="m", messages=messages, tools=TOOLS)
            answers.append(answer.model_dump())
            message = answer.choices[0].message
            sent = {"role": "assistant", "content": message.content}
            if message.tool_calls:
                sent["tool_calls"] = [c.model_dump() for c in message.tool_calls]
            messages.append(sent)
            if follow_up is not None:
                if follow_up["role"] == "tool":
                    follow_up = dict(follow_up, tool_call_id=message.tool_calls[0].id)
                messages.append(follow_up)

    return agent


def run_agents(*args, **kwargs):
    return _run_agents(*args, sampling=SamplingConfig(max_new_tokens=200), max_tokens=1000, **kwargs)


def _script(tokenizer):
    turns = _turns(tokenizer)
    return lambda call, row, prompt: turns[call]


def test_reasoning_is_split_before_tool_calls_are_parsed(qwen3):
    answers: list = []
    run_agents(qwen3, _agent(answers), _script(qwen3))
    message = answers[0]["choices"][0]["message"]
    assert message["reasoning_content"] == f"I could write {DECOY} but the calculator is what I need."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["calculator"]  # not delete_everything
    assert message["content"] is None
    assert answers[1]["choices"][0]["message"]["reasoning_content"] == "Done."
    assert answers[1]["choices"][0]["message"]["content"] == "56088"


def test_keep_holds_the_sampled_reasoning_in_one_sample(qwen3):
    answers: list = []
    out, _, _ = run_agents(qwen3, _agent(answers), _script(qwen3))
    turns = _turns(qwen3)
    tool_tail = encode(qwen3, QWEN3_TOOL_TAIL)
    user_tail = encode(qwen3, "\n<|im_start|>user\nAnd 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    assert answers[1]["prompt_token_ids"] == answers[0]["prompt_token_ids"] + turns[0] + tool_tail
    assert answers[2]["prompt_token_ids"] == answers[1]["prompt_token_ids"] + turns[1] + user_tail
    assert out.completion_ids[0].tolist() == turns[0] + tool_tail + turns[1] + user_tail + turns[2]
    assert [s.calls for s in out.episodes[0].samples] == [[0, 1, 2]]
    # NeMo-RL #2821: nothing of an earlier answer is repeated in a later turn's tokens
    assert qwen3.decode(answers[2]["prompt_token_ids"]).count("I could write") == 1
    # what the template itself would render drops the first turn's reasoning: the prefix check of prime-rl #1334
    # fails on it, which "keep" never needs
    whole = [{"role": "user", "content": "What is 123 * 456?"},
             {"role": "assistant", "content": THINK + CALL},
             {"role": "tool", "content": "56088"},
             {"role": "assistant", "content": "<think>\nDone.\n</think>\n\n56088"},
             {"role": "user", "content": "And 2 + 2?"}]
    rendered = qwen3.apply_chat_template(whole, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "I could write" not in rendered


def test_strip_renders_as_the_template_and_starts_a_sample_where_it_drops_reasoning(qwen3):
    answers: list = []
    out, _, _ = run_agents(qwen3, _agent(answers), _script(qwen3), history="strip")
    turns = _turns(qwen3)
    # within the tool loop Qwen3 keeps the reasoning, and its rendering of the first turn is the sampled ids
    assert answers[1]["prompt_token_ids"] == answers[0]["prompt_token_ids"] + turns[0] + encode(qwen3,
                                                                                                QWEN3_TOOL_TAIL)
    # after a new user question it drops it: a new sample whose prompt is the template's rendering
    third = qwen3.decode(answers[2]["prompt_token_ids"])
    assert "I could write" not in third and third.endswith("And 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    samples = out.episodes[0].samples
    assert [(s.calls, s.trained) for s in samples] == [([0, 1], False), ([2], True)]
    assert out.prompt_ids[0][out.prompt_mask[0].bool()].tolist() == answers[2]["prompt_token_ids"]
    assert out.completion_ids[0].tolist() == turns[2]
