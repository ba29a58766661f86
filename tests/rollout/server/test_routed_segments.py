"""A completion's routing joined from its segments on the rollout server (``routed_segments``), without vLLM: numbers
worked by hand. Each position keeps the routing of the first segment that fed it; a segment whose routing covers less
than it fed (lost) is an error naming the completion; a segment aborted before its first token feeds nothing, its tag
released in the same worker call that reads the others. The real server is tested in ``test_vllm_server_moe.py``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from lightning_grpo.rollout.server.routed_segments import Segment, ServerRouting, join_segments, pack_rows, unpack_rows


def _routing(values, layers=1, top_k=1):
    """A routing by position whose every entry is its value (``(positions, layers, top_k)`` int16)."""
    return np.broadcast_to(np.asarray(values, dtype=np.int16)[:, None, None], (len(values), layers, top_k)).copy()


def test_each_position_keeps_the_routing_of_the_first_segment_that_fed_it():
    # prompt of 3, segment 1 sampled 2 tokens (fed 3 + 2 - 1 = 4), segment 2 (prompt 5) 3 more (fed 5 + 3 - 1 = 7):
    # positions 0..3 from segment 1 (10s), 4..6 from segment 2 (20s), whose own 0..3 were recomputed (never used)
    first, second = _routing([10, 11, 12, 13]), _routing([20, 21, 22, 23, 24, 25, 26])
    joined = join_segments([first, second], [4, 7], "completion 0")
    assert joined[:, 0, 0].tolist() == [10, 11, 12, 13, 24, 25, 26] and joined.dtype == np.int16
    # a segment's record may cover more than it fed (a step whose token was dropped): only what it fed is kept
    assert join_segments([_routing([1, 2, 3])], [2], "c")[:, 0, 0].tolist() == [1, 2]


@pytest.mark.parametrize("sequences, fed, message", [
    ([_routing([1, 2, 3]), _routing([4, 5])], [3, 5], "completion 3: segment 1's routing covers 2 positions of the 5 "
                                                      "it fed: its routing was lost"),
    ([_routing([1, 2, 3]), _routing([4, 5, 6])], [3, 2], "completion 3: segment 1 fed 2 positions, fewer than the 3"),
    ([], [], "completion 3: 0 segments' routing for 0 segments"),
])
def test_a_lost_segment_is_an_error_naming_the_completion(sequences, fed, message):
    with pytest.raises(ValueError, match=message):
        join_segments(sequences, fed, "completion 3")


def test_a_workers_routing_crosses_the_rpc_as_shape_and_bytes():
    """vLLM's msgpack RPC carries no numpy type: the rows go as their shape and int16 bytes, and come back equal."""
    rows = np.arange(24, dtype=np.int16).reshape(3, 4, 2) - 1
    shape, data = pack_rows(rows)
    assert shape == [3, 4, 2] and isinstance(data, bytes) and len(data) == 48
    back = unpack_rows([shape, data])  # msgpack turns the tuple into a list
    assert back.dtype == np.int16 and np.array_equal(back, rows)
    with pytest.raises(ValueError, match=r"a worker's routing of shape \[3, 4, 2\] came with 46 bytes, not 48"):
        unpack_rows([shape, data[:46]])


class Worker:
    """The worker extension's ``take_routing`` as the server calls it (tags read, tags released), answering each
    tag's routing from ``routing`` packed as the extension packs it; every call is kept."""

    def __init__(self, routing):
        self.routing, self.calls = routing, []

    async def __call__(self, method, args=()):
        self.calls.append((method, *args))
        if method == "install_routing_capture":
            return [(1, 1)]
        wanted, _ = args
        return [[pack_rows(self.routing[tag]) for tag in wanted]]


def _final(prompt_length, new_tokens):
    return SimpleNamespace(prompt_token_ids=list(range(prompt_length)),
                           outputs=[SimpleNamespace(token_ids=list(range(new_tokens)))])


def test_the_segments_of_one_call_are_read_in_one_worker_call_and_joined_into_the_two_fields():
    worker = Worker({"s1": _routing([1, 2, 3, 4]), "s3": _routing([9, 9, 9, 9, 5, 6]), "t1": _routing([7, 8])})
    routing = ServerRouting(lambda method: asyncio.run(worker(method)), native=False)
    assert (routing.moe_layers, routing.top_k) == (1, 1)
    # completion 0: prompt 3; "s1" sampled 2 tokens, "s2" was aborted before its first, "s3" (prompt 5) sampled 2
    # completion 1: prompt 2, "t1" sampled 1 token (its last token is never fed: -1)
    first = [routing.segment("s1", _final(3, 2)), routing.segment("s2", _final(5, 0)),
             routing.segment("s3", _final(5, 2))]
    second = [routing.segment("t1", _final(2, 1))]
    assert [s.fed for s in first] == [4, 0, 6] and second[0] == Segment("t1", 1, 2)
    fields = asyncio.run(routing.fields(worker, [first, second], [3, 2]))
    assert worker.calls[-1] == ("take_routing", ["s1", "s3", "t1"], ["s2"])
    assert fields[0] == {"prompt_routed_experts": [[[1]], [[2]], [[3]]],
                         "completion_routed_experts": [[[4]], [[5]], [[6]], [[-1]]]}
    assert fields[1] == {"prompt_routed_experts": [[[7]], [[8]]], "completion_routed_experts": [[[-1]]]}
