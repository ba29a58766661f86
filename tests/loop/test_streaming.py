"""Streaming rollouts through a plain ``L.Trainer`` on a tiny random Llama and a scripted streaming engine (timing
fixed by the engine's gates, never by sleeps): groups arriving out of order are trained in the order they finish,
each trained token's version is the engine's, the weights go to the engine after every optimizer step with the step
as their version, the metrics are logged; a run stopped after a checkpoint with groups in flight and resumed trains
every prompt exactly once, as the uninterrupted run does; a sample spanning two versions is scored against the
behaviour logprobs of each segment (the importance ratio is 1 per segment against the weights that sampled it);
``newest_version_only`` keeps only its newest segment in the loss."""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_grpo import GRPOConfig, GRPOModule
from lightning_grpo.callbacks import GRPOCallback
from lightning_grpo.config import StreamingConfig
from lightning_grpo.data import PromptDataModule
from support.checkpoint_generation import trainer_logprobs
from support.fixtures import alternating_reward, make_cpu_trainer, read_metrics_rows
from support.streaming import Gate, ModelLogprobs, ScriptedStreamingEngine

EOS = 2  # the tiny Llama's <|im_end|>
G = 2
QUESTIONS = ["Add 2 and 3.", "What is 7 times 6?", "Name a colour.", "Count to four.", "Say hello.",
             "What is 10 minus 4?", "Spell cat.", "Is 9 odd?"]
#: Group 0 samples two tokens, then waits for the weights of the first optimizer step; groups 4..7 finish one
#: after the other, the first after group 0. Groups finish 1, 2, 3, 0, 4, 5, 6, 7.
GATES = {0: [Gate(at=2, version=1)], 4: [Gate(at=0, after=0)], 5: [Gate(at=0, after=4)], 6: [Gate(at=0, after=5)],
         7: [Gate(at=0, after=6)]}


def script(key: int, j: int) -> list[int]:
    """Completion j of group ``key``: 5 ids, the last EOS."""
    return [100 + 7 * key + j, 300 + j, 400, 500 + key, EOS]


class Recorder(GRPOCallback):
    """Per optimizer step: the prompt keys of its rollout, its trained micro-batch, a copy of the policy it trains."""

    def __init__(self) -> None:
        self.keys: list[list[int]] = []
        self.batches: dict[int, object] = {}
        self.policies: dict[int, torch.nn.Module] = {}

    def on_rollout_end(self, trainer, module, rollout):
        self.keys.append(rollout.prompt_keys)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.batches[trainer.global_step] = batch
        self.policies[trainer.global_step] = copy.deepcopy(module.policy).eval()


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("stream_data") / "train.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": str(i)}) + "\n" for i, q in enumerate(QUESTIONS)))
    return str(path)


def _fit(model: str, data: str, root: Path, engine: ScriptedStreamingEngine, max_steps: int = 4, *,
         ckpt_dir=None, resume_from=None, learning_rate: float = 1e-3, **streaming) -> tuple[Recorder, GRPOModule]:
    config = GRPOConfig(num_generations=G, max_new_tokens=8, max_prompt_length=128,
                        streaming=StreamingConfig(enabled=True, max_inflight_groups=4, **streaming))
    L.seed_everything(0, verbose=False)
    module = GRPOModule(model, reward_funcs=[alternating_reward], config=config, learning_rate=learning_rate,
                        export_dir="")
    module.streaming_engine = engine
    recorder = Recorder()
    callbacks: list = [recorder]
    if ckpt_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=str(ckpt_dir), every_n_train_steps=1, save_top_k=-1))
    trainer = make_cpu_trainer(root, max_steps, callbacks=callbacks, enable_checkpointing=ckpt_dir is not None)
    datamodule = PromptDataModule(dataset=data, prompts_per_step=2, val_size=0, answer_format="raw",
                                  system_prompt=None, seed=3)
    trainer.fit(module, datamodule=datamodule, ckpt_path=resume_from)
    return recorder, module


def _rows(batch, row: int) -> tuple[list[int], list[int]]:
    """The trained ids and versions of a micro-batch row (its completion tokens)."""
    length = int(batch.completion_mask[row].sum())
    return batch.completion_ids[row, :length].tolist(), batch.completion_versions[row, :length].tolist()


