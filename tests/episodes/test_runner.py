"""The turn loop on a scripted model: the trained ids are exactly the prompt, the sampled turns and the observations'
ids; sampled ids are kept even where decoding and encoding them again gives other ids; limits, batching by turn,
seeds, weight versions, errors."""

import pytest
import torch
from transformers import AutoTokenizer

from lightning_grpo.config import EpisodeConfig, GRPOConfig
from lightning_grpo.episodes import ChatFormat, EnvStep, EpisodeRunner, HermesToolCallParser, as_tools, episode_runner
from lightning_grpo.protocols.engine import EngineCapabilities
from lightning_grpo.protocols.rollout import RolloutInterrupted, StopFlag
from lightning_grpo.protocols.sampler import EncodedPrompts
from lightning_grpo.protocols.sampling import SamplingConfig
from support.episodes import EchoEnvironment, ScriptedEngine

EOS = 2
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123 * 456"}}\n</tool_call>'
PROMPTS = [[{"role": "user", "content": "What is 123 * 456?"}], [{"role": "user", "content": "And 2 + 2?"}]]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def tool_runner(tokenizer, max_tokens=200, max_turns=8, max_new_tokens=64):
    config = GRPOConfig(num_generations=2, max_new_tokens=max_new_tokens,
                        episode=EpisodeConfig(max_tokens=max_tokens, max_turns=max_turns))
    return episode_runner(config, tokenizer, [EOS], as_tools(["calculator"]), None, None, StopFlag())


