"""RolloutPrefetcher and PrefetchedRollout on their own: a background generation with a recording engine, the weight
sync that waits until the engine is idle, wait_idle, close (the stop flag), and a finished rollout's state through
``torch.save``/``torch.load(weights_only=True)``. No GRPOModule, no Trainer."""

import io
import threading

import pytest
import torch
from torch import nn
from transformers import AutoTokenizer

from lightning_grpo import GRPOConfig
from lightning_grpo.protocols.episode import EpisodeRecord, Turn
from lightning_grpo.protocols.rollout import RolloutInterrupted, RolloutOutput, RowMetric
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.rollout.prefetch import PrefetchedRollout, RolloutPrefetcher
from lightning_grpo.rollout.worker import RolloutWorker
from lightning_grpo.training.metrics import StepTimer
from lightning_grpo.training.nonfinite import NonFiniteError
from support.algorithm import fixed_completions
from support.engines import RecordingEngine, weights_of

EOS = 2
BATCH = {"prompt": ["first prompt", "second prompt"], "answer": ["1", "2"]}


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path):
    return AutoTokenizer.from_pretrained(tiny_llama_path)


@pytest.fixture
def parts(tokenizer):
    """``(prefetcher, worker, engine, policy, gate)``: generations wait for ``gate``; the prefetcher is closed
    afterwards."""
    worker = RolloutWorker(GRPOConfig(max_staleness=1), tokenizer)
    gate = threading.Event()
    engine = RecordingEngine(fixed_completions([3, 2, 4, 1], 4, EOS), EOS, stop=worker.stop, gate=gate)
    worker.engine = engine
    torch.manual_seed(0)
    prefetcher = RolloutPrefetcher(worker)
    yield prefetcher, worker, engine, nn.Linear(2, 2), gate
    gate.set()
    prefetcher.close()


def _sampling(seeds):
    def make():
        seeds.append(len(seeds))
        return SamplingConfig(max_new_tokens=4, seed=100 + len(seeds))

    return make


def test_start_returns_at_once_and_generates_on_the_background_thread(parts, tokenizer):
    prefetcher, worker, engine, policy, gate = parts
    seeds = []
    rollout = prefetcher.start(BATCH, policy, 2, _sampling(seeds))
    assert seeds == [0]  # the sampling settings are drawn once, on the trainer's thread
    assert not rollout.done() and prefetcher.busy  # the generation waits for the gate
    assert rollout.weights_version == 0 and rollout.sampling.seed == 101 and rollout.num_truncated == 0
    gate.set()
    out = rollout.result()
    assert rollout.done() and rollout.succeeded() and not prefetcher.busy
    (generate,) = [entry for entry in engine.log if entry[0] == "generate"]
    assert generate[1] == weights_of(policy) and generate[2] == 101
    assert generate[3].startswith("lightning_grpo_rollout") and generate[3] != threading.current_thread().name
    assert engine.prompts == [worker.encode_prompts(BATCH["prompt"])[0]]
    assert out.completion_ids.shape == (4, 4) and out.completions == [f"completion {i}" for i in range(4)]
    assert rollout.generate_s > 0


def test_the_next_sync_waits_until_the_engine_is_idle(parts):
    prefetcher, worker, engine, policy, gate = parts
    first = prefetcher.start(BATCH, policy, 2, _sampling([]))
    old = weights_of(policy)
    with torch.no_grad():  # an optimizer step while the first rollout generates
        policy.weight.add_(1.0)
    worker.mark_stale()
    opener = threading.Timer(0.2, gate.set)  # the first generation ends later, on its own
    opener.start()
    timer = StepTimer()
    second = prefetcher.start(BATCH, policy, 2, _sampling([]), timer=timer)  # waits for it, then syncs
    opener.join()
    second.result()
    kinds = [entry[0] for entry in engine.log]
    assert kinds == ["wake_up", "sync", "generate", "generated", "wake_up", "sync", "generate", "generated"]
    generations = [entry[1] for entry in engine.log if entry[0] == "generate"]
    assert generations == [old, weights_of(policy)]  # each from the weights of its own start
    assert (first.weights_version, second.weights_version) == (0, 1)
    assert first.succeeded() and timer.get("rollout_s") > 0  # the wait counts as rollout time


