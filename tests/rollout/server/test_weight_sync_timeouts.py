"""Weight-sync groups fail loudly instead of hanging (the multi-node failure of TRL #2923, AReaL #1439, ms-swift
#3934): a group whose peer never joins ends in its timeout with :class:`WeightSyncTimeout`, naming the rank, the
world size and the timeout but never the group's secret key prefix; a peer that joined and then stopped taking part
fails the broadcast in the timeout; and a rollout server whose workers never join (a real HTTP peer that answers
``/health`` and ``/init_weight_sync`` and never connects) fails :class:`VLLMServerEngine` within
``engine.server_timeout`` with an error naming the server and the rendezvous address.

Gloo on CPU, threads of this process as the other ranks, timeouts of 2-3 s. Each check bounds the time from both
sides: at least most of the timeout (it waited for the peer, not failed for another reason), at most the timeout
plus a margin for a loaded machine (it did not hang)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from lightning_grpo.rollout.server.client import RolloutServerError
from lightning_grpo.rollout.server.remote import VLLMServerEngine
from lightning_grpo.rollout.server.weight_sync import (
    WeightSyncTimeout,
    group_prefix,
    host_store,
    join_store,
    make_group,
    send_weights,
)
from support.dist import free_port

MARGIN_S = 30.0


def test_a_group_whose_peer_never_joins_fails_within_its_timeout():
    store = host_store("127.0.0.1", free_port(), 10.0)
    prefix = group_prefix(0)
    start = time.monotonic()
    with pytest.raises(WeightSyncTimeout) as error:
        make_group(store, prefix, 0, 2, "gloo", 2.0)
    elapsed = time.monotonic() - start
    assert 1.5 <= elapsed < 2.0 + MARGIN_S
    message = str(error.value)
    assert message.startswith("the weight-sync group did not form: rank 0 of 2 waited 2 s for the other ranks")
    assert "engine.server_group_host:engine.server_group_port" in message
    assert prefix.rsplit("/", 1)[1] not in message  # the prefix is the group's secret


def test_a_peer_that_stops_taking_part_fails_the_broadcast_within_its_timeout():
    port = free_port()
    store = host_store("127.0.0.1", port, 10.0)
    prefix, peer = group_prefix(1), {}

    def join() -> None:  # rank 1 joins, then never receives
        peer["group"] = make_group(join_store("127.0.0.1", port, 10.0), prefix, 1, 2, "gloo", 2.0)

    thread = threading.Thread(target=join)
    thread.start()
    group = make_group(store, prefix, 0, 2, "gloo", 2.0)
    thread.join()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="Timed out waiting 2000ms"):
        send_weights([group], [("w", torch.ones(3))], torch.device("cpu"))
    assert 1.5 <= time.monotonic() - start < 2.0 + MARGIN_S


class NeverJoins(BaseHTTPRequestHandler):
    """A rollout server's HTTP side whose worker never joins the weight-sync group: ``/health`` answers, and so does
    ``/init_weight_sync`` (its body is kept in ``bodies``)."""

    bodies: list[dict] = []
    HEALTH = dict(instance_id="a1", version=0, eos_token_ids=[2], pad_token_id=2, max_model_len=512,
                  tie_word_embeddings=False, device="cpu", world_size=1, max_request_tokens=4096)

    def _answer(self, body: dict) -> None:
        raw = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):  # noqa: N802 - http.server's name
        self._answer(self.HEALTH)

    def do_POST(self):  # noqa: N802
        self.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        self._answer({"ranks": [1], "instance_id": "a1"})

    def log_message(self, *args):
        pass


def test_a_server_whose_workers_never_join_fails_the_engine_within_the_server_timeout():
    httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), NeverJoins)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url, group_port = f"http://127.0.0.1:{httpd.server_address[1]}", free_port()
    try:
        start = time.monotonic()
        with pytest.raises(RolloutServerError) as error:
            VLLMServerEngine([url], tokenizer=None, timeout_s=3.0, group_host="127.0.0.1", group_port=group_port)
        elapsed = time.monotonic() - start
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert 2.0 <= elapsed < 3.0 + MARGIN_S
    message = str(error.value)
    assert message.startswith(f"rollout server {url} did not join the weight-sync group at 127.0.0.1:{group_port}")
    assert "rank 0 of 2 waited" in message
    (body,) = NeverJoins.bodies
    assert body["world_size"] == 2 and body["port"] == group_port
    assert body["prefix"] not in message and body["prefix"].rsplit("/", 1)[1] not in message
