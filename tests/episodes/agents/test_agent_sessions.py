"""The agent gateway's sessions, through the real ``openai`` client on loopback, on a scripted model: the trained ids
are the sampled ids (TRL #5224), logprobs line up with them (eval-protocol PR #457), missing logprobs stay missing
(rLLM #816), a call that does not extend its sample starts a new one (prime-rl's rule), tool calls, streaming with
tool calls keeps the ids (vLLM #27482), batching, limits and bad input."""

import json
import threading

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from lightning_grpo.protocols.rollout import RolloutOutput
from lightning_grpo.protocols.sampling import SamplingConfig
from support.agents import CALL, EOS, TOOLS, Recorder, by_prompt, client, encode, run_agents, tool_loop_agent
from support.episodes import ScriptedEngine

TOOL_TAIL = "\n<|im_start|>tool\n56088<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


def test_trained_ids_are_the_sampled_ids_and_each_call_extends_the_last(tokenizer):
    call = encode(tokenizer, CALL) + [EOS]
    # the answer sampled letter by letter: its text re-encodes to other ids (TRL #5224's case)
    letters = [i for ch in "Answer: 56088" for i in encode(tokenizer, ch)] + [EOS]
    assert encode(tokenizer, tokenizer.decode(letters[:-1])) != letters[:-1]
    recorder = Recorder()
    agent = tool_loop_agent(recorder, logprobs=True)
    out, engine, _ = run_agents(tokenizer, agent, by_prompt(tokenizer, call, letters))
    first, second = recorder.answers[0]
    tail = encode(tokenizer, TOOL_TAIL)
    assert first["choices"][0]["token_ids"] == call and second["choices"][0]["token_ids"] == letters
    assert second["prompt_token_ids"] == first["prompt_token_ids"] + call + tail  # incremental, never re-encoded
    assert [p for p, _, _ in engine.calls] == [[first["prompt_token_ids"]], [second["prompt_token_ids"]]]
    # the training row: the first prompt, then exactly the sampled ids and the tool turn's ids
    assert out.prompt_ids[0][out.prompt_mask[0].bool()].tolist() == first["prompt_token_ids"]
    expected = call + tail + letters
    assert out.completion_ids[0].tolist() == expected
    assert out.completion_mask[0].tolist() == [1] * len(call) + [0] * len(tail) + [1] * len(letters)
    assert out.env_mask[0].tolist() == [0] * len(call) + [1] * len(tail) + [0] * len(letters)
    # the sampler's logprob of token i is at position i (eval-protocol PR #457: no shift), in answers and rows
    engine_lp = [-0.01 * (k + 1) for k in range(len(call))], [-0.01 * (k + 1) for k in range(len(letters))]
    for answer, ids, lp in zip((first, second), (call, letters), engine_lp, strict=True):
        content = answer["choices"][0]["logprobs"]["content"]
        assert [c["logprob"] for c in content] == pytest.approx(lp)
        assert [c["token"] for c in content] == [tokenizer.decode([t]) for t in ids]
    torch.testing.assert_close(out.sampler_logprobs[0], torch.tensor(engine_lp[0] + [0.0] * len(tail) + engine_lp[1]))
    # the answers: a tool call, then the text; the record: one sample holding both calls
    assert first["choices"][0]["finish_reason"] == "tool_calls" and first["choices"][0]["message"]["content"] is None
    assert json.loads(first["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == {
        "expression": "123 * 456"}
    assert second["choices"][0]["message"]["content"] == "Answer: 56088"
    assert out.completions == ["Answer: 56088"]
    record = out.episodes[0]
    assert [(s.calls, s.trained) for s in record.samples] == [([0, 1], True)]
    assert (record.model_turns, record.tool_calls, record.tool_errors, record.done) == (2, 1, 0, True)
    assert out.metrics["agent/samples_per_episode"].values.tolist() == [1.0]
    assert out.columns["transcript"][0][1] == {"role": "tool", "content": "56088", "tool_call_id": "call_0_0",
                                               "name": "calculator"}


def test_each_sampled_token_keeps_its_weight_version(tokenizer):
    """The trained row carries each model token's weight version (the engine's per-token versions: here the first
    call spans an update after its second token, the second call is sampled by the next version), -1 on the agent's
    tokens; the episode's record holds the oldest."""
    call, answer = encode(tokenizer, CALL) + [EOS], encode(tokenizer, "Answer: 56088") + [EOS]
    engine = ScriptedEngine(tokenizer, by_prompt(tokenizer, call, answer),
                            token_versions=lambda c, k: 3 + c + (c == 0 and k >= 2))
    out, _, _ = run_agents(tokenizer, tool_loop_agent(Recorder()), engine=engine)
    tail = encode(tokenizer, TOOL_TAIL)
    assert out.completion_versions[0].tolist() == [3, 3] + [4] * (len(call) - 2) + [-1] * len(tail) + \
        [4] * len(answer)
    assert out.weight_version == 3 and out.episodes[0].weight_version == 3


def test_missing_logprobs_stay_missing(tokenizer):
    """rLLM #816: an engine that reports no logprobs gives answers with null logprobs and a rollout without sampler
    logprobs, never zeros padded in."""

    class NoLogprobs(ScriptedEngine):
        def generate(self, prompt_ids, num_generations, sampling):
            out = super().generate(prompt_ids, num_generations, sampling)
            out.sampler_logprobs = None
            return out

    recorder = Recorder()
    engine = NoLogprobs(tokenizer, lambda c, r, p: encode(tokenizer, "42") + [EOS])
    out, _, _ = run_agents(tokenizer, tool_loop_agent(recorder, logprobs=True), engine=engine)
    assert recorder.answers[0][0]["choices"][0]["logprobs"] is None
    assert out.sampler_logprobs is None


def _rewriting_agent(recorder):
    """Calls twice; the second call drops the first answer and the tool turn and asks again (a summarizing agent)."""

    def agent(base_url, api_key, row):
        chat = client(base_url, api_key)
        messages = [{"role": "user", "content": row["question"]}]
        recorder.add(row, chat.chat.completions.create(model="m", messages=messages, tools=TOOLS))
        messages = [{"role": "user", "content": row["question"] + " (the calculator said 56088)"}]
        recorder.add(row, chat.chat.completions.create(model="m", messages=messages, tools=TOOLS))

    return agent


def test_a_call_that_does_not_extend_its_sample_starts_a_new_one(tokenizer):
    call, answer = encode(tokenizer, CALL) + [EOS], encode(tokenizer, "56088") + [EOS]
    recorder = Recorder()
    script = by_prompt(tokenizer, call, answer, marker="calculator said")
    out, _, _ = run_agents(tokenizer, _rewriting_agent(recorder), script)
    first, second = recorder.answers[0]
    text = tokenizer.decode(second["prompt_token_ids"])  # a new prompt: the rewritten messages, rendered whole
    assert text.endswith("(the calculator said 56088)<|im_end|>\n<|im_start|>assistant\n") and CALL not in text
    record = out.episodes[0]
    assert [(s.calls, s.trained) for s in record.samples] == [([0], False), ([1], True)]
    # the row is the last sample: its own prompt, its sampled ids; nothing spliced
    assert out.prompt_ids[0][out.prompt_mask[0].bool()].tolist() == second["prompt_token_ids"]
    assert out.completion_ids[0].tolist() == answer and out.env_mask[0].sum() == 0
    assert out.metrics["agent/samples_per_episode"].values.tolist() == [2.0]
    metric = out.metrics["agent/untrained_calls"]
    assert (metric.values.tolist(), metric.counts.tolist()) == ([1.0], [2.0])


def test_a_call_after_a_turn_cut_without_eos_starts_a_new_sample(tokenizer):
    recorder = Recorder()
    long_turn = encode(tokenizer, "one two three four five six seven eight nine ten")  # no EOS: cut at 4 tokens
    engine = ScriptedEngine(tokenizer, lambda c, r, p: long_turn if c == 0 else encode(tokenizer, "ok") + [EOS])

    def agent(base_url, api_key, row):
        chat = client(base_url, api_key)
        messages = [{"role": "user", "content": "count"}]
        answer = chat.chat.completions.create(model="m", messages=messages, max_tokens=4)
        recorder.add(row, answer)
        messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                     {"role": "user", "content": "go on"}]
        recorder.add(row, chat.chat.completions.create(model="m", messages=messages))

    out, _, _ = run_agents(tokenizer, agent, engine=engine)
    first, second = recorder.answers[0]
    assert first["choices"][0]["finish_reason"] == "length" and first["choices"][0]["token_ids"] == long_turn[:4]
    assert [s.calls for s in out.episodes[0].samples] == [[0], [1]]
    assert not out.truncated[0]  # the trained (last) sample ended with EOS


