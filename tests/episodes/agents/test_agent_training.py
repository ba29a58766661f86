"""GRPO of an agent through the gateway on every engine and mode: a plain ``openai``-client agent that talks with a
tiny Llama ending its turns after a few tokens (real sampling), answering each turn with an observation. HF engine
(with LoRA too), two processes in lockstep (FSDP2, a gateway each), colocated vLLM and a rollout server, where the
sampler's logprobs of every model token equal the trainer's (importance ratio 1 within 1e-3), and asynchronous
rollouts with one weight version per episode."""

import pytest
import torch
from openai import OpenAI

from lightning_grpo import GRPOConfig, GRPOModule
from lightning_grpo.callbacks import GRPOCallback
from lightning_grpo.config import EngineConfig, EpisodeConfig
from lightning_grpo.data import PromptDataModule
from support.algorithm import Recorder, quiet_trainer, write_prompts
from support.episodes import save_talkative_llama


@pytest.fixture(scope="session")
def talkative_llama(tmp_path_factory, smollm2_path):
    return save_talkative_llama(tmp_path_factory.mktemp("talkative"), smollm2_path)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl")


def echo_agent(base_url: str, api_key: str, row: dict) -> float:
    """Three calls, each answered with an observation; the reward is the last answer's length / 100 (0 when a turn
    was cut)."""
    chat = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "user", "content": row["question"]}]
    for k in range(3):
        choice = chat.chat.completions.create(model="policy", messages=messages).choices[0]
        if choice.finish_reason != "stop":
            return 0.0
        messages += [{"role": "assistant", "content": choice.message.content or ""},
                     {"role": "user", "content": f"obs {k + 1}"}]
    return len(choice.message.content or "") / 100


def returned(prompts, completions, env_reward, **kwargs):
    return list(env_reward)


class Rollouts(GRPOCallback):
    def __init__(self):
        self.rollouts = []

    def on_rollout_end(self, trainer, module, rollout):
        self.rollouts.append(rollout)


def _check_agent_rollouts(rollouts, recorder):
    for rollout in rollouts.rollouts:
        for record in rollout.episodes:
            assert record.error is None and len(record.samples) == 1 and record.samples[0].trained
            assert record.model_turns == len(record.samples[0].calls) >= 1
    assert any(r.model_turns == 3 for rollout in rollouts.rollouts for r in rollout.episodes)
    for metrics in recorder.metrics:
        assert metrics["turns/mean"] > 1 and metrics["tokens/env_fraction"] > 0
        assert metrics["agent/errors"] == 0 and metrics["agent/samples_per_episode"] == 1


@pytest.mark.parametrize("lora", [False, True])
def test_training_an_agent_with_the_hf_engine(talkative_llama, prompt_file, tmp_path, lora):
    config = GRPOConfig(num_generations=4, max_new_tokens=6, episode=EpisodeConfig(max_turns=3, max_tokens=48))
    module = GRPOModule(talkative_llama, reward_funcs=[returned], agent=echo_agent, config=config, learning_rate=1e-3,
                        export_dir="", lora={"r": 4, "target_modules": ["q_proj", "v_proj"]} if lora else None)
    recorder, rollouts = Recorder(grads=True), Rollouts()
    trainer = quiet_trainer(tmp_path, 2, callbacks=[recorder, rollouts])
    trainer.fit(module, datamodule=PromptDataModule(dataset=prompt_file, prompts_per_step=2, val_size=0))
    assert trainer.global_step == 2
    _check_agent_rollouts(rollouts, recorder)
    batch = recorder.batches[0]
    assert batch.env_mask.sum() > 0
    assert max(g.abs().max().item() for g in recorder.grads[0].values()) > 0
    rewards = [r.env_reward for rollout in rollouts.rollouts for r in rollout.episodes]
    assert recorder.metrics[0]["rewards/returned/mean"] == pytest.approx(sum(rewards[:8]) / 8, abs=1e-6)


