"""The agent gateway's HTTP layer on loopback (FastAPI on uvicorn, requests with httpx and the ``openai`` client):
127.0.0.1 by default, per-session keys checked before anything else, 404 for an unknown session, 400 naming the
field, body and concurrency limits, and the streamed answer's events."""

import asyncio
import json
import threading

import httpx
import openai
import pytest

from lightning_grpo.episodes.agents.gateway import Gateway, session_key
from lightning_grpo.episodes.agents.openai_schema import ChatCompletionRequest, GatewayError


class Sessions:
    """A backend with sessions "a" and "b" whose answer is fixed; records the requests it got; ``hold`` makes each
    call wait until it is set."""

    model_name = "policy"

    def __init__(self) -> None:
        self.requests: list = []
        self.refusals: list = []
        self.hold: threading.Event | None = None
        self.inside = threading.Event()

    def has_session(self, session: str) -> bool:
        return session in ("a", "b")

    def refused(self, session: str) -> None:
        self.refusals.append(session)

    async def chat(self, session: str, request: ChatCompletionRequest) -> dict:
        self.requests.append((session, request))
        self.inside.set()
        if self.hold is not None:
            while not self.hold.is_set():
                await asyncio.sleep(0.01)
        if request.temperature == 0.5:
            raise GatewayError(400, "temperature=0.5 differs", param="temperature")
        return {"id": "x", "object": "chat.completion", "created": 0, "model": "policy", "prompt_token_ids": [1, 2],
                "choices": [{"index": 0, "finish_reason": "tool_calls", "logprobs": None, "token_ids": [7, 8, 9],
                             "message": {"role": "assistant", "content": None, "reasoning_content": "hmm",
                                         "tool_calls": [{"id": "c0", "type": "function", "function": {
                                             "name": "calculator", "arguments": "{\"expression\": \"1\"}"}}]}}],
                "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}


BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def served():
    sessions = Sessions()
    gateway = Gateway(sessions, max_body_bytes=4096, max_concurrent=2).start()
    yield gateway, sessions
    gateway.close()


def _post(gateway, session, key, body=BODY, **kwargs):
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.post(f"{gateway.base_url(session)}/chat/completions", json=body, headers=headers, timeout=30,
                      **kwargs)


def test_loopback_by_default_and_remote_only_when_asked():
    gateway = Gateway(Sessions())
    try:
        assert gateway.host == "127.0.0.1" and gateway._sock.getsockname()[0] == "127.0.0.1"
        assert gateway.base_url("a") == f"http://127.0.0.1:{gateway.port}/sessions/a/v1"
    finally:
        gateway.close()
    with pytest.raises(ValueError, match="host='0.0.0.0' listens beyond this machine"):
        Gateway(Sessions(), host="0.0.0.0")


def test_a_request_without_the_sessions_key_changes_nothing(served):
    gateway, sessions = served
    assert gateway.session_key("a") == session_key(gateway.run_key, "a") != gateway.session_key("b")
    for key in (None, "wrong", gateway.session_key("b"), gateway.run_key):
        answer = _post(gateway, "a", key)
        assert answer.status_code == 401, key
        assert answer.json()["error"]["type"] == "authentication_error"
    # a huge body without the key is refused before it is read
    assert _post(gateway, "a", None, content=b"x" * 100_000).status_code == 401
    assert sessions.requests == [] and sessions.refusals == []  # not the session's requests: nothing counted
    assert _post(gateway, "a", gateway.session_key("a")).status_code == 200
    assert [s for s, _ in sessions.requests] == ["a"] and sessions.refusals == []


def test_unknown_session_bad_fields_and_body_limits(served):
    gateway, sessions = served
    missing = _post(gateway, "zzz", gateway.session_key("zzz"))
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "session_not_found"
    key = gateway.session_key("a")
    cases = [({"model": "m", "messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
             ({**BODY, "temprature": 1.0}, "temprature"), ({"model": "m", "messages": []}, "messages"),
             ({**BODY, "n": 3}, "n"), ({**BODY, "tool_choice": "required"}, "tool_choice"),
             ({**BODY, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
              "messages.0.user.content")]
    for body, param in cases:
        answer = _post(gateway, "a", key, body)
        assert answer.status_code == 400, body
        assert answer.json()["error"]["param"].startswith(param.split(".user")[0]), answer.json()
    refused = _post(gateway, "a", key, {**BODY, "temperature": 0.5})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "temperature"
    too_big = _post(gateway, "a", key, {**BODY, "messages": [{"role": "user", "content": "x" * 5000}]})
    assert too_big.status_code == 413
    # every request with the session's key answered with an error is reported: the unknown session's 404, the six
    # the schema refused, the backend's 400, the 413
    assert sessions.refusals == ["zzz"] + ["a"] * (len(cases) + 2)
    assert httpx.get(f"{gateway.url}/v1/models", headers={"Authorization": f"Bearer {gateway.run_key}"}
                     ).json()["data"][0]["id"] == "policy"


def test_more_concurrent_requests_than_the_limit_get_429(served):
    gateway, sessions = served
    sessions.hold = threading.Event()
    key = gateway.session_key("a")
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(_post(gateway, "a", key).status_code))
               for _ in range(2)]
    for t in threads:
        t.start()
    while len(sessions.requests) < 2:
        sessions.inside.wait(1)
    third = _post(gateway, "a", key)
    assert third.status_code == 429 and third.headers["retry-after"] == "1" and sessions.refusals == ["a"]
    sessions.hold.set()
    for t in threads:
        t.join()
    assert results == [200, 200]


def test_the_openai_client_reads_answers_and_streams(served):
    gateway, _ = served
    chat = openai.OpenAI(base_url=gateway.base_url("b"), api_key=gateway.session_key("b"), max_retries=0)
    answer = chat.chat.completions.create(model="m", messages=BODY["messages"])
    assert answer.choices[0].message.tool_calls[0].function.name == "calculator"
    assert answer.choices[0].model_extra["token_ids"] == [7, 8, 9] and answer.model_extra["prompt_token_ids"] == [1, 2]
    assert [m.id for m in chat.models.list()] == ["policy"]
    raw = httpx.post(f"{gateway.base_url('b')}/chat/completions", json={**BODY, "stream": True},
                     headers={"Authorization": f"Bearer {gateway.session_key('b')}"}).text
    events = [line[len("data: "):] for line in raw.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["reasoning_content"] == "hmm"
    assert chunks[0]["choices"][0]["delta"]["tool_calls"][0]["index"] == 0
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "tool_calls"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gateway.base_url("b"), api_key="nope", max_retries=0).models.list()