def test_tool_calls_malformed_calls_and_tool_choice_none(tokenizer):
    broken = encode(tokenizer, '<tool_call>\n{"name": "calculator", "arguments": {"expression": \n</tool_call>') + [EOS]
    recorder = Recorder()
    out, _, _ = run_agents(tokenizer, tool_loop_agent(recorder, calls=1), lambda c, r, p: broken)
    message = recorder.answers[0][0]["choices"][0]["message"]
    assert message["tool_calls"] is None and message["content"].startswith("<tool_call>")
    assert (out.episodes[0].tool_calls, out.episodes[0].tool_errors) == (1, 1)  # a call, which failed
    assert out.metrics["tools/error_rate"].values.tolist() == [1.0]
    recorder = Recorder()
    run_agents(tokenizer, tool_loop_agent(recorder, calls=1, tool_choice="none"),
               lambda c, r, p: encode(tokenizer, CALL) + [EOS])
    message = recorder.answers[0][0]["choices"][0]["message"]
    assert message["tool_calls"] is None and message["content"] == CALL


def test_streaming_with_tool_calls_keeps_the_ids(tokenizer):
    """vLLM #27482: the streamed answer of a tool call carries the same ids as the session trains on."""
    call = encode(tokenizer, CALL) + [EOS]
    chunks: list = []
    plain: list = []

    def agent(base_url, api_key, row):
        chat = client(base_url, api_key)
        messages = [{"role": "user", "content": row["question"]}]
        chunks.extend(chat.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True,
                                                   stream_options={"include_usage": True}))
        plain.append(chat.chat.completions.create(model="m", messages=messages, tools=TOOLS).model_dump())

    out, _, _ = run_agents(tokenizer, agent, lambda c, r, p: call)
    streamed_ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra or {}).get("token_ids", [])]
    assert streamed_ids == call == plain[0]["choices"][0]["token_ids"]
    assert chunks[0].model_extra["prompt_token_ids"] == plain[0]["prompt_token_ids"]
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == [
        ("calculator", {"expression": "123 * 456"})]
    assert [c.choices[0].finish_reason for c in chunks if c.choices] == [None, "tool_calls"]
    assert chunks[-1].usage.completion_tokens == len(call)
    first_sample = out.episodes[0].samples[0]  # both calls sent the same messages: the second starts a new sample
    assert first_sample.model_tokens == len(call)