@pytest.mark.distributed
@pytest.mark.slow
def test_two_processes_run_their_agents_in_lockstep(tmp_path, smollm2_path):
    from support.dist import load, run_worker

    model = save_talkative_llama(tmp_path / "talkative", smollm2_path)
    out = tmp_path / "run"
    run_worker({"scenario": "agents_run", "model": model, "strategy": {"name": "grpo_fsdp2"}}, out, timeout=900)
    ranks = load(out, "agents_run", 2)
    assert [r["global_step"] for r in ranks] == [2, 2]
    assert all(t <= 2 for rollout in ranks[0]["turns"] for t in rollout)
    assert any(t > 2 for rollout in ranks[1]["turns"] for t in rollout)  # rank 1's agents made more calls
    assert ranks[0]["turns_max"] == ranks[1]["turns_max"]
    assert ranks[0]["gateways"].isdisjoint(ranks[1]["gateways"])  # a gateway per process


def _fit_vllm(path, prompt_file, tmp_path, steps=3, **engine):
    from support.dist import free_port

    staleness = engine.pop("max_staleness", 0)
    config = GRPOConfig(num_generations=4, max_new_tokens=6, max_prompt_length=256, importance_sampling_cap=2.0,
                        max_staleness=staleness, episode=EpisodeConfig(max_turns=3, max_tokens=40),
                        engine=EngineConfig(kv_cache_space_gib=0.25, server_group_port=free_port(), server_timeout=300,
                                            **engine))
    module = GRPOModule(path, reward_funcs=[returned], agent=echo_agent, config=config, learning_rate=1e-2,
                        export_dir="")
    recorder, rollouts = Recorder(), Rollouts()
    trainer = quiet_trainer(tmp_path, steps, callbacks=[recorder, rollouts])
    torch.manual_seed(0)
    trainer.fit(module, datamodule=PromptDataModule(dataset=prompt_file, prompts_per_step=2, val_size=0))
    return recorder, rollouts


def _check_on_policy(recorder, rollouts):
    _check_agent_rollouts(rollouts, recorder)
    for metrics in recorder.metrics:
        assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-3)
        assert metrics["sampling/importance_sampling_ratio/max"] < 1.01
    assert all(b.sampler_logprobs is not None for b in recorder.batches)
    assert sum(int(b.env_mask.sum()) for b in recorder.batches) > 0


@pytest.mark.slow
@pytest.mark.engine
def test_colocated_vllm_agents_are_sampled_by_the_trained_policy(talkative_llama, prompt_file, tmp_path):
    pytest.importorskip("vllm")
    _check_on_policy(*_fit_vllm(talkative_llama, prompt_file, tmp_path, name="vllm"))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.engine
def test_rollout_server_agents_sync_and_async(talkative_llama, prompt_file, tmp_path):
    pytest.importorskip("vllm")
    from support.rollout_server import Server

    server = Server(talkative_llama, tmp_path / "server.log")
    try:
        recorder, rollouts = _fit_vllm(talkative_llama, prompt_file, tmp_path / "sync", name="vllm_server",
                                       server_urls=[server.url])
        _check_on_policy(recorder, rollouts)
        recorder, rollouts = _fit_vllm(talkative_llama, prompt_file, tmp_path / "async", steps=4,
                                       name="vllm_server", server_urls=[server.url], max_staleness=1)
    finally:
        server.stop()
    assert [m["rollout/staleness_max"] for m in recorder.metrics] == [0.0, 1.0, 1.0, 1.0]
    versions = [{r.weight_version for r in rollout.episodes} for rollout in rollouts.rollouts]
    assert all(len(v) == 1 and None not in v for v in versions)  # every call of a rollout: one weight version
    firsts = [next(iter(v)) for v in versions]
    assert firsts == sorted(firsts) and len(set(firsts)) > 1
