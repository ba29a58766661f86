"""Agents behind the gateway: an OpenAI Agents SDK agent as its documentation writes one (token-exact, its tool run by
the SDK, its final output scored), ``async`` and plain agents, and every way an agent fails (an exception of any
kind, a bad return value, a timeout, a stop request): recorded and scored as configured, never raised."""

import threading
import time

import pytest
import torch
from transformers import AutoTokenizer

from lightning_grpo.episodes import AgentRollout
from lightning_grpo.protocols.rollout import RolloutInterrupted, StopFlag
from lightning_grpo.protocols.sampler import EncodedPrompts
from lightning_grpo.protocols.sampling import SamplingConfig
from support.agents import CALL, EOS, Recorder, by_prompt, client, encode, run_agents, tool_loop_agent

agents_sdk = pytest.importorskip("agents")

ANSWER = "123 * 456 = 56088\n#### 56088"


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


def test_an_openai_agents_sdk_agent_is_trained_on_its_sampled_ids(tokenizer):
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    ran: list = []
    outputs: list = []

    @function_tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: the expression, e.g. 12 * 34.
        """
        ran.append(expression)
        return "56088"

    async def solve(base_url: str, api_key: str, row: dict) -> None:
        model = OpenAIChatCompletionsModel(model="policy",
                                           openai_client=AsyncOpenAI(base_url=base_url, api_key=api_key))
        agent = Agent(name="Calculator", instructions="Use the calculator.", tools=[calculator], model=model)
        result = await Runner.run(agent, row["question"], max_turns=3)
        outputs.append(result.final_output)

    call, answer = encode(tokenizer, CALL) + [EOS], encode(tokenizer, ANSWER) + [EOS]
    out, engine, _ = run_agents(tokenizer, solve, by_prompt(tokenizer, call, answer), g=2, batch_window_s=10.0)
    assert ran == ["123 * 456"] * 2 and outputs == [ANSWER] * 2
    tail = encode(tokenizer, "\n<|im_start|>tool\n56088<|im_end|>\n<|im_start|>assistant\n")
    assert [len(p) for p, _, _ in engine.calls] == [2, 2]  # both agents' calls batched, turn by turn
    assert engine.calls[1][0][0] == engine.calls[0][0][0] + call + tail
    for row in range(2):
        assert out.prompt_ids[row][out.prompt_mask[row].bool()].tolist() == engine.calls[0][0][0]
        assert out.completion_ids[row].tolist() == call + tail + answer
        assert [s.calls for s in out.episodes[row].samples] == [[0, 1]]
    assert out.completions == [ANSWER] * 2 and out.columns["agent_error"] == [None, None]
    system = tokenizer.decode(engine.calls[0][0][0])
    assert system.startswith("<|im_start|>system\nUse the calculator.\n\n# Tools") and '"calculator"' in system


def _answering(tokenizer):
    return lambda c, r, p: encode(tokenizer, "7") + [EOS]


@pytest.mark.parametrize("on_error", ["score", "skip"])
def test_an_agent_that_raises_is_recorded_and_scored_as_configured(tokenizer, on_error):
    def agent(base_url, api_key, row):
        client(base_url, api_key).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        if row["k"] == 0:
            raise ValueError("the agent broke")
        if row["k"] == 1:
            raise SystemExit(3)
        return {0: None, 2: 0.5, 3: True, 4: "abc", 5: float("nan")}[row["k"]]

    rows = [{"k": k} for k in range(6)]
    out, _, _ = run_agents(tokenizer, agent, _answering(tokenizer), rows=rows, on_error=on_error)
    errors = out.columns["agent_error"]
    assert errors[0] == "ValueError: the agent broke" and errors[1] == "SystemExit: 3"
    assert errors[2] is None and errors[3] is None
    assert errors[4].startswith("TypeError: the agent returned 'abc'") and errors[5].startswith("TypeError")
    assert out.columns["env_reward"] == [None, None, 0.5, 1.0, None, None]
    assert [r.done for r in out.episodes] == [False, False, True, True, False, False]
    assert out.metrics["agent/errors"].values.tolist() == [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]
    assert out.completions == ["7"] * 6  # each failed episode still holds what it sampled
    failed = torch.tensor([True, True, False, False, True, True])
    assert (out.unscored is None) if on_error == "score" else torch.equal(out.unscored, failed)


def test_an_agent_past_its_timeout_is_recorded_and_not_waited_for(tokenizer):
    released = threading.Event()

    def agent(base_url, api_key, row):
        chat = client(base_url, api_key)
        chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        if row["k"] == 1:
            released.wait(30)  # a plain function cannot be stopped: the rollout goes on without it
            chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "y"}])

    start = time.monotonic()
    out, _, _ = run_agents(tokenizer, agent, _answering(tokenizer), rows=[{"k": 0}, {"k": 1}], timeout_s=2.0)
    assert time.monotonic() - start < 20
    released.set()
    assert out.columns["agent_error"][0] is None
    assert out.columns["agent_error"][1] == "TimeoutError: the agent ran past timeout_s=2 s"
    assert out.metrics["agent/timeouts"].values.tolist() == [0.0, 1.0]
    assert out.completions == ["7", "7"]


def test_a_stop_request_interrupts_the_agents_and_closes_the_gateway(tokenizer):
    stop = StopFlag()
    urls: list = []

    def agent(base_url, api_key, row):
        urls.append(base_url)
        client(base_url, api_key).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        stop.set()
        time.sleep(30)

    from lightning_grpo.episodes import AgentSampler
    from support.episodes import ScriptedEngine

    sampler = AgentSampler(AgentRollout(agent), tokenizer, [EOS], max_turns=4, max_tokens=100,
                           max_prompt_length=512, stop=stop)
    with pytest.raises(RolloutInterrupted):
        sampler.sample(ScriptedEngine(tokenizer, _answering(tokenizer)), EncodedPrompts.of([[1]]), 1,
                       SamplingConfig(max_new_tokens=8))
    import httpx

    with pytest.raises(httpx.ConnectError):
        httpx.get(urls[0] + "/models")


def test_async_and_plain_agents_alike(tokenizer):
    from openai import AsyncOpenAI

    async def async_agent(base_url, api_key, row):
        chat = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        answer = await chat.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        return float(answer.choices[0].message.content)

    recorder = Recorder()
    out_async, _, _ = run_agents(tokenizer, async_agent, _answering(tokenizer), g=2)
    out_plain, _, _ = run_agents(tokenizer, tool_loop_agent(recorder, calls=1), _answering(tokenizer), g=2)
    assert out_async.columns["env_reward"] == [7.0, 7.0]
    assert torch.equal(out_async.completion_ids, out_plain.completion_ids)


def test_bad_settings_are_refused_naming_the_field(tiny_llama_path):
    from lightning_grpo import GRPOModule

    with pytest.raises(TypeError, match="AgentRollout.fn must be callable"):
        AgentRollout("my_agent")
    for kwargs, field in ((dict(timeout_s=0), "timeout_s"), (dict(batch_window_s=-1), "batch_window_s"),
                          (dict(on_error="ignore"), "on_error"), (dict(history="rewrite"), "history"),
                          (dict(max_concurrent_requests=0), "max_concurrent_requests")):
        with pytest.raises(ValueError, match=f"AgentRollout.{field}="):
            AgentRollout(lambda base_url, api_key, row: None, **kwargs)
    with pytest.raises(ValueError, match="runs the agent's own tools"):
        GRPOModule(tiny_llama_path, reward_funcs=["env_reward"], agent=lambda *args: None, tools=["calculator"])


def test_time_waiting_for_the_engine_does_not_count_against_the_timeout(tokenizer):
    from support.episodes import ScriptedEngine

    class Slow(ScriptedEngine):
        def generate(self, prompt_ids, num_generations, sampling):
            time.sleep(4.0)
            return super().generate(prompt_ids, num_generations, sampling)

    recorder = Recorder()
    out, engine, _ = run_agents(tokenizer, tool_loop_agent(recorder, calls=2), timeout_s=5.0,  # < 2 x 4 s
                                engine=Slow(tokenizer, by_prompt(tokenizer, encode(tokenizer, CALL) + [EOS],
                                                                 encode(tokenizer, "56088") + [EOS])))
    assert len(engine.calls) == 2 and out.columns["agent_error"] == [None]