def test_concurrent_agents_share_engine_calls(tokenizer):
    recorder = Recorder()
    rows = [{"question": f"What is {i} * 2?", "k": i} for i in range(2)]
    out, engine, _ = run_agents(tokenizer, tool_loop_agent(recorder, calls=1), lambda c, r, p: encode(tokenizer, "4")
                                + [EOS], rows=rows, g=3, batch_window_s=5.0)
    assert [(len(p), g) for p, g, _ in engine.calls] == [(6, 1)]  # six agents, one engine call
    assert out.completions == ["4"] * 6 and out.prompt_ids.shape[0] == 6


def test_limits_and_sampling_fields(tokenizer):
    errors: dict = {}

    def agent(base_url, api_key, row):
        chat = client(base_url, api_key)
        messages = [{"role": "user", "content": "hi"}]
        for name, kwargs in (("temperature", {"temperature": 0.3}), ("top_p", {"top_p": 0.5}),
                             ("assistant_last", {"messages": messages + [{"role": "assistant", "content": "x"}]}),
                             ("stop", {"stop": ["\n"]}), ("n", {"n": 2})):
            try:
                chat.chat.completions.create(**{"model": "m", "messages": messages, **kwargs})
            except openai.BadRequestError as err:
                errors[name] = err.body
        chat.chat.completions.create(model="m", messages=messages, temperature=1.0)  # the trainer's value: fine
        chat.chat.completions.create(model="m", messages=messages)
        try:
            chat.chat.completions.create(model="m", messages=messages)
        except openai.BadRequestError as err:
            errors["max_turns"] = err.body

    out, _, _ = run_agents(tokenizer, agent, lambda c, r, p: encode(tokenizer, "ok") + [EOS], max_turns=2)
    assert errors["temperature"]["param"] == "temperature" and "1.0" in errors["temperature"]["message"]
    assert errors["top_p"]["param"] == "top_p"
    assert errors["assistant_last"]["param"] == "messages"
    assert errors["stop"]["param"] == "stop" and "Extra inputs are not permitted" in errors["stop"]["message"]
    assert errors["n"]["param"] == "n"
    assert errors["max_turns"]["code"] == "max_turns_exceeded"
    # every request answered with an error: temperature, top_p, assistant_last, stop and n (the schema's), max_turns
    assert out.metrics["agent/refused_calls"].values.tolist() == [6.0]