def test_groups_arriving_out_of_order_are_trained_as_they_finish_with_the_engines_versions(tmp_path,
                                                                                          tiny_llama_path,
                                                                                          data_file):
    engine = ScriptedStreamingEngine(script, EOS, gates=GATES, paused_s=lambda version: 0.25 * version)
    recorder, module = _fit(tiny_llama_path, data_file, tmp_path, engine)
    # four steps, each the next two groups that finished
    assert recorder.keys == [[1, 1, 2, 2], [3, 3, 0, 0], [4, 4, 5, 5], [6, 6, 7, 7]]
    # the weights went to the engine before sampling and after every optimizer step, from the trainer's thread
    assert engine.updates == [(v, "MainThread") for v in range(5)]
    rows = read_metrics_rows(tmp_path, where="loss")
    assert [int(r["step"]) for r in rows] == [0, 1, 2, 3]
    for step, keys in enumerate(recorder.keys):
        batch = recorder.batches[step]  # one micro-batch per step: the rollout's rows, shuffled
        trained = {}
        for row in range(len(batch)):
            ids, versions = _rows(batch, row)
            key = (ids[0] - 100) // 7
            assert ids == script(key, ids[0] - 100 - 7 * key)
            assert versions == engine.sampled[(key, 1)]  # each token's version is the one that produced it
            trained[key] = versions
        assert sorted(trained) == sorted(set(keys))
        ages = [step - v for versions in trained.values() for v in versions for _ in range(G)]
        sample_ages = [step - min(v) for v in trained.values()]
        row = rows[step]
        assert float(row["streaming/token_staleness/max"]) == max(ages)
        assert float(row["streaming/token_staleness/mean"]) == pytest.approx(sum(ages) / len(ages))
        assert float(row["streaming/sample_staleness/max"]) == max(sample_ages)
        assert float(row["rollout/staleness_max"]) == max(ages)
        assert float(row["timing/weight_pause_s"]) == 0.25 * (step + 1)  # the update after this step
        assert float(row["streaming/stale_groups"]) == 0.0 and float(row["streaming/resampled_groups"]) == 0.0
    assert engine.sampled[(0, 1)] == [0, 0, 1, 1, 1]  # group 0 spans the first update
    spanning = float(rows[1]["streaming/partial_ratio"]), float(rows[1]["streaming/max_partial_span"])
    assert spanning == (0.5, 1.0)  # 2 of the 4 samples of step 1 (group 0's) span versions 0 and 1
    assert module.rollout_stream is None  # closed at the end of the fit


def test_a_second_epoch_streams_its_prompts_under_the_next_keys(tmp_path, tiny_llama_path, data_file):
    """An epoch of 4 rollouts ends on its count; the next one's prompts get keys 8..15, each trained once."""
    recorder, _ = _fit(tiny_llama_path, data_file, tmp_path, ScriptedStreamingEngine(script, EOS), max_steps=8)
    keys = [k for step in recorder.keys for k in step[::G]]
    assert Counter(keys[:8]) == Counter(range(8)) and Counter(keys[8:]) == Counter(range(8, 16))


def test_a_run_resumed_from_a_checkpoint_with_groups_in_flight_trains_every_prompt_exactly_once(tmp_path,
                                                                                               tiny_llama_path,
                                                                                               data_file):
    """An uninterrupted epoch trains the 8 prompts once each; a run stopped after its second step's checkpoint (group
    0 in flight, waiting for weights that never come; others finished or in flight) and resumed from it trains the
    same multiset of prompts: the finished groups from the checkpoint, the others sampled again."""
    whole, _ = _fit(tiny_llama_path, data_file, tmp_path / "whole", ScriptedStreamingEngine(script, EOS))
    assert Counter(k for keys in whole.keys for k in keys[::G]) == Counter(range(8))
    ckpt = tmp_path / "ckpt"
    held = {0: [Gate(at=2, version=99)]}  # never resumed in the first run
    first, _ = _fit(tiny_llama_path, data_file, tmp_path / "first", ScriptedStreamingEngine(script, EOS, gates=held),
                    max_steps=2, ckpt_dir=ckpt)
    saved = torch.load(ckpt / "epoch=0-step=2.ckpt", weights_only=True)["loops"]["fit_loop"]["state_dict"]
    stream = saved["rollout_cursors"][0]["stream"]
    assert 0 in stream["regenerate"] and sorted(stream["trained"]) == sorted(k for keys in first.keys
                                                                              for k in keys[::G])
    resumed_engine = ScriptedStreamingEngine(script, EOS)
    resumed, _ = _fit(tiny_llama_path, data_file, tmp_path / "resumed", resumed_engine, max_steps=4,
                      resume_from=str(ckpt / "epoch=0-step=2.ckpt"))
    trained = [k for keys in first.keys + resumed.keys for k in keys[::G]]
    assert Counter(trained) == Counter(range(8))  # each prompt once: the same multiset as the uninterrupted run
    ready = [g["item"]["key"] for g in stream["ready"]]
    assert [k for keys in resumed.keys for k in keys[::G]][: len(ready)] == ready  # the finished ones first
    assert (0, 1) in resumed_engine.sampled  # the group in flight was sampled again
    assert [v for v, _ in resumed_engine.updates] == [2, 3, 4]  # the resumed weights first, as the step's version


