"""The rollout server's pure pieces, without vLLM: prompt splitting, per-request seeds, rows -> rollout, the weight-sync
wire format over a real gloo group, the HTTP client's deadline and errors, the config's server knobs.

Each test is an equality with numbers worked by hand or with the tensors that went in; the timeouts are measured.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from lightning_grpo.config import EngineConfig, GRPOConfig
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.rollout.engines.probe import probe_sequences, sync_check_tolerance
from lightning_grpo.rollout.engines.rows import request_seeds, rollout_from_rows
from lightning_grpo.rollout.server.client import RolloutServerError, ServerClient
from lightning_grpo.rollout.server.remote import VLLMServerEngine, split_evenly
from lightning_grpo.rollout.server.weight_sync import (
    decode_header,
    encode_header,
    host_store,
    join_store,
    make_group,
    receive_weights,
    send_weights,
)
from support.dist import free_port


def test_split_evenly_gives_contiguous_near_equal_parts():
    assert split_evenly(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert split_evenly(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert split_evenly(2, 3) == [(0, 1), (1, 2), (2, 2)]  # an instance may get nothing
    assert split_evenly(5, 1) == [(0, 5)]


def test_request_seeds_give_every_completion_its_own_seed():
    sampling = SamplingConfig(max_new_tokens=4, seed=100)
    assert request_seeds(sampling, 3, 4) == [100, 104, 108]  # vLLM seeds completion j with seed + j: 100..111
    assert request_seeds(SamplingConfig(max_new_tokens=4), 3, 4) is None
    assert request_seeds(SamplingConfig(max_new_tokens=4, greedy=True, seed=1), 3, 4) is None


class _Tokens:
    """Decodes ids as their decimal strings joined by spaces (the rows' decoding is what is checked here)."""

    def batch_decode(self, rows, skip_special_tokens):
        assert skip_special_tokens
        return [" ".join(str(t) for t in row if t != 0) for row in rows]


def test_rollout_from_rows_pads_masks_and_zeroes_after_eos():
    # eos = 2, pad = 0; prompt 0 = [5, 6] (G=2), prompt 1 = [7]
    rows = [([11, 2], [-0.5, -0.25]), ([12, 13, 14], [-1.0, -2.0, -3.0]), ([2], [-0.125]), ([15, 2, 16], [-1, -1, -1])]
    out = rollout_from_rows([[5, 6], [7]], rows, 2, pad_token_id=0, eos_token_ids=[2], tokenizer=_Tokens(),
                            weight_version=3)
    assert out.prompt_ids.tolist() == [[5, 6], [5, 6], [0, 7], [0, 7]]
    assert out.prompt_mask.tolist() == [[1, 1], [1, 1], [0, 1], [0, 1]]
    assert out.completion_ids.tolist() == [[11, 2, 0], [12, 13, 14], [2, 0, 0], [15, 2, 16]]
    assert out.completion_mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert out.truncated.tolist() == [False, True, False, False]
    assert out.sampler_logprobs.tolist() == [[-0.5, -0.25, 0], [-1, -2, -3], [-0.125, 0, 0], [-1, -1, 0]]
    assert out.completions == ["11 2", "12 13 14", "2", "15 2"]
    assert out.weight_version == 3
    with pytest.raises(ValueError, match="3 completions for 2 prompts x 2 generations"):
        rollout_from_rows([[5], [6]], rows[:3], 2, 0, [2], _Tokens())


def test_the_sync_check_tolerance_is_eight_unit_roundoffs_of_the_largest_logit():
    """8 * 2**-8 * 33.5 = 1.046875 for SmolLM2's probe in bfloat16 (issue 44); float32's 8 * 2**-24 * 33.5 = 1.6e-5 is
    under the 1e-4 floor; float16 has 11 significand bits."""
    assert sync_check_tolerance(torch.bfloat16, 33.5) == 1.046875
    assert sync_check_tolerance(torch.float32, 33.5) == 1e-4
    assert sync_check_tolerance(torch.float16, 1.0) == 8 * 2.0**-11
    with pytest.raises(ValueError, match="dtype=torch.int8"):
        sync_check_tolerance(torch.int8, 1.0)
    with pytest.raises(ValueError, match="max_abs_logit=0"):
        sync_check_tolerance(torch.bfloat16, 0)


def test_probe_sequences_are_fixed_and_in_the_vocabulary():
    first, second = probe_sequences(50), probe_sequences(50)
    assert first == second and len(first) == 4 and all(len(s) == 16 for s in first)
    assert all(0 <= t < 50 for s in first for t in s)


def test_header_round_trip_and_refusals():
    tensors = (torch.zeros(2, 3, dtype=torch.bfloat16), torch.tensor(1.5), torch.ones(1, 2, 3, 4, dtype=torch.long))
    for tensor in tensors:
        header, name = encode_header("model.layers.0.mlp.up_proj.weight", tensor)
        assert decode_header(header, name) == ("model.layers.0.mlp.up_proj.weight", tensor.dtype, tuple(tensor.shape))
    with pytest.raises(ValueError, match="'w' has dtype torch.complex64"):
        encode_header("w", torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(ValueError, match="'w' has 9 dims"):
        encode_header("w", torch.zeros([1] * 9))


def test_weights_stream_over_a_gloo_group_unchanged():
    """Rank 0 (this thread) streams four tensors to rank 1 (another thread, its own store client): the names,
    dtypes, shapes and values arrive unchanged, in order, and the count is returned."""
    weights = [("model.embed_tokens.weight", torch.randn(7, 4)), ("lm_head.weight", torch.randn(7, 4)),
               ("model.norm.weight", torch.randn(4).to(torch.bfloat16)), ("step", torch.tensor(3))]
    port = free_port()
    store = host_store("127.0.0.1", port, timeout_s=30)
    received: list = []

    def server_worker():
        group = make_group(join_store("127.0.0.1", port, 30), "test/0", 1, 2, "gloo", 30)
        received.extend(receive_weights(group, torch.device("cpu")))

    thread = threading.Thread(target=server_worker)
    thread.start()
    group = make_group(store, "test/0", 0, 2, "gloo", 30)
    assert send_weights([group], iter(weights), torch.device("cpu")) == 4
    thread.join(30)
    assert [n for n, _ in received] == [n for n, _ in weights]
    for (_, sent), (_, got) in zip(weights, received, strict=True):
        assert got.dtype == sent.dtype and torch.equal(got, sent)
    with pytest.raises(ValueError, match="backend='mpi'"):
        make_group(store, "test/1", 0, 1, "mpi", 1)


@pytest.fixture
def silent_server():
    """A socket that accepts connections and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    accepted: list = []
    stop = threading.Event()

    def accept():
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join(2)
    for conn in accepted:
        conn.close()
    listener.close()


def test_a_server_that_never_answers_fails_within_the_timeout(silent_server):
    start = time.monotonic()
    with pytest.raises(RolloutServerError) as err:
        VLLMServerEngine([silent_server], tokenizer=None, timeout_s=2.0, group_port=free_port())
    elapsed = time.monotonic() - start
    assert 2.0 <= elapsed < 3.5, elapsed
    message = str(err.value)
    assert f"rollout server {silent_server} did not answer GET /health within engine.server_timeout=2 s" in message
    assert "the answer was cut at the deadline" in message


def test_a_url_given_twice_is_refused_before_any_request():
    with pytest.raises(ValueError, match="name a server twice"):
        VLLMServerEngine(["http://127.0.0.1:1", "http://127.0.0.1:1/"], tokenizer=None, timeout_s=1.0)


def test_serve_help_lists_its_options(capsys):
    from lightning_grpo.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for option in ("--model", "--host", "--port", "--kv-cache-space-gib", "--max-model-len", "--seed",
                   "--tensor-parallel-size"):
        assert option in out, option


def test_an_unreachable_server_is_retried_until_the_timeout():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    start = time.monotonic()
    with pytest.raises(RolloutServerError, match=f"{url} did not answer POST /generate within "
                       r"engine.server_timeout=1.5 s \(last error: .*Connection refused"):
        ServerClient(url, 1.5).request("POST", "/generate", {"prompts": []})
    assert 1.5 <= time.monotonic() - start < 2.5


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"name": "vllm_server"}, r"engine.server_urls=\[\] is invalid: engine.name='vllm_server' needs"),
        ({"server_urls": ["localhost:8000"]}, "'localhost:8000' must start with http:// or https://"),
        ({"server_urls": ["http://a:1", "http://a:1"]}, "a server is listed twice"),
        ({"server_timeout": 0.0}, "engine.server_timeout=0.0 is invalid: must be > 0 seconds"),
        ({"server_group_port": 70000}, "engine.server_group_port=70000 is invalid"),
        ({"weight_sync_check": -1e-4}, "engine.weight_sync_check=-0.0001 is invalid: must be > 0 or None"),
    ],
)
def test_server_knobs_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)
    config = GRPOConfig(engine=EngineConfig(name="vllm_server", server_urls=["http://10.0.0.2:8000"]))
    assert config.engine.server_urls == ["http://10.0.0.2:8000"] and config.engine.weight_sync_check is None