def test_the_token_budget_refuses_a_call_without_room(tokenizer):
    body: dict = {}

    def agent(base_url, api_key, row):
        chat = client(base_url, api_key)
        messages = [{"role": "user", "content": "hi"}]
        answer = chat.chat.completions.create(model="m", messages=messages)
        messages += [{"role": "assistant", "content": answer.choices[0].message.content},
                     {"role": "user", "content": "a long follow-up question " * 5}]
        try:
            chat.chat.completions.create(model="m", messages=messages)
        except openai.BadRequestError as err:
            body.update(err.body)

    out, _, _ = run_agents(tokenizer, agent, lambda c, r, p: encode(tokenizer, "ok") + [EOS], max_tokens=20)
    assert body["code"] == "context_length_exceeded"
    assert out.episodes[0].budget_exceeded and out.truncated[0]


def test_rollout_state_round_trips(tokenizer):
    recorder = Recorder()
    out, _, _ = run_agents(tokenizer, tool_loop_agent(recorder),
                           by_prompt(tokenizer, encode(tokenizer, CALL) + [EOS], encode(tokenizer, "1") + [EOS]))
    again = RolloutOutput.from_state(torch.load(_saved(out.state()), weights_only=True))
    assert again.episodes == out.episodes and again.columns == out.columns
    assert torch.equal(again.completion_ids, out.completion_ids)


def _saved(state):
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def test_greedy_sampling_accepts_temperature_zero(tokenizer):
    def agent(base_url, api_key, row):
        client(base_url, api_key).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                          temperature=0)

    out, engine, _ = run_agents(tokenizer, agent, lambda c, r, p: encode(tokenizer, "y") + [EOS],
                                sampling=SamplingConfig(max_new_tokens=8, greedy=True))
    assert out.columns["agent_error"] == [None] and engine.calls[0][2].greedy


def test_a_call_without_the_sessions_key_changes_nothing(tokenizer):
    """Through the real sampler and gateway: one agent posts into the other's session without a key, with a wrong
    key and with its own session's key (each 401, before the engine); the other session's record, ids and engine
    calls are what they would be without it."""
    urls: dict = {}
    refused: list = []
    first_done, attacked = threading.Event(), threading.Event()
    follow_up = [{"role": "user", "content": "and then?"}]

    def agent(base_url, api_key, row):
        chat = client(base_url, api_key)
        if row["k"] == 0:  # the victim: a call, then (after the attack) a second one extending it
            messages = [{"role": "user", "content": row["question"]}]
            answer = chat.chat.completions.create(model="m", messages=messages)
            urls["victim"] = base_url
            first_done.set()
            assert attacked.wait(30)
            messages += [{"role": "assistant", "content": answer.choices[0].message.content}, *follow_up]
            chat.chat.completions.create(model="m", messages=messages)
            return
        assert first_done.wait(30)
        intrusion = [{"role": "user", "content": "INTRUDER"}]
        no_key = httpx.post(urls["victim"] + "/chat/completions", json={"model": "m", "messages": intrusion},
                            timeout=30)
        refused.append(no_key.status_code)
        for key in ("wrong", api_key):
            try:
                client(urls["victim"], key).chat.completions.create(model="m", messages=intrusion)
            except openai.AuthenticationError as err:
                refused.append(err.status_code)
        attacked.set()
        chat.chat.completions.create(model="m", messages=[{"role": "user", "content": row["question"]}])

    rows = [{"question": "What is 1 + 1?", "k": 0}, {"question": "What is 2 + 2?", "k": 1}]
    out, engine, _ = run_agents(tokenizer, agent, lambda c, r, p: encode(tokenizer, "ok") + [EOS], rows=rows)
    assert out.columns["agent_error"] == [None, None] and refused == [401, 401, 401]
    prompts = [p for batch, _, _ in engine.calls for p in batch]
    assert len(prompts) == 3 and all("INTRUDER" not in tokenizer.decode(p) for p in prompts)
    victim = out.episodes[0]
    assert (victim.model_turns, victim.error, [(s.calls, s.trained) for s in victim.samples]) == (2, None,
                                                                                                   [([0, 1], True)])
    assert all("INTRUDER" not in str(m.get("content")) for m in out.columns["transcript"][0])
    # the victim's row: its first prompt, then its two sampled answers around the follow-up's ids, nothing else
    ok = encode(tokenizer, "ok") + [EOS]
    row = out.completion_ids[0][out.completion_mask[0].bool() | out.env_mask[0].bool()].tolist()
    assert row[: len(ok)] == ok and row[-len(ok):] == ok
    assert "INTRUDER" not in tokenizer.decode(row) and "and then?" in tokenizer.decode(row)


