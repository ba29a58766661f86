"""GRPO runs under MegatronStrategy with pipeline parallelism and the distributed optimizer, for
``tests/strategies/test_megatron_pipeline.py``; launched with torchrun (CPU processes, gloo):

    python -m torch.distributed.run --standalone --nproc_per_node=N tests/support/megatron_pp_worker.py OUT RUNS_JSON

``RUNS_JSON`` is a list of :func:`run_steps` keyword arguments with a ``name``; each run writes
``OUT/<name>_rank<r>.json`` (per-step losses, gradient norms) and rank 0 ``OUT/<name>_weights.pt`` (the trained
HF weights). The same :func:`run_steps` makes the single-process references in the test itself.
"""

from __future__ import annotations

import gc
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import json  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Optional  # noqa: E402

sys.path[:0] = [str(Path(__file__).resolve().parents[i]) for i in (2, 1)]  # the checkout, tests/ (for support.*)

collecting = gc.isenabled()  # the cyclic collector is paused while the libraries below are imported
gc.disable()  # (why: lightning_grpo/__init__.py)
import torch  # noqa: E402

warnings.filterwarnings("ignore", message=".*(Transformer Engine|Apex|TE|apex).*")

from lightning_grpo import GRPOConfig, GRPOModule  # noqa: E402
from support.megatron_worker import FixedRolloutEngine, LossRecorder, char_sum_reward  # noqa: E402

if collecting:
    gc.enable()

LEARNING_RATES = {"sgd": 2.0, "adamw": 1e-3}


class ChosenOptimizerModule(GRPOModule):
    """A GRPOModule whose optimizer is ``optimizer_kind``: "sgd" (momentum 0.9: a linear update whose state, the
    momentum buffer, a resume must restore) or "adamw"."""

    optimizer_kind = "sgd"

    def configure_optimizers(self) -> Any:
        params = [p for p in self.policy.parameters() if p.requires_grad]
        if self.optimizer_kind == "sgd":
            return torch.optim.SGD(params, lr=self.hparams.learning_rate, momentum=0.9)
        return torch.optim.AdamW(params, lr=self.hparams.learning_rate, betas=(0.9, 0.99))


def make_module(model_path: str, optimizer: str, engine_kind: str, **config: Any) -> ChosenOptimizerModule:
    """beta 0.04 (reference logprobs), G=4, two optimizer steps per rollout over the whole batch (the second one
    off-policy: old logprobs), a fixed rollout engine (the same experience in every layout) or HF ``generate``."""
    config = {"num_generations": 4, "max_new_tokens": 6, "beta": 0.04, "temperature": 0.8, "loss_type": "bnpo",
              "num_iterations": 2, **config}
    module = ChosenOptimizerModule(model_path, reward_funcs=[char_sum_reward], config=GRPOConfig.from_dict(config),
                                   learning_rate=LEARNING_RATES[optimizer], export_dir="")
    module.optimizer_kind = optimizer
    if engine_kind == "fixed":  # else the engine group of ``config`` (``{"engine": {"name": ...}}``)
        module.rollout_engine = FixedRolloutEngine(module.tokenizer.eos_token_id, module.tokenizer.pad_token_id)
    return module


