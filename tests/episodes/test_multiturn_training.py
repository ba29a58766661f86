"""GRPO on multi-turn episodes through a plain L.Trainer with the HF engine: a tiny Llama that ends its turns after a
few tokens, a scripted environment (two observations, then done, with a reward), real sampling and training. The
trained experience is the episodes' ids; the metrics, the completion table and the rollout events show the turns."""

import json

import pytest
import torch

from lightning_grpo import GRPOConfig, GRPOModule
from lightning_grpo.callbacks import CompletionTable, GRPOCallback
from lightning_grpo.config import EpisodeConfig
from lightning_grpo.data import PromptDataModule
from support.algorithm import Recorder, quiet_trainer, write_prompts
from support.episodes import EchoEnvironment, save_talkative_llama


@pytest.fixture(scope="session")
def talkative_llama(tmp_path_factory, smollm2_path):
    return save_talkative_llama(tmp_path_factory.mktemp("talkative"), smollm2_path)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl")


def env_reward(prompts, completions, env_reward, **kwargs):
    return list(env_reward)


class Events(GRPOCallback):
    def __init__(self):
        self.rollouts, self.experiences = [], []

    def on_rollout_end(self, trainer, module, rollout):
        self.rollouts.append(rollout)

    def on_experience(self, trainer, module, event):
        self.experiences.append(event.experience)


def test_training_on_episodes(talkative_llama, prompt_file, tmp_path):
    config = GRPOConfig(num_generations=4, max_new_tokens=6, temperature=1.0,
                        episode=EpisodeConfig(max_turns=3, max_tokens=48))
    module = GRPOModule(talkative_llama, reward_funcs=[env_reward, "env_reward"], reward_weights=[1.0, 0.0],
                        environment_factory=lambda: EchoEnvironment(turns=3), config=config, learning_rate=1e-3,
                        export_dir="")
    recorder, events = Recorder(grads=True), Events()
    trainer = quiet_trainer(tmp_path, 2, callbacks=[recorder, events, CompletionTable()])
    trainer.fit(module, datamodule=PromptDataModule(dataset=prompt_file, prompts_per_step=2, val_size=0))
    assert trainer.global_step == 2
    batch, rollout = events.experiences[0], events.rollouts[0]  # the rollout's rows in order
    assert batch.env_mask.sum() > 0
    assert sum(int(b.env_mask.sum()) for b in recorder.batches) > 0  # and the micro-batches carry it
    records = rollout.episodes
    assert records is not None and len(records) == 8
    for i, record in enumerate(records):
        assert record.turns[0].source == "model" and record.turns[-1].source == "model"
        n = record.turns[-1].end
        mask, env = batch.completion_mask[i], batch.env_mask[i]
        if batch.completion_mask[i].any():  # the turns' spans are the masks of the trained row
            for turn in record.turns:
                assert bool((env if turn.source == "env" else mask)[turn.start:turn.end].all())
            assert int(mask.sum() + env.sum()) == n and not (mask.bool() & env.bool()).any()
        obs = [t.messages for t in record.turns if t.source == "env"]
        assert obs == [[{"role": "user", "content": f"obs {k + 1}"}] for k in range(len(obs))]
    done = [r for r in records if r.done]
    assert done, "the talkative model ends some episodes with three finished turns"
    assert all(r.model_turns == 3 and r.env_reward is not None for r in done)
    metrics = recorder.metrics[0]
    assert metrics["turns/max"] <= 3 and 1 <= metrics["turns/mean"] <= 3
    assert 0 < metrics["tokens/env_fraction"] < 1
    assert metrics["tools/calls_per_episode"] == 0 and metrics["episodes/done"] == pytest.approx(len(done) / 8)
    assert metrics["rewards/env_reward/mean"] == pytest.approx(
        sum(r.env_reward for r in done) / len(done), abs=1e-6)
    assert max(g.abs().max().item() for g in recorder.grads[0].values()) > 0
    # the completion table shows the whole transcript, turn boundaries and what was trained
    rows = [json.loads(line) for line in open(tmp_path / "completions.jsonl")]
    assert {"turns", "tool_calls", "tool_errors", "env_tokens"} <= set(rows[0])
    assert "[model, " in rows[0]["completion"] and ("[env, " in rows[0]["completion"]) == (rows[0]["turns"] > 1)
    assert rows[0]["completion"] == records[0].transcript(bool(batch.completion_mask[0].any()))


def test_the_episode_ids_are_what_the_engine_sampled(talkative_llama, prompt_file, tmp_path):
    """Every model turn's ids in the experience are what ``generate`` returned for that turn (recorded by wrapping
    the engine), and the observations' ids are the chat format's encoding of them."""
    config = GRPOConfig(num_generations=2, max_new_tokens=6, episode=EpisodeConfig(max_turns=3, max_tokens=48))
    module = GRPOModule(talkative_llama, reward_funcs=[env_reward], environment_factory=lambda: EchoEnvironment(3),
                        config=config, export_dir="")
    module.make_rollout_engine()
    engine = module.rollout.engine
    turns = []
    original = engine.generate

    def recording(prompt_ids, num_generations, sampling):
        out = original(prompt_ids, num_generations, sampling)
        rows = range(out.completion_ids.shape[0])
        turns.append([out.completion_ids[r, : int(out.completion_mask[r].sum())].tolist() for r in rows])
        return out

    engine.generate = recording
    batch = {"prompt": [[{"role": "user", "content": "hello"}]], "answer": ["1"]}
    torch.manual_seed(0)
    out = module.rollout.sample_prompts(batch["prompt"], 2, module.experience_maker._sampling(), [{"answer": "1"}])
    assert any(r.model_turns > 1 for r in out.episodes) and len(turns) > 1
    chat = module.rollout.sampler.chat
    for row, record in enumerate(out.episodes):
        expected, model_turn = [], 0
        for turn in record.turns:
            if turn.source == "model":
                running = [k for k, e in enumerate(out.episodes) if e.model_turns > model_turn]
                sampled = turns[model_turn][row if model_turn == 0 else running.index(row)]
                expected += sampled[: turn.end - turn.start]
                model_turn += 1
            else:
                expected += chat.env_turn_ids(turn.messages)
        assert out.completion_ids[row, : len(expected)].tolist() == expected