def test_wait_idle_keeps_results_and_errors_with_their_rollouts(parts):
    prefetcher, worker, engine, policy, gate = parts
    gate.set()
    rollout = prefetcher.start(BATCH, policy, 2, _sampling([]))
    prefetcher.wait_idle()
    assert rollout.done() and not prefetcher.busy
    assert rollout.result().completions == [f"completion {i}" for i in range(4)]


def test_close_stops_a_running_generation_then_clears_the_stop_flag(parts):
    prefetcher, worker, engine, policy, gate = parts
    rollout = prefetcher.start(BATCH, policy, 2, _sampling([]))  # the gate stays closed: it never finishes alone
    prefetcher.close()
    assert rollout.done() and not rollout.succeeded() and not worker.stop.is_set()
    with pytest.raises(RolloutInterrupted):
        rollout.result()
    gate.set()  # a later start starts a new thread
    assert prefetcher.start(BATCH, policy, 2, _sampling([])).result().completion_ids.shape == (4, 4)
    worker.stop.set()  # a stop requested by someone else (SIGTERM) stays requested
    prefetcher.close()
    assert worker.stop.is_set()


def test_a_policy_with_nonfinite_weights_starts_nothing(parts):
    prefetcher, worker, engine, policy, gate = parts
    with torch.no_grad():
        policy.bias[0] = float("nan")
    with pytest.raises(NonFiniteError, match="before sampling a rollout: bias"):
        prefetcher.start(BATCH, policy, 2, _sampling([]))
    assert engine.log == [] and not prefetcher.busy


def test_a_finished_rollout_round_trips_through_a_weights_only_checkpoint(parts):
    prefetcher, worker, engine, policy, gate = parts
    gate.set()
    rollout = prefetcher.start(BATCH, policy, 2, _sampling([]))
    out = rollout.result()
    buffer = io.BytesIO()
    torch.save(rollout.state(), buffer)
    buffer.seek(0)
    restored = PrefetchedRollout.from_state(torch.load(buffer, weights_only=True))
    assert restored.future is None and restored.done() and restored.succeeded()
    assert (restored.batch, restored.num_truncated, restored.num_generations) == (BATCH, 0, 2)
    assert (restored.sampling, restored.weights_version, restored.generate_s) == \
        (rollout.sampling, rollout.weights_version, rollout.generate_s)
    again = restored.result()
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated"):
        assert torch.equal(getattr(again, name), getattr(out, name)), name
    assert again.completions == out.completions and again.sampler_logprobs is None


def test_a_rollout_with_episodes_columns_and_row_metrics_round_trips_through_a_weights_only_checkpoint():
    """What a multi-turn sampler adds (records, reward columns, per-row metrics) is plain data in a checkpoint."""
    record = EpisodeRecord([Turn("model", 0, 2, [{"role": "assistant", "content": "hi"}])], model_turns=1, done=True)
    out = RolloutOutput(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long),
                        torch.ones(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long), torch.tensor([False]),
                        ["hi"], env_mask=torch.zeros(1, 3, dtype=torch.long), episodes=[record],
                        columns={"transcript": [record.messages], "env_reward": [None]},
                        metrics={"turns/max": RowMetric(torch.tensor([1.0], dtype=torch.float64), reduce="max"),
                                 "tools/error_rate": RowMetric(torch.zeros(1, dtype=torch.float64),
                                                               torch.zeros(1, dtype=torch.float64), empty=0.0)})
    buffer = io.BytesIO()
    torch.save(out.state(), buffer)
    buffer.seek(0)
    again = RolloutOutput.from_state(torch.load(buffer, weights_only=True))
    assert again.episodes == [record] and again.columns == out.columns
    assert again.metrics.keys() == out.metrics.keys()
    for name, metric in out.metrics.items():
        restored = again.metrics[name]
        assert torch.equal(restored.values, metric.values) and restored.reduce == metric.reduce
        assert str(restored.empty) == str(metric.empty)  # nan stays nan
        assert (restored.counts is None) == (metric.counts is None)