def run_steps(model_path: str, data_path: str, strategy: Any, devices: int, prompts_per_step: int,
              max_steps: int = 2, accumulate: int = 1, clip: Optional[float] = None, optimizer: str = "sgd",
              engine: str = "fixed", checkpoint_dir: Optional[str] = None, resume: Optional[str] = None,
              kill_at: Optional[int] = None, config: Optional[dict] = None, probes: Optional[list] = None,
              distributed_sampler: bool = True) -> tuple[Any, list[float], list[float], list[float]]:
    """A GRPO fit of ``max_steps`` optimizer steps; returns the module (an HF policy again after fit), the logged
    per-step losses, the gradient norms before clipping and ``rollout/staleness_max`` per step.

    ``engine``: "fixed" (:class:`FixedRolloutEngine`) or "config" (``GRPOConfig.engine.name`` from ``config``,
    more :class:`GRPOConfig` fields); ``checkpoint_dir``: a checkpoint after every step; ``resume``: the checkpoint
    to continue from; ``kill_at``: SIGKILL every process once step ``kill_at`` is checkpointed;
    ``distributed_sampler=False``: the datamodule's own prompt order in every layout (for one data-parallel
    replica, compared with a single process); ``probes``: a list that gets, right after each rollout, the policy's
    teacher-forced probe logprobs and (on global rank 0) the engine's (:func:`probe_after_sync`)."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    from lightning_grpo.data import PromptDataModule

    class KillAfterCheckpoint(Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if trainer.global_step == kill_at and batch.step_start:
                trainer.strategy.barrier()  # every process has seen the checkpoint written
                os.kill(os.getpid(), signal.SIGKILL)

    class Staleness(Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch.step_end:
                staleness.append(float(trainer.callback_metrics["rollout/staleness_max"]))

    L.seed_everything(0, verbose=False)
    module = make_module(model_path, optimizer, engine, **(config or {}))
    recorder = LossRecorder.make()
    staleness: list[float] = []
    callbacks: list[Any] = [recorder, Staleness()]
    if probes is not None:
        callbacks.append(probe_after_sync(probes))
    if checkpoint_dir is not None:
        callbacks.append(ModelCheckpoint(dirpath=checkpoint_dir, save_last=True, every_n_train_steps=1, save_top_k=-1))
    if kill_at is not None:
        callbacks.append(KillAfterCheckpoint())
    trainer = L.Trainer(
        max_steps=max_steps, accelerator="cpu", devices=devices, strategy=strategy, logger=False,
        enable_checkpointing=checkpoint_dir is not None, enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks, gradient_clip_val=clip, accumulate_grad_batches=accumulate,
        use_distributed_sampler=distributed_sampler,
    )
    data = PromptDataModule(dataset=data_path, prompts_per_step=prompts_per_step, val_size=0)
    trainer.fit(module, datamodule=data, ckpt_path=resume)
    return module, recorder.losses, recorder.grad_norms, staleness


def probe_after_sync(probes: list) -> Any:
    """A callback that, at the first micro-batch after each rollout (the engine holds the weights synced before it),
    appends ``{"policy": (S, L-1) logprobs, "engine": ... or None}``: the policy's teacher-forced logprobs of the
    rollout server's probe batch (every rank: a collective) and, on global rank 0 (the generating rank), the
    colocated vLLM engine's or the rollout server's for the same sequences."""
    from lightning.pytorch.callbacks import Callback

    from lightning_grpo.rollout.engines.probe import probe_sequences
    from lightning_grpo.rollout.server.client import ServerClient

    class Probe(Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx % trainer.fit_loop.plan.micro_batches_per_rollout() != 0:
                return
            sequences = probe_sequences(min(len(module.tokenizer), module.policy.config.vocab_size))
            entry = {"policy": module.policy.teacher_forced_logprobs(sequences).tolist(), "engine": None}
            if trainer.global_rank == 0:
                engine = module.rollout_engine.engine
                if module.config.engine.name == "vllm":
                    entry["engine"] = engine.teacher_forced_logprobs(sequences)
                else:
                    (url,) = module.config.engine.server_urls
                    entry["engine"] = ServerClient(url, 60).request("POST", "/probe_logprobs",
                                                                    {"sequences": sequences})["logprobs"]
            probes.append(entry)

    return Probe()


def main(argv: list[str]) -> None:
    from lightning_grpo.strategies.megatron.strategy import MegatronStrategy

    out = Path(argv[0])
    rank = int(os.environ["RANK"])
    for run in json.loads(argv[1]):
        run = dict(run)
        name = run.pop("name")
        layout = run.pop("layout")  # MegatronStrategy keyword arguments
        world = int(os.environ["WORLD_SIZE"])
        data_parallel = world // (layout.get("tensor_model_parallel_size", 1) *
                                  layout.get("pipeline_model_parallel_size", 1))
        run.setdefault("prompts_per_step", 4 // data_parallel)
        probes: Optional[list] = [] if run.pop("probe", False) else None
        module, losses, norms, staleness = run_steps(strategy=MegatronStrategy(**layout), devices=world,
                                                     probes=probes, **run)
        (out / f"{name}_rank{rank}.json").write_text(json.dumps({"losses": losses, "grad_norms": norms,
                                                                 "staleness": staleness, "probes": probes,
                                                                 "policy_type": type(module.policy).__name__}))
        if rank == 0:
            torch.save(module.policy.state_dict(), out / f"{name}_weights.pt")
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
    from support.exit import end_process

    end_process()