@pytest.mark.parametrize("cut", ["before_the_closing_tag", "before_eos"])
def test_a_tool_call_cut_by_max_tokens_is_length_and_never_a_call(tokenizer, cut):
    """A turn stopped by the call's ``max_tokens`` after a call's JSON, with no ``</tool_call>`` (or with it but no
    EOS), is ``finish_reason: "length"`` with its text as content and no ``tool_calls``: the model never finished
    it, and the turn loop never runs a truncated turn's call. The same turn finished with EOS is a call."""
    head = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123 * 456"}}'
    turn = encode(tokenizer, CALL) + [EOS]
    shown = head if cut == "before_the_closing_tag" else CALL
    limit = len(encode(tokenizer, shown))
    assert encode(tokenizer, CALL)[:limit] == encode(tokenizer, shown)  # the cut turn's ids are the call's first ones
    recorder = Recorder()
    out, _, _ = run_agents(tokenizer, tool_loop_agent(recorder, calls=1, max_tokens=limit), lambda c, r, p: turn)
    (answer,) = recorder.answers[0]
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "length" and choice["token_ids"] == turn[:limit]
    assert choice["message"]["tool_calls"] is None and choice["message"]["content"] == shown
    assert (out.episodes[0].tool_calls, out.episodes[0].tool_errors) == (0, 0) and out.truncated[0]
    recorder = Recorder()
    run_agents(tokenizer, tool_loop_agent(recorder, calls=1, max_tokens=limit + 1), lambda c, r, p: turn)
    choice = recorder.answers[0][0]["choices"][0]
    finished = cut == "before_eos"  # one more token is the EOS there: a finished call; else still cut
    assert choice["finish_reason"] == ("tool_calls" if finished else "length")
    assert len(choice["message"]["tool_calls"] or []) == int(finished)


def test_an_answer_echoed_back_as_model_dump_extends_the_sample(tokenizer):
    """The OpenAI client's assistant message dumps ``refusal``, ``audio``, ``function_call`` and ``annotations`` as
    nulls: echoed back whole (a common idiom) they are ignored, so the second call extends the sample exactly as the
    same message without them does. A value in one of them is a 400 naming it."""
    call = encode(tokenizer, CALL) + [EOS]
    answer = encode(tokenizer, "56088") + [EOS]
    dumped: list = []
    errors: dict = {}

    def agent(base_url, api_key, row):
        chat = client(base_url, api_key)
        messages: list = [{"role": "user", "content": row["question"]}]
        first = chat.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        echoed = first.choices[0].message.model_dump()
        dumped.append(echoed)
        tool = {"role": "tool", "tool_call_id": first.choices[0].message.tool_calls[0].id, "content": "56088"}
        for field, value in (("audio", {"id": "audio_1"}), ("annotations", [{"type": "url_citation"}]),
                             ("refusal", "no"), ("function_call", {"name": "calculator", "arguments": "{}"})):
            try:
                chat.chat.completions.create(model="m", messages=[*messages, {**echoed, field: value}, tool],
                                             tools=TOOLS)
            except openai.BadRequestError as err:
                errors[field] = err.body
        chat.chat.completions.create(model="m", messages=[*messages, echoed, tool], tools=TOOLS)

    out, engine, _ = run_agents(tokenizer, agent, by_prompt(tokenizer, call, answer))
    assert {k: dumped[0][k] for k in ("refusal", "audio", "function_call", "annotations")} == dict.fromkeys(
        ("refusal", "audio", "function_call", "annotations"))
    assert {field: body["param"] for field, body in errors.items()} == {
        "audio": "messages.1.audio", "annotations": "messages.1.annotations", "refusal": "messages.1.refusal",
        "function_call": "messages.1.function_call"}
    tail = encode(tokenizer, TOOL_TAIL)
    (first_prompt,), (second_prompt,) = [p for p, _, _ in engine.calls]
    assert second_prompt == first_prompt + call + tail  # extended: the echoed answer compared as the session's own
    assert [(s.calls, s.trained) for s in out.episodes[0].samples] == [([0, 1], True)]
    assert out.completion_ids[0].tolist() == call + tail + answer
