"""The LLM judge reward against real HTTP servers on 127.0.0.1: a tiny FastAPI app (uvicorn) that answers scores,
garbage, HTML, errors or slowly; a closed port (a judge that is down); and vLLM's own OpenAI-compatible server on
a tiny random Llama, with which GRPO trains two steps (slow: the server takes a minute to start on a CPU)."""

from __future__ import annotations

import asyncio
import csv
import glob
import json
import socket
import threading
import time

import httpx
import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger

from lightning_grpo import GRPOConfig, GRPOModule
from lightning_grpo.data import PromptDataModule
from lightning_grpo.rewards import RewardPool, gsm8k_format, score_completions
from lightning_grpo.rewards.judge import DEFAULT_RUBRIC, JudgeError, JudgeReward, task_text
from support.openai_server import vllm_openai_server

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

PROMPTS = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]] * 4
COMPLETIONS = ["4", "five", "2 + 2 = 4", "22"]


def _chat(content: str) -> dict:
    return {"id": "x", "object": "chat.completion", "model": "judge",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fake_judge():
    """A real HTTP server on 127.0.0.1: ``/<mode>/v1/chat/completions`` for each mode; ``requests`` records the
    bodies and headers it received."""
    app = fastapi.FastAPI()
    requests: list[dict] = []
    flaky_failures = {"left": 0}

    @app.post("/{mode}/v1/chat/completions")
    async def chat(mode: str, request: fastapi.Request):
        body = await request.json()
        requests.append({"mode": mode, "body": body, "auth": request.headers.get("authorization")})
        text = body["messages"][0]["content"]
        if mode == "score":  # 8 when the response is "4" or contains "= 4", else 2
            response = text.split("[Response]\n", 1)[1].split("\n\n", 1)[0]
            return _chat(f"The response is judged.\nScore: {8 if response == '4' or '= 4' in response else 2}")
        if mode == "group":
            n = text.count("[Response ")
            return _chat(json.dumps({"scores": [round(i / max(n - 1, 1), 3) for i in range(n)]}))
        if mode == "garbage":
            return _chat("I like turtles. Score: eleven. {not json")
        if mode == "out_of_range":
            return _chat("Score: 42")
        if mode == "html":
            return fastapi.responses.HTMLResponse("<html>502 bad gateway</html>")
        if mode == "error":
            return fastapi.responses.JSONResponse({"error": "overloaded"}, status_code=503)
        if mode == "flaky":
            if flaky_failures["left"] > 0:
                flaky_failures["left"] -= 1
                return fastapi.responses.JSONResponse({"error": "busy"}, status_code=429)
            return _chat("Score: 6")
        if mode == "slow":
            await asyncio.sleep(3)
            return _chat("Score: 5")
        return fastapi.responses.JSONResponse({"error": "unknown mode"}, status_code=404)

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the fake judge did not start"
        time.sleep(0.05)
    yield {"url": f"http://127.0.0.1:{port}", "requests": requests, "flaky": flaky_failures}
    server.should_exit = True
    thread.join(timeout=10)


def _judge(fake_judge, mode: str, **kwargs) -> JudgeReward:
    kwargs.setdefault("retry_backoff_s", 0.01)
    return JudgeReward(f"{fake_judge['url']}/{mode}/v1", "judge", **kwargs)


def test_the_rubric_shows_the_task_the_response_and_the_reference(fake_judge, monkeypatch):
    monkeypatch.setenv("JUDGE_TEST_KEY", "sk-test")
    fake_judge["requests"].clear()
    judge = _judge(fake_judge, "score", api_key_env="JUDGE_TEST_KEY")
    assert judge(PROMPTS[:2], COMPLETIONS[:2], answer=["4", "4"]) == [0.8, 0.2]  # (8 - 0) / 10, (2 - 0) / 10
    first = fake_judge["requests"][0]
    assert first["auth"] == "Bearer sk-test"
    assert first["body"]["model"] == "judge" and first["body"]["temperature"] == 0.0 and first["body"]["seed"] == 0
    content = first["body"]["messages"][0]["content"]
    assert "[Task]\nWhat is 2 + 2?\n\n[Response]\n4\n\n" in content and "[Reference]\n4" in content
    assert "Be brief." not in content  # the system prompt is not part of the task
    assert content == DEFAULT_RUBRIC.format(task="What is 2 + 2?", response="4", low=0, high=10,
                                            reference="\nA reference answer is given; a response that reaches it is "
                                                      "correct.\n\n[Reference]\n4")


def test_group_relative_judging_is_one_request_per_group(fake_judge):
    fake_judge["requests"].clear()
    judge = _judge(fake_judge, "group", group=True, name="ruler")
    scores = score_completions([judge], PROMPTS, COMPLETIONS, {}, pool=RewardPool(2), group_size=2)
    assert scores.per_function[:, 0].tolist() == [0.0, 1.0, 0.0, 1.0]  # each group's 2 responses, in order
    assert len(fake_judge["requests"]) == 2
    contents = sorted(r["body"]["messages"][0]["content"] for r in fake_judge["requests"])  # any order
    assert "[Response 1]\n2 + 2 = 4\n\n[Response 2]\n22\n" in contents[0] and "five" not in contents[0]
    assert "[Response 1]\n4\n\n[Response 2]\nfive\n" in contents[1] and "22" not in contents[1]


@pytest.mark.parametrize("mode, failure, detail", [
    ("garbage", "unparsable", "I like turtles"),
    ("out_of_range", "unparsable", "Score: 42"),
    ("html", "unparsable", "not a chat completion"),
    ("error", "request_failed", "HTTP 503"),
])
def test_a_judge_answering_garbage_raises_or_masks(fake_judge, mode, failure, detail):
    with pytest.raises(RuntimeError, match=f"'judge' raised JudgeError on sample 0: .*{detail}") as info:
        score_completions([_judge(fake_judge, mode, max_retries=1)], PROMPTS, COMPLETIONS, {}, pool=RewardPool(2))
    assert isinstance(info.value.__cause__, JudgeError) and fake_judge["url"] in str(info.value)
    masked = score_completions([_judge(fake_judge, mode, max_retries=1, on_failure="mask"), gsm8k_format],
                               PROMPTS, COMPLETIONS, {}, pool=RewardPool(2))
    assert masked.per_function[:, 0].isnan().all()  # masked: no reward from the judge, never a 0
    assert masked.outcomes == {"judge/request_failed": 4.0 * (failure == "request_failed"),
                               "judge/unparsable": 4.0 * (failure == "unparsable")}
    assert masked.rewards.tolist() == masked.per_function[:, 1].tolist()  # the other reward alone


def test_a_judge_that_is_down_raises_or_masks():
    url = f"http://127.0.0.1:{_free_port()}/v1"  # nothing listens there
    with pytest.raises(RuntimeError, match=r"no answer after 2 attempts: ConnectError"):
        JudgeReward(url, "judge", max_retries=1, retry_backoff_s=0.01)(PROMPTS[:1], COMPLETIONS[:1])
    masked = JudgeReward(url, "judge", max_retries=0, on_failure="mask")
    scores = score_completions([masked], PROMPTS, COMPLETIONS, {}, pool=RewardPool(4))
    assert scores.rewards.isnan().all()  # every reward masked: the completions are unscored (no loss)
    assert scores.outcomes == {"judge/request_failed": 4.0, "judge/unparsable": 0.0}


def test_retries_and_timeouts(fake_judge):
    fake_judge["requests"].clear()
    fake_judge["flaky"]["left"] = 2  # two 429s, then an answer
    assert _judge(fake_judge, "flaky", max_retries=2)(PROMPTS[:1], COMPLETIONS[:1]) == [0.6]
    assert len(fake_judge["requests"]) == 3
    fake_judge["flaky"]["left"] = 2
    with pytest.raises(JudgeError, match="HTTP 429"):
        _judge(fake_judge, "flaky", max_retries=1)(PROMPTS[:1], COMPLETIONS[:1])
    with pytest.raises(JudgeError, match="ReadTimeout"):
        _judge(fake_judge, "slow", timeout_s=0.3, max_retries=0)(PROMPTS[:1], COMPLETIONS[:1])


def test_parsing_and_the_guided_answer_format():
    import re

    judge = JudgeReward("http://127.0.0.1:1/v1", "judge", score_range=(1, 5))
    assert judge.parse("fine.\nScore: 4", 1) == [0.75] and judge.parse("Score: 2\nScore: 5", 1) == [1.0]
    assert judge.parse("Score: 6", 1) is None and judge.parse("no score", 1) is None
    assert re.fullmatch(judge.answer_regex(1), "short reason\nScore: 5")
    assert not re.fullmatch(judge.answer_regex(1), "reason\nScore: 6")
    group = JudgeReward("http://127.0.0.1:1/v1", "judge", group=True)
    assert group.parse('ranking: {"scores": [0.2, 1, 0.75]}', 3) == [0.2, 1.0, 0.75]
    assert group.parse('{"scores": [0.2, 1.5, 0.75]}', 3) is None and group.parse('{"scores": [0.2]}', 3) is None
    assert re.fullmatch(group.answer_regex(3), '{"scores": [0.2, 1, 0.75]}')
    assert task_text("plain") == "plain"
    assert task_text([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]) == \
        "user: a\n\nassistant: b"
    for bad in ({"score_range": (5, 5)}, {"on_failure": "ignore"}, {"timeout_s": 0}, {"max_retries": -1}):
        with pytest.raises(ValueError, match="JudgeReward"):
            JudgeReward("http://127.0.0.1:1/v1", "judge", **bad)


# ---------------------------------------------------------------------------------------------------------- vLLM
@pytest.fixture(scope="module")
def vllm_judge(tiny_llama_path, tmp_path_factory):
    """vLLM's OpenAI-compatible server (``vllm serve`` equivalent) on the tiny random Llama, on 127.0.0.1."""
    pytest.importorskip("vllm")
    log = tmp_path_factory.mktemp("vllm_judge") / "server.log"
    with vllm_openai_server(tiny_llama_path, "judge", log, "--max-model-len", "1024", "--max-num-batched-tokens",
                            "1024") as url:
        yield url


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.engine
def test_two_training_steps_with_a_judge_served_by_vllm(vllm_judge, tiny_llama_path, tmp_path):
    """GRPO trains two steps with a pointwise judge and a group-relative (RULER) judge served by vLLM (its answers
    guided to the format, the tiny model being random); the judge's scores equal a direct request's."""
    judge = JudgeReward(vllm_judge, "judge", guided=True, max_tokens=48, timeout_s=120)
    ruler = JudgeReward(vllm_judge, "judge", group=True, guided=True, max_tokens=64, timeout_s=120, name="ruler")
    L.seed_everything(0, verbose=False)
    config = GRPOConfig(num_generations=2, max_new_tokens=6, max_prompt_length=128, reward_num_workers=4)
    module = GRPOModule(tiny_llama_path, reward_funcs=[judge, ruler, "gsm8k_format"], config=config, export_dir="")
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=CSVLogger(str(tmp_path), name="logs"),
                        log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=str(tmp_path))
    trainer.fit(module, datamodule=PromptDataModule("arithmetic", prompts_per_step=2, val_size=0))
    assert trainer.global_step == 2
    (path,) = glob.glob(str(tmp_path / "logs" / "**" / "metrics.csv"), recursive=True)
    rows = [r for r in csv.DictReader(open(path)) if r.get("loss")]
    assert len(rows) == 2
    for row in rows:
        for name in ("judge", "ruler"):
            assert 0.0 <= float(row[f"rewards/{name}/mean"]) <= 1.0
            assert float(row[f"rewards/{name}/request_failed"]) == 0 and float(row[f"rewards/{name}/unparsable"]) == 0
            assert float(row[f"timing/reward_{name}_s"]) > 0
    prompt, completion = [{"role": "user", "content": "What is 2 + 2?"}], "4"
    body = {"model": "judge", "messages": [{"role": "user", "content": judge._pointwise_prompt(prompt, completion,
                                                                                                None)}],
            "temperature": 0.0, "max_tokens": 48, "seed": 0, "structured_outputs": {"regex": judge.answer_regex(1)}}
    answer = httpx.post(f"{vllm_judge}/chat/completions", json=body, timeout=120).json()
    assert judge([prompt], [completion]) == judge.parse(answer["choices"][0]["message"]["content"], 1)