def test_trained_ids_are_prompt_sampled_turns_and_observations(tokenizer):
    call, answer = encode(tokenizer, CALL) + [EOS], encode(tokenizer, "56088\n#### 56088") + [EOS]
    engine = ScriptedEngine(tokenizer, lambda t, k, p: call if t == 0 else answer)
    runner = tool_runner(tokenizer)
    prompt_ids, _ = runner.encode_prompts(PROMPTS, 1024)
    out = runner.sample(engine, EncodedPrompts.of(prompt_ids), 2, SamplingConfig(max_new_tokens=64))
    observation = runner.chat.env_turn_ids([{"role": "tool", "name": "calculator", "content": "56088"}])
    expected = call + observation + answer
    assert observation == encode(tokenizer, "\n<|im_start|>tool\n56088<|im_end|>\n<|im_start|>assistant\n")
    for row in range(4):
        prompt = out.prompt_ids[row][out.prompt_mask[row].bool()].tolist()
        assert prompt == prompt_ids[row // 2]
        assert out.completion_ids[row, : len(expected)].tolist() == expected
        assert out.completion_mask[row].tolist() == [1] * len(call) + [0] * len(observation) + [1] * len(answer)
        assert out.env_mask[row].tolist() == [0] * len(call) + [1] * len(observation) + [0] * len(answer)
        model = [-0.01 * (k + 1) for k in range(len(call))] + [0.0] * len(observation) + \
                [-0.01 * (k + 1) for k in range(len(answer))]
        torch.testing.assert_close(out.sampler_logprobs[row], torch.tensor(model))
    # one batched generate per turn, the second over every running episode's whole sequence, one sample each
    assert [(len(p), g) for p, g, _ in engine.calls] == [(2, 2), (4, 1)]
    assert engine.calls[1][0][1] == prompt_ids[0] + call + observation
    record = out.episodes[0]
    assert (record.model_turns, record.tool_calls, record.tool_errors, record.done, record.truncated) == (2, 1, 0,
                                                                                                          True, False)
    assert [(t.source, t.start, t.end) for t in record.turns] == [
        ("model", 0, len(call)), ("env", len(call), len(call) + len(observation)),
        ("model", len(call) + len(observation), len(expected))]
    assert record.messages == [{"role": "assistant", "content": CALL},
                               {"role": "tool", "name": "calculator", "content": "56088"},
                               {"role": "assistant", "content": "56088\n#### 56088"}]
    assert out.completions == ["56088\n#### 56088"] * 4 and not out.truncated.any()


def test_sampled_ids_are_trained_when_decode_then_encode_differs(tokenizer):
    """The model sampled "calculator" letter by letter: decoding and encoding its turn again merges the letters into
    other ids. The episode keeps the sampled ids (verifiers PR #497's bug class)."""
    letters = [i for ch in "calculator" for i in encode(tokenizer, ch)]
    sampled = encode(tokenizer, CALL) + [EOS]
    answer = encode(tokenizer, "I used the ") + letters + [EOS]
    assert encode(tokenizer, tokenizer.decode(answer[:-1])) != answer[:-1]  # the premise: retokenizing changes ids
    engine = ScriptedEngine(tokenizer, lambda t, k, p: sampled if t == 0 else answer)
    runner = tool_runner(tokenizer)
    prompt_ids, _ = runner.encode_prompts(PROMPTS[:1], 1024)
    out = runner.sample(engine, EncodedPrompts.of(prompt_ids), 2, SamplingConfig(max_new_tokens=64))
    n = int(out.env_mask[0].sum()) + len(sampled)
    assert out.completion_ids[0, n: n + len(answer)].tolist() == answer
    # and the next turn's prompt held the first turn's sampled ids, not a re-encoding
    assert engine.calls[1][0][0][len(prompt_ids[0]): len(prompt_ids[0]) + len(sampled)] == sampled


def test_budget_cuts_a_turn_and_drops_an_observation_that_does_not_fit(tokenizer):
    call = encode(tokenizer, CALL) + [EOS]  # 37 tokens; the observation is 15
    long_answer = encode(tokenizer, "x " * 40) + [EOS]

    def engine():
        return ScriptedEngine(tokenizer, lambda t, k, p: call if t == 0 else long_answer)

    prompt_ids, _ = tool_runner(tokenizer).encode_prompts(PROMPTS[:1], 1024)
    # budget 60: call (37) + observation (15) fit, the answer is cut to the 8 tokens left: truncated
    prompts = EncodedPrompts.of(prompt_ids)
    out = tool_runner(tokenizer, max_tokens=60).sample(engine(), prompts, 2, SamplingConfig(max_new_tokens=64))
    assert int((out.completion_mask[0] + out.env_mask[0]).sum()) == 60 and out.truncated.all()
    assert out.episodes[0].model_turns == 2 and not out.episodes[0].budget_exceeded
    assert out.completion_ids[0, 52:60].tolist() == long_answer[:8]
    # budget 52: the observation would leave no room for a model token: not appended, truncated, one turn
    out = tool_runner(tokenizer, max_tokens=52).sample(engine(), prompts, 2, SamplingConfig(max_new_tokens=64))
    assert out.completion_ids.shape[1] == len(call) and out.env_mask.sum() == 0 and out.truncated.all()
    assert out.episodes[0].budget_exceeded and out.episodes[0].model_turns == 1 and out.episodes[0].tool_calls == 1
    # per turn at most max_new_tokens, the rest of the budget stays for later turns
    scripted = engine()
    tool_runner(tokenizer, max_tokens=70, max_new_tokens=40).sample(scripted, EncodedPrompts.of(prompt_ids), 2,
                                                                 SamplingConfig(max_new_tokens=40))
    assert [s.max_new_tokens for _, _, s in scripted.calls] == [40, 70 - 52]


def test_max_turns_and_errors_are_observations(tokenizer):
    bad = encode(tokenizer, '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>')
    engine = ScriptedEngine(tokenizer, lambda t, k, p: bad + [EOS])
    runner = tool_runner(tokenizer, max_tokens=1000, max_turns=3)
    prompt_ids, _ = runner.encode_prompts(PROMPTS, 1024)
    out = runner.sample(engine, EncodedPrompts.of(prompt_ids), 2, SamplingConfig(max_new_tokens=64))
    record = out.episodes[0]
    assert record.model_turns == 3 and not record.done and not record.truncated
    assert record.tool_calls == 3 and record.tool_errors == 3  # the last turn's call ran too; its result is not shown
    assert [t.source for t in record.turns] == ["model", "env", "model", "env", "model"]
    assert '{"error": "CalculatorError: division by zero"}' in record.turns[1].messages[0]["content"]
    assert len(engine.calls) == 3


def test_an_environment_with_state_and_reward(tokenizer):
    EchoEnvironment.resets.clear()
    EchoEnvironment.closed = 0
    chat = ChatFormat(tokenizer, [EOS], [], HermesToolCallParser())
    runner = EpisodeRunner(chat, lambda: EchoEnvironment(turns=3), max_turns=8, max_tokens=200)
    engine = ScriptedEngine(tokenizer, lambda t, k, p: encode(tokenizer, f"turn {t} of {k}") + [EOS])
    prompt_ids, _ = runner.encode_prompts(PROMPTS, 1024)
    rows = [{"prompt": PROMPTS[0], "answer": "56088"}, {"prompt": PROMPTS[1], "answer": "4"}]
    out = runner.sample(engine, EncodedPrompts.of(prompt_ids, rows), 2, SamplingConfig(max_new_tokens=16))
    assert EchoEnvironment.resets == [rows[0], rows[0], rows[1], rows[1]] and EchoEnvironment.closed == 4
    assert [e.env_reward for e in out.episodes] == [len(f"turn 2 of {k}") / 100 for k in range(4)]
    assert [e.model_turns for e in out.episodes] == [3] * 4 and all(e.done for e in out.episodes)
    assert out.episodes[1].messages[1] == {"role": "user", "content": "obs 1"}
    assert out.completions == [f"turn 2 of {k}" for k in range(4)]


def test_episodes_end_at_different_turns_and_seeds_per_turn(tokenizer):
    """Episodes 0 and 2 answer at once, 1 and 3 call a tool first: the second turn generates for the running ones
    only, with seeds seed + t * N + r (disjoint from turn 0's seed + i * G + j)."""
    call, answer = encode(tokenizer, CALL) + [EOS], encode(tokenizer, "#### 1") + [EOS]
    engine = ScriptedEngine(tokenizer, lambda t, k, p: call if (t == 0 and k % 2) else answer)
    runner = tool_runner(tokenizer)
    prompt_ids, _ = runner.encode_prompts(PROMPTS, 1024)
    out = runner.sample(engine, EncodedPrompts.of(prompt_ids), 2, SamplingConfig(max_new_tokens=64, seed=1000))
    assert [e.model_turns for e in out.episodes] == [1, 2, 1, 2]
    assert [s.seed for _, _, s in engine.calls] == [1000, 1000 + 1 * 4]
    assert len(engine.calls[1][0]) == 2  # episodes 1 and 3
    assert out.completion_mask[0].sum() == len(answer) and out.env_mask[0].sum() == 0


def test_the_episodes_reward_columns_and_per_row_metrics(tokenizer):
    """The turn loop puts what it adds on its output: the reward functions' ``transcript`` and ``env_reward`` columns
    and each row's share of the multi-turn metrics (hand-worked from the script: episodes 1 and 3 make a good and a
    failing call, 0 and 2 answer at once)."""
    bad = encode(tokenizer, '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>')
    good, answer = encode(tokenizer, CALL), encode(tokenizer, "#### 1") + [EOS]
    script = {0: [answer, None], 1: [good + bad + [EOS], answer], 2: [answer, None], 3: [bad + [EOS], answer]}
    engine = ScriptedEngine(tokenizer, lambda t, k, p: script[k][0] if t == 0 else answer)
    runner = tool_runner(tokenizer, max_tokens=400)
    prompt_ids, _ = runner.encode_prompts(PROMPTS, 1024)
    out = runner.sample(engine, EncodedPrompts.of(prompt_ids), 2, SamplingConfig(max_new_tokens=96))
    assert out.columns == {"transcript": [e.messages for e in out.episodes], "env_reward": [None] * 4}
    assert [(e.model_turns, e.tool_calls, e.tool_errors) for e in out.episodes] == [(1, 0, 0), (2, 2, 1), (1, 0, 0),
                                                                                    (2, 1, 1)]
    metrics = out.metrics
    assert metrics["turns/mean"].values.tolist() == [1, 2, 1, 2] and metrics["turns/mean"].counts is None
    assert metrics["turns/max"].reduce == "max"
    assert metrics["tools/error_rate"].values.tolist() == [0, 1, 0, 1]
    assert metrics["tools/error_rate"].counts.tolist() == [0, 2, 0, 1] and metrics["tools/error_rate"].empty == 0.0
    env = out.env_mask.sum(dim=1).double()
    assert torch.equal(metrics["tokens/env_fraction"].values, env)
    assert torch.equal(metrics["tokens/env_fraction"].counts, env + out.completion_mask.sum(dim=1).double())
    assert metrics["episodes/done"].values.tolist() == [1, 1, 1, 1]
    assert set(metrics) == {"turns/mean", "turns/max", "tools/calls_per_episode", "tools/error_rate",
                            "tools/timeout_rate", "tokens/env_fraction", "episodes/budget_exceeded", "episodes/done"}


def test_weight_versions_are_recorded_per_token(tokenizer):
    """Each model token carries its turn's version (the engine's per-token versions when it reports them: a turn may
    span an in-flight weight update), the environment's tokens -1; an episode's record holds its oldest version."""
    call, answer = encode(tokenizer, CALL) + [EOS], encode(tokenizer, "#### 1") + [EOS]
    prompt_ids, _ = tool_runner(tokenizer).encode_prompts(PROMPTS[:1], 1024)
    same = ScriptedEngine(tokenizer, lambda t, k, p: call if t == 0 else answer, weight_versions=[5, 5])
    runner = tool_runner(tokenizer)
    out = runner.sample(same, EncodedPrompts.of(prompt_ids), 2, SamplingConfig(max_new_tokens=64))
    assert out.weight_version == 5 and [e.weight_version for e in out.episodes] == [5, 5]
    observation = len(runner.chat.env_turn_ids([{"role": "tool", "name": "calculator", "content": "56088"}]))
    for row in range(2):
        assert out.completion_versions[row].tolist() == [5] * len(call) + [-1] * observation + [5] * len(answer)
    mixed = ScriptedEngine(tokenizer, lambda t, k, p: call if t == 0 else answer, weight_versions=[5, 6])
    out = tool_runner(tokenizer).sample(mixed, EncodedPrompts.of(prompt_ids), 2, SamplingConfig(max_new_tokens=64))
    assert out.weight_version == 5 and [e.weight_version for e in out.episodes] == [5, 5]  # the oldest
    assert out.completion_versions[0].tolist() == [5] * len(call) + [-1] * observation + [6] * len(answer)
    # the first turn spans an update after its third token (the engine reports per-token versions)
    spanning = ScriptedEngine(tokenizer, lambda t, k, p: call if t == 0 else answer,
                              token_versions=lambda t, k: 7 + t + (t == 0 and k >= 3))
    out = tool_runner(tokenizer).sample(spanning, EncodedPrompts.of(prompt_ids), 2, SamplingConfig(max_new_tokens=64))
    assert out.completion_versions[1].tolist() == ([7] * 3 + [8] * (len(call) - 3) + [-1] * observation
                                                   + [8] * len(answer))
    assert out.weight_version == 7 and out.episodes[1].weight_version == 7
    assert out.completion_versions[:, len(call) + observation + len(answer):].eq(-1).all()  # padding
    unversioned = ScriptedEngine(tokenizer, lambda t, k, p: call if t == 0 else answer)
    assert tool_runner(tokenizer).sample(unversioned, EncodedPrompts.of(prompt_ids), 2,
                                         SamplingConfig(max_new_tokens=64)).completion_versions is None


def test_stop_flag_and_environment_errors(tokenizer):
    call = encode(tokenizer, CALL) + [EOS]
    runner = tool_runner(tokenizer)
    prompt_ids, _ = runner.encode_prompts(PROMPTS[:1], 1024)

    def stop_after_first(t, k, p):
        runner.stop.set()
        return call

    with pytest.raises(RolloutInterrupted):
        runner.sample(ScriptedEngine(tokenizer, stop_after_first), EncodedPrompts.of(prompt_ids), 2,
                      SamplingConfig(max_new_tokens=64))
    runner.stop.clear()

    class Broken(EchoEnvironment):
        def step(self, turn):
            raise OSError("the game server is down")

    chat = ChatFormat(tokenizer, [EOS], [], HermesToolCallParser())
    broken = EpisodeRunner(chat, Broken, max_turns=4, max_tokens=200)
    with pytest.raises(RuntimeError, match=r"an environment's step raised \(episodes \[0, 1\]\): the game server"):
        broken.sample(ScriptedEngine(tokenizer, lambda t, k, p: call), EncodedPrompts.of(prompt_ids), 2,
                      SamplingConfig(max_new_tokens=64))
    with pytest.raises(ValueError, match="EncodedPrompts has 1 image entries and 2 rows for 1 prompts"):
        EncodedPrompts.of(prompt_ids, rows=[{}, {}])


class Counted(EchoEnvironment):
    """Records, per environment made, how often it was reset and closed; ``fail`` makes one part raise."""

    made: list["Counted"] = []
    fail: dict[str, int] = {}  # "reset" / "step" -> the index (in making order) of the environment that raises

    def __init__(self) -> None:
        super().__init__(turns=2)
        self.index, self.resets, self.closes = len(Counted.made), 0, 0
        Counted.made.append(self)

    def reset(self, **row) -> None:
        self.resets += 1
        if Counted.fail.get("reset") == self.index:
            raise ConnectionError("the container did not start")

    def step(self, turn: str) -> EnvStep:
        if Counted.fail.get("step") == self.index:
            raise OSError("the game server is down")
        return super().step(turn)

    def close(self) -> None:
        self.closes += 1


@pytest.mark.parametrize("case", ["normal", "step_error", "stop_request", "reset_error"])
def test_every_environment_made_is_closed_exactly_once(tokenizer, case):
    """Whatever its factory acquired (a container, a sandbox, a socket) is released: after a normal episode, a step
    that raises, a stop request between turns, and a reset that raises (the third of four environments: the two made
    before it and itself are closed, the fourth is never made)."""
    Counted.made.clear()
    Counted.fail = {"step_error": {"step": 1}, "reset_error": {"reset": 2}}.get(case, {})
    chat = ChatFormat(tokenizer, [EOS], [], HermesToolCallParser())
    runner = EpisodeRunner(chat, Counted, max_turns=4, max_tokens=200)
    prompt_ids, _ = runner.encode_prompts(PROMPTS, 1024)

    def script(t, k, p):
        if case == "stop_request":
            runner.stop.set()
        return encode(tokenizer, f"turn {t}") + [EOS]

    engine = ScriptedEngine(tokenizer, script)
    expected = {"normal": None, "step_error": RuntimeError, "stop_request": RolloutInterrupted,
                "reset_error": RuntimeError}[case]
    if expected is None:
        runner.sample(engine, EncodedPrompts.of(prompt_ids), 2, SamplingConfig(max_new_tokens=16))
    else:
        with pytest.raises(expected):
            runner.sample(engine, EncodedPrompts.of(prompt_ids), 2, SamplingConfig(max_new_tokens=16))
    made = 3 if case == "reset_error" else 4
    assert [(e.resets, e.closes) for e in Counted.made] == [(1, 1)] * made


def test_lockstep_with_processes_whose_episodes_run_longer(tokenizer):
    """An engine that generates with the policy's parameters may be a collective per call (FSDP): with the processes'
    agreement this process keeps calling generate (one token, discarded) while another process still has running
    episodes, and a stop request on any process stops all of them at the same turn."""
    call, answer = encode(tokenizer, CALL) + [EOS], encode(tokenizer, "#### 1") + [EOS]
    runner = tool_runner(tokenizer)
    prompt_ids, _ = runner.encode_prompts(PROMPTS[:1], 1024)
    engine = ScriptedEngine(tokenizer, lambda t, k, p: call if t == 0 else answer)
    others = iter([False, True, False, True, False, True, False, False])  # (stop?, running?) of the other process
    agreed = []

    def any_process(flag):
        agreed.append(flag)
        other = next(others)
        return flag or other

    prompts = EncodedPrompts.of(prompt_ids)
    out = runner.sample(engine, prompts, 2, SamplingConfig(max_new_tokens=64), any_process=any_process)
    # turn 1 is ours; the other process runs two more turns: two one-token calls from this one, then all stop
    assert [(len(p), s.max_new_tokens) for p, _, s in engine.calls] == [(1, 64), (2, 64), (1, 1), (1, 1)]
    assert agreed == [False, True, False, False, False, False, False, False]
    assert [e.model_turns for e in out.episodes] == [2, 2]  # the extra calls changed nothing
    # engines with their own weights do not need the agreement
    own = ScriptedEngine(tokenizer, lambda t, k, p: call if t == 0 else answer)
    own.capabilities = EngineCapabilities()
    runner.sample(own, prompts, 2, SamplingConfig(max_new_tokens=64), any_process=lambda flag: pytest.fail("asked"))
    # a stop on another process
    stopping = ScriptedEngine(tokenizer, lambda t, k, p: call if t == 0 else answer)
    with pytest.raises(RolloutInterrupted):
        runner.sample(stopping, prompts, 2, SamplingConfig(max_new_tokens=64), any_process=lambda flag: True)
    assert len(stopping.calls) == 1
