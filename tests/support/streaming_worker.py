"""A streaming GRPO fit on the shared rollout servers, run as its own process for the SIGTERM test
(``tests/rollout/server/test_streaming_fit.py``)::

    forked.start("support.streaming_worker:main", model, out, data, urls_json, secret_file, log=...)

:func:`streaming_config` and :func:`prompt_data` are the settings of the test file's runs too; here G = 2, 160 new
tokens, 4 groups in flight, 6 held. After each optimizer step the step's prompt keys are appended to
``<out>/trained.jsonl``. After step 2, once the stream holds a finished group and one being sampled, their keys are
written to ``<out>/groups_held`` and the process sends itself SIGTERM (at that moment, as a scheduler's would arrive:
sent from outside, the groups in flight could finish while the signal is on its way) and waits for Lightning to see
it; the only checkpoint callback saves on exception, so the checkpoint in ``<out>/ckpt`` is the SIGTERM's.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, Optional

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_grpo import EngineConfig, GRPOConfig, GRPOModule
from lightning_grpo.callbacks import GRPOCallback
from lightning_grpo.config import StreamingConfig
from lightning_grpo.data import PromptDataModule
from support.dist import free_port
from support.fixtures import alternating_reward, make_cpu_trainer

#: The optimizer steps taken before the run holds for SIGTERM.
STEPS_BEFORE_SIGTERM = 2
#: The post-sync probe check's bound (and the tests' tolerance on logprobs).
ATOL = 1e-4


def streaming_config(urls: list[str], max_new_tokens: int, secret_file: Optional[str] = None,
                     **streaming: Any) -> GRPOConfig:
    """The servers' engine (the secret from ``$LIGHTNING_GRPO_SERVER_SECRET`` or ``secret_file``, the post-sync probe
    check at :data:`ATOL` after every update, a free weight-sync port) in streaming mode; G = 2 at temperature 1."""
    engine = EngineConfig(name="vllm_server", server_urls=urls, server_group_port=free_port(), server_timeout=120.0,
                          weight_sync_check=ATOL, server_secret_file=secret_file)
    return GRPOConfig(num_generations=2, max_new_tokens=max_new_tokens, max_prompt_length=128, engine=engine,
                      streaming=StreamingConfig(enabled=True, **streaming))


def prompt_data(path: str) -> PromptDataModule:
    """The prompts of ``path`` (a JSONL of questions) in a seeded order, two per optimizer step."""
    return PromptDataModule(dataset=path, prompts_per_step=2, val_size=0, answer_format="raw", system_prompt=None,
                            seed=3)


class HoldForSigterm(GRPOCallback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.keys: list[list[int]] = []

    def on_rollout_end(self, trainer, module, rollout):
        self.keys.append(rollout.prompt_keys[::module.config.num_generations])

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if not batch.step_end:
            return
        with open(self.out / "trained.jsonl", "a") as f:
            f.write(json.dumps({"step": trainer.global_step - 1, "keys": self.keys[-1]}) + "\n")
        if trainer.global_step != STEPS_BEFORE_SIGTERM:
            return
        buffer = module.rollout_stream.buffer
        deadline = time.monotonic() + 120
        while True:
            with buffer.cond:
                ready, in_flight = [g.key for g in buffer.ready], list(buffer.in_flight)
            if ready and in_flight:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"the stream held no finished group with one in flight within 120 s: {ready}, "
                                     f"{in_flight}")
            time.sleep(0.01)
        (self.out / "groups_held").write_text(json.dumps({"ready": ready, "in_flight": in_flight}))
        os.kill(os.getpid(), signal.SIGTERM)
        while not trainer.received_sigterm:
            if time.monotonic() > deadline + 120:
                raise AssertionError("Lightning did not see the SIGTERM within 120 s")
            time.sleep(0.001)


def main(model_path: str, out: str, data: str, urls: str, secret_file: str) -> None:
    logging.basicConfig(level=logging.INFO)
    out_dir = Path(out)
    config = streaming_config(json.loads(urls), max_new_tokens=160, secret_file=secret_file, max_inflight_groups=4,
                         buffer_groups=6)
    L.seed_everything(0, verbose=False)
    module = GRPOModule(model_path, reward_funcs=[alternating_reward], config=config, learning_rate=1e-2,
                        export_dir="")
    checkpoint = ModelCheckpoint(dirpath=str(out_dir / "ckpt"), every_n_train_steps=100, save_last="link",
                                 save_on_exception=True)
    trainer = make_cpu_trainer(out_dir, 8, logger=False, callbacks=[HoldForSigterm(out_dir), checkpoint])
    trainer.fit(module, datamodule=prompt_data(data))
    (out_dir / "finished").write_text("the run finished without being stopped")