def test_a_sample_spanning_two_versions_is_scored_against_each_segments_behaviour_logprobs(tmp_path,
                                                                                          tiny_llama_path,
                                                                                          data_file):
    """The engine scores every token with a copy of the policy loaded from each update: group 0's first two tokens
    under the weights of version 0, the rest under version 1. Trained at step 1 (weights of version 1, the proximal
    policy), its sampler logprobs are the teacher-forced logprobs of the policy of each segment's version, so the
    importance ratio pi_old / pi_sampler is 1 on the version-1 segment and not on the version-0 one."""
    from lightning_grpo.protocols.weights import PolicyWeights  # noqa: F401 - the engine loads PolicyWeights

    model = GRPOModule(tiny_llama_path, reward_funcs=[alternating_reward], export_dir="").policy
    engine = ScriptedStreamingEngine(script, EOS, gates=GATES, logprob=ModelLogprobs(model))
    recorder, _ = _fit(tiny_llama_path, data_file, tmp_path, engine, max_steps=2, learning_rate=5e-2)
    batch = recorder.batches[1]
    rows = [r for r in range(len(batch)) if batch.completion_ids[r, 0] in (100, 101)]  # group 0's two completions
    assert len(rows) == G
    sampler = batch.sampler_logprobs
    for version in (0, 1):
        expected = trainer_logprobs(recorder.policies[version], batch, temperature=1.0)
        segment = (batch.completion_versions == version) & batch.completion_mask.bool()
        assert segment[rows].sum() == (2 if version == 0 else 3) * G
        assert float((sampler[rows][segment[rows]] - expected[rows][segment[rows]]).abs().max()) < 1e-5
    proximal = trainer_logprobs(recorder.policies[1], batch, temperature=1.0)  # the old logprobs of step 1
    ratio = (proximal - sampler).exp()
    newest, oldest = (batch.completion_versions == 1)[rows], (batch.completion_versions == 0)[rows]
    assert float((ratio[rows][newest] - 1).abs().max()) < 1e-4
    assert float((ratio[rows][oldest] - 1).abs().max()) > 1e-3  # the weights moved between the versions


def test_newest_version_only_trains_the_newest_segment_and_keeps_the_rest_as_context(tmp_path, tiny_llama_path,
                                                                                       data_file):
    engine = ScriptedStreamingEngine(script, EOS, gates=GATES)
    recorder, _ = _fit(tiny_llama_path, data_file, tmp_path, engine, max_steps=2, newest_version_only=True)
    batch = recorder.batches[1]
    for row in range(len(batch)):
        spans = batch.completion_versions[row][:5].tolist()
        if spans == [0, 0, 1, 1, 1]:  # group 0: its version-0 tokens are context, attended to, with no loss
            assert batch.completion_mask[row][:5].tolist() == [0, 0, 1, 1, 1]
            assert batch.env_mask[row][:5].tolist() == [1, 1, 0, 0, 0]
        else:
            assert batch.completion_mask[row][:5].tolist() == [1] * 5
            assert batch.env_mask[row][:5].tolist() == [0] * 5


def test_streaming_without_a_streaming_engine_names_the_fields(tmp_path, tiny_llama_path, data_file):
    config = GRPOConfig(num_generations=G, max_new_tokens=8, streaming=StreamingConfig(enabled=True))
    module = GRPOModule(tiny_llama_path, reward_funcs=[alternating_reward], config=config, export_dir="")
    trainer = make_cpu_trainer(tmp_path, 1, logger=False, enable_checkpointing=False)
    with pytest.raises(ValueError, match=r"GRPOConfig.streaming.enabled=True .*GRPOConfig.engine.name='hf' has none"):
        trainer.fit(module, datamodule=PromptDataModule(dataset=data_file, prompts_per_step=2, val_size=0,
                                                        answer_format="raw"))
    with pytest.raises(ValueError, match="streaming.enabled=True samples with a StreamingEngine"):
        module.rollout_engine = ScriptedStreamingEngine(script, EOS)
    with pytest.raises(ValueError, match="streaming.enabled=True samples single-turn groups"):
        GRPOModule(tiny_llama_path, reward_funcs=[alternating_reward], config=config, tools=["calculator"])
