"""The worker-side routing recorder (:class:`lightning_grpo.rollout.engines.vllm.routing_capture.RoutingCapturer`) on
hand-made engine steps: rows of a flattened step placed at each request's positions, prefix-cache hits filled from the
request that computed them (across calls, through a chain of hits), each tag read once, the unread records a rollout
server's clear keeps (their hits filled before the donors go), and the errors. The recorder inside a real vLLM engine
is tested against an HF forward in ``test_vllm_moe.py`` and in a rollout server in
``tests/rollout/server/test_vllm_server_moe.py``.

The stand-in model runner holds only what :meth:`RoutingCapturer.step` reads of vLLM's V1 model runner (the step's
requests, their token ranges and start positions, their prompts and tags); its forward routes token ``x`` in layer
``l`` to experts ``(x + l) % 8`` and ``(x + l + 1) % 8``, so every recorded value can be checked against its token."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_grpo.rollout.engines.vllm.routing_capture import TAG, RoutingCapturer

LAYER_IDS = (1, 3)  # decoder layers that route (a dense layer 0, 2 between them)


def _experts(tokens, layers=(0, 1)):
    t = np.asarray(tokens)[:, None, None]
    layer = np.asarray(layers)[None, :, None]
    return np.concatenate([(t + layer) % 8, (t + layer + 1) % 8], axis=-1).astype(np.int16)


class Runner:
    """vLLM's V1 model runner as far as the recorder reads it."""

    def __init__(self):
        self.requests = {}

    def add(self, req_id, prompt, tag):
        self.requests[req_id] = SimpleNamespace(prompt_token_ids=prompt,
                                                sampling_params=SimpleNamespace(extra_args={TAG: tag}))

    def run(self, capturer, scheduled, layers=LAYER_IDS):
        """One engine step: ``scheduled`` = [(req_id, start position, token ids fed)]."""
        counts = [len(tokens) for _, _, tokens in scheduled]
        self.input_batch = SimpleNamespace(num_reqs=len(scheduled), req_ids=[r for r, _, _ in scheduled],
                                           num_computed_tokens_cpu=np.array([s for _, s, _ in scheduled]))
        self.query_start_loc = SimpleNamespace(np=np.concatenate([[0], np.cumsum(counts)]))
        ids = torch.tensor([t for _, _, tokens in scheduled for t in tokens])

        def forward(input_ids):
            for i, layer_id in enumerate(LAYER_IDS):
                if layer_id in layers:
                    capturer.capture(layer_id, torch.from_numpy(_experts(input_ids.numpy())[:, i]).long())
            return "hidden"

        return capturer.step(self, forward, (), {"input_ids": ids})


def _capturer():
    return RoutingCapturer(LAYER_IDS, top_k=2, max_tokens=4, device=torch.device("cpu"))


def test_each_requests_rows_land_at_its_positions_and_cache_hits_come_from_who_computed_them():
    capturer, runner = _capturer(), Runner()
    a, b = [5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 11]
    runner.add("ra", a, "a")
    runner.add("rb", b, "b")  # its first 4 tokens are in the prefix cache (computed by "ra" in this same step)
    assert runner.run(capturer, [("ra", 0, a), ("rb", 4, [11])]) == "hidden"
    runner.run(capturer, [("ra", 6, [20]), ("rb", 5, [21])])  # a decode step each (the buffer grows past 4 rows)
    routed_a, routed_b = capturer.take(["a", "b"])
    assert np.array_equal(routed_a, _experts(a + [20]))
    assert np.array_equal(routed_b, _experts(b + [21]))  # positions 0..3 from "ra"
    # a later call: "rc" reuses 5 tokens whose KV "rb" owns (4 of them "ra"'s): filled through the chain
    runner.add("rc", b + [21, 30], "c")
    runner.run(capturer, [("rc", 6, [30])])
    (routed_c,) = capturer.take(["c"])
    assert np.array_equal(routed_c, _experts(b + [21, 30]))


def test_an_unrecorded_cache_hit_a_silent_layer_and_an_unknown_tag_are_errors():
    capturer, runner = _capturer(), Runner()
    runner.add("rd", [1, 2, 3, 4], "d")
    runner.run(capturer, [("rd", 3, [4])])  # 3 cached tokens that no recorded request computed
    with pytest.raises(RuntimeError, match="request 'd' reused the KV cache of its first 3 tokens"):
        capturer.take(["d"])
    runner.add("re", [1, 2], "e")
    with pytest.raises(RuntimeError, match=r"the MoE layers \[1\] \(of 2\) reported no experts"):
        runner.run(capturer, [("re", 0, [1, 2])], layers=(1,))
    capturer.clear()
    with pytest.raises(KeyError, match="no request tagged 'd'"):
        capturer.take(["d"])


def test_routing_outside_an_engine_step_is_ignored():
    """vLLM's warm-up and profiling runs call the routers outside any step: nothing is recorded."""
    capturer = _capturer()
    capturer.capture(1, torch.zeros((4, 2), dtype=torch.long))
    assert (capturer.buffer == -1).all() and not capturer.records


def test_a_tag_is_read_once_and_a_kept_record_survives_the_clear_with_its_cache_hit_filled():
    """The rollout server's clear (``keep_unread``, at a weight update): "rb" (its first 4 tokens a cache hit on "ra")
    and the released "rx" are unread; after the clear "rb" is still read whole, its hit filled from "ra" before "ra"
    stopped being a donor, while a new request hitting "ra"'s tokens finds no donor; "rx" and a read tag are gone."""
    capturer, runner = _capturer(), Runner()
    a, b = [5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 11]
    runner.add("ra", a, "a")
    runner.add("rb", b, "b")
    runner.add("rx", [3, 4], "x")
    runner.run(capturer, [("ra", 0, a), ("rb", 4, [11]), ("rx", 0, [3, 4])])
    (routed_a,) = capturer.take(["a"])
    assert np.array_equal(routed_a, _experts(a))
    with pytest.raises(KeyError, match="no request tagged 'a' ran on this vLLM worker \\(or it was read already\\)"):
        capturer.take(["a"])
    capturer.release(["x", "never-seen"])
    capturer.clear(keep_unread=True)
    assert not capturer.records and list(capturer.by_tag) == ["b"]
    (routed_b,) = capturer.take(["b"])
    assert np.array_equal(routed_b, _experts(b))
    runner.add("rc", a + [12], "c")  # a hit on "ra"'s blocks after the clear: nothing can have computed them
    runner.run(capturer, [("rc", 6, [12])])
    with pytest.raises(RuntimeError, match="request 'c' reused the KV cache of its first 6 tokens"):
        capturer.take(["c"])
    with pytest.raises(KeyError, match="no request tagged 'x'"):
        capturer.take(["x"])


def test_a_kept_record_whose_cache_hit_no_request_computed_fails_when_read():
    capturer, runner = _capturer(), Runner()
    runner.add("rd", [1, 2, 3, 4], "d")
    runner.run(capturer, [("rd", 3, [4])])
    capturer.clear(keep_unread=True)  # its hit cannot be filled: the clear goes on, the read names it
    with pytest.raises(RuntimeError, match="request 'd' reused the KV cache of its first 3 tokens"):
        capturer.take(["d"])
    capturer.clear()  # the colocated engine's clear forgets the unread tags too
    runner.add("re", [1, 2], "e")
    runner.run(capturer, [("re", 0, [1, 2])])
    capturer.clear()
    with pytest.raises(KeyError, match="no request tagged 'e'"):
        capturer.take(["e"])
