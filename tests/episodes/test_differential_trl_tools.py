"""Differential test: our tool loop against TRL 1.16's ``GRPOTrainer._tool_call_loop`` on the same episodes.

A real ``GRPOTrainer(tools=[calculator])`` (a 2-layer random Llama with SmolLM2's vocabulary and Qwen2.5's chat
template, which TRL's response parser knows) runs its own ``_generate_and_score_completions`` -> ``_generate`` ->
``_tokenize_prompts`` (the prompt with the tools) -> ``parse_response`` -> tool calls -> ``_get_tool_suffix_ids``
-> the next turn; only the generation backend (``_generate_single_turn``) is supplied, by the same script that
drives our :class:`EpisodeRunner`: each model turn is a function of the conversation so far (which question, how
many tool results). The prompt ids, the completion ids (model and tool tokens) and the tool mask must be equal,
token for token.

Not compared: failing tool calls (TRL writes ``str({"error": ...})``, we write JSON) and the turn limit (TRL stops
before running the tools of its last allowed turn, we run them and drop their result).
"""

import functools
from pathlib import Path

import pytest

trl = pytest.importorskip("trl", reason="trl is not installed: pip install -e '.[test]' (pins trl==1.16.0)")
if not trl.__version__.startswith("1.16."):
    pytest.skip(f"these tests pin TRL's 1.16 code; trl {trl.__version__} is installed", allow_module_level=True)

from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from trl import GRPOConfig as TRLConfig  # noqa: E402
from trl import GRPOTrainer  # noqa: E402

from lightning_grpo.episodes import (  # noqa: E402
    ChatFormat,
    EpisodeRunner,
    HermesToolCallParser,
    ToolEnvironment,
    as_tools,
    calculator,
)
from lightning_grpo.protocols.sampler import EncodedPrompts  # noqa: E402
from lightning_grpo.protocols.sampling import SamplingConfig  # noqa: E402
from support.episodes import ScriptedEngine  # noqa: E402

EOS = 2
QUESTIONS = ["What is 123 * 456?", "Say 7.", "What is (2 + 2) * 5?"]
#: question -> the model's turns, one per tool result seen so far
SCRIPTS = {
    QUESTIONS[0]: ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "123 * 456"}}\n</tool_call>',
                   "123 * 456 = 56088\n#### 56088"],
    QUESTIONS[1]: ["#### 7"],
    QUESTIONS[2]: ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 2"}}\n</tool_call>',
                   'Now times 5.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "4 * 5"}}\n'
                   "</tool_call>",
                   "#### 20"],
}


def next_turn(tokenizer, prefix: list[int]) -> list[int]:
    """The scripted model: its next turn after the conversation ``prefix`` (ids), through its EOS."""
    text = tokenizer.decode(prefix)
    question = next(q for q in QUESTIONS if q in text)
    return tokenizer.encode(SCRIPTS[question][text.count("<tool_response>")], add_special_tokens=False) + [EOS]


@pytest.fixture(scope="module")
def qwen_tokenizer(tiny_llama_full_vocab_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_full_vocab_path)
    tokenizer.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    return tokenizer


def trl_episodes(path, tokenizer, tmp_path, prompts):
    args = TRLConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to=[], save_strategy="no",
                     per_device_train_batch_size=len(prompts), num_generations=2, max_completion_length=256)
    trainer = GRPOTrainer(model=path, reward_funcs=[lambda prompts, completions, **kw: [0.0] * len(prompts)],
                          args=args, processing_class=tokenizer, train_dataset=Dataset.from_dict({"prompt": prompts}),
                          tools=[calculator])
    calls = []

    def scripted(prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        calls.append(len(prompt_ids))
        return [next_turn(tokenizer, list(p)) for p in prompt_ids], None

    trainer._generate_single_turn = scripted
    trainer.model.train()
    out = trainer._generate_and_score_completions([{"prompt": p} for p in prompts])
    prompt_ids = [ids[mask.bool()].tolist() for ids, mask in zip(out["prompt_ids"], out["prompt_mask"], strict=True)]
    lengths = out["completion_mask"].sum(dim=1).tolist()
    completion_ids = [ids[:n].tolist() for ids, n in zip(out["completion_ids"], lengths, strict=True)]
    tool_mask = [mask[:n].tolist() for mask, n in zip(out["tool_mask"], lengths, strict=True)]
    return prompt_ids, completion_ids, tool_mask, calls


def test_completion_ids_and_tool_mask_equal_trls(tiny_llama_full_vocab_path, qwen_tokenizer, tmp_path):
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS for _ in range(2)]  # G = 2, prompt-major
    trl_prompts, trl_completions, trl_mask, trl_calls = trl_episodes(tiny_llama_full_vocab_path, qwen_tokenizer,
                                                                      tmp_path, prompts)

    tools = as_tools(["calculator"])
    parser = HermesToolCallParser()
    chat = ChatFormat(qwen_tokenizer, [EOS], [t.schema for t in tools], parser)
    runner = EpisodeRunner(chat, functools.partial(ToolEnvironment, tools, parser, 10.0), max_turns=10,
                           max_tokens=256)
    prompt_ids, _ = runner.encode_prompts([[{"role": "user", "content": q}] for q in QUESTIONS], 4096)
    engine = ScriptedEngine(qwen_tokenizer, lambda call, row, prefix: next_turn(qwen_tokenizer, prefix))
    out = runner.sample(engine, EncodedPrompts.of(prompt_ids), 2, SamplingConfig(max_new_tokens=256))

    assert [len(p) for p, _, _ in engine.calls] == [3, 4, 2] and trl_calls == [6, 4, 2]  # one generate per turn
    assert [e.model_turns for e in out.episodes] == [2, 2, 1, 1, 3, 3]
    for row in range(6):
        assert trl_prompts[row] == prompt_ids[row // 2]
        n = len(trl_completions[row])
        assert out.completion_ids[row, :n].tolist() == trl_completions[row]
        assert out.completion_mask[row, :n].tolist() == trl_mask[row]
        assert int(out.completion_mask[row].sum() + out.env_mask[row].sum()) == n
