"""A streaming GRPO fit on the shared rollout servers, run as its own process for the SIGTERM test
(``tests/rollout/server/test_streaming_fit.py``)::

    forked.start("support.streaming_worker:main", model, out, data, urls_json, secret_file, frozen_pid, log=...)

:func:`streaming_config` and :func:`prompt_data` make the test file's runs too (each with its own limits); this run:
G = 2, 160 new tokens, 4 groups in flight, 6 held. After each optimizer step the step's prompt keys are appended to
``<out>/trained.jsonl``.

The gate, on the servers rather than on their speed (:class:`HoldForSigterm`): when a step from the second on starts
(its groups taken, the weights sent), the process freezes the server ``frozen_pid`` (SIGSTOP: whatever it was asked
stays unanswered); if that server holds a group, after the step, once the stream holds a finished group, their keys
are written to ``<out>/groups_held`` and the process sends itself SIGTERM and waits for Lightning to see it; if not, it
thaws the server and tries at the next step, up to step ``LAST_TRY``. The test thaws the server (SIGCONT) when this
process has ended. The only checkpoint callback saves on exception, so the checkpoint in ``<out>/ckpt`` is the
SIGTERM's.
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

#: The fewest optimizer steps taken before the SIGTERM, and the step by which it must have come.
STEPS_BEFORE_SIGTERM, LAST_TRY = 2, 6
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


def pool_server(module, url: str):
    """The streaming pool's entry for the server at ``url`` (its ``in_flight`` count of groups sent, unanswered)."""
    (server,) = [s for s in module.streaming_engine.servers if s.url == url]
    return server


def holds_frozen_group(pid: int, held) -> bool:
    """Freeze the server process ``pid`` (SIGSTOP) and say whether a group the pool sent it is still unanswered half a
    second later (``held``: its :func:`pool_server` entry; an answer already on its way has arrived by then). A frozen
    server cannot answer, so that group stays in flight for as long as it is frozen, whatever the servers' speed. The
    caller thaws (SIGCONT) or kills it."""
    os.kill(pid, signal.SIGSTOP)
    time.sleep(0.5)
    return held.in_flight > 0


class HoldForSigterm(GRPOCallback):
    """The gate of the module docstring. When a step from the second on starts, freeze the server of ``frozen_pid``
    (:func:`holds_frozen_group`): armed when it still holds a group and the stream holds a finished group or one in
    flight elsewhere, else thawed, to try again at the next step (whether
    a group is in flight there when a step starts depends on the stream's draws). After an armed step, once a
    finished group is held, if the frozen server still holds its group: write ``groups_held``, SIGTERM; else thaw and
    try again."""

    def __init__(self, out: Path, frozen_url: str, frozen_pid: int) -> None:
        self.out, self.frozen_url, self.frozen_pid = out, frozen_url, frozen_pid
        self.keys: list[list[int]] = []
        self.armed = False

    def _state(self, module) -> tuple[list[int], list[int]]:
        buffer = module.rollout_stream.buffer
        with buffer.cond:
            return [g.key for g in buffer.ready], list(buffer.in_flight)

    def on_rollout_end(self, trainer, module, rollout):
        self.keys.append(rollout.prompt_keys[::module.config.num_generations])

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if not batch.step_start or trainer.global_step < STEPS_BEFORE_SIGTERM - 1:
            return
        if trainer.global_step >= LAST_TRY:
            raise AssertionError(f"no step before {LAST_TRY} started with a group on the frozen server")
        frozen = pool_server(module, self.frozen_url)
        holds = holds_frozen_group(self.frozen_pid, frozen)
        ready, in_flight = self._state(module)
        self.armed = holds and (bool(ready) or len(in_flight) > frozen.in_flight)
        if not self.armed:
            os.kill(self.frozen_pid, signal.SIGCONT)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if not batch.step_end:
            return
        with open(self.out / "trained.jsonl", "a") as f:
            f.write(json.dumps({"step": trainer.global_step - 1, "keys": self.keys[-1]}) + "\n")
        if not self.armed:
            return
        self.armed = False
        deadline = time.monotonic() + 120
        while not (state := self._state(module))[0]:  # the other server's groups finish
            if time.monotonic() > deadline:
                raise AssertionError(f"the stream held no finished group within 120 s: {state}")
            time.sleep(0.01)
        if pool_server(module, self.frozen_url).in_flight == 0:
            os.kill(self.frozen_pid, signal.SIGCONT)
            return
        ready, in_flight = state
        (self.out / "groups_held").write_text(json.dumps({"ready": ready, "in_flight": in_flight,
                                                         "steps": trainer.global_step}))
        os.kill(os.getpid(), signal.SIGTERM)
        while not trainer.received_sigterm:
            if time.monotonic() > deadline + 120:
                raise AssertionError("Lightning did not see the SIGTERM within 120 s")
            time.sleep(0.001)


def main(model_path: str, out: str, data: str, urls: str, secret_file: str, frozen_pid: str) -> None:
    """The run of the module docstring; ``urls`` a JSON list, the last one the server of ``frozen_pid``."""
    logging.basicConfig(level=logging.INFO)
    out_dir = Path(out)
    servers = json.loads(urls)
    config = streaming_config(servers, max_new_tokens=160, secret_file=secret_file, max_inflight_groups=4,
                         buffer_groups=6)
    L.seed_everything(0, verbose=False)
    module = GRPOModule(model_path, reward_funcs=[alternating_reward], config=config, learning_rate=1e-2,
                        export_dir="")
    checkpoint = ModelCheckpoint(dirpath=str(out_dir / "ckpt"), every_n_train_steps=100, save_last="link",
                                 save_on_exception=True)
    hold = HoldForSigterm(out_dir, servers[-1], int(frozen_pid))
    trainer = make_cpu_trainer(out_dir, 8, logger=False, callbacks=[hold, checkpoint])
    trainer.fit(module, datamodule=prompt_data(data))
    (out_dir / "finished").write_text("the run finished without being stopped")
