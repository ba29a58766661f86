"""Fault tolerance on a tiny random Llama: ckpt_path="last" without last.ckpt, atomic checkpoint saves, SIGTERM
during a rollout and inside a step, non-finite losses and weights, and a step in which nothing was scored."""

import glob
import os
import signal
import stat
import tempfile
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from transformers import AutoModelForCausalLM, AutoTokenizer

from lightning_grpo import GRPOConfig, GRPOModule
from lightning_grpo.data import PromptDataModule
from lightning_grpo.protocols.rollout import RolloutInterrupted, StopFlag
from lightning_grpo.protocols.sampling import SamplingConfig
from lightning_grpo.rollout.engines.hf import HFRolloutEngine
from lightning_grpo.runtime.checkpointing import (
    PARTIAL_SUFFIX,
    AtomicCheckpointIO,
    GRPOModelCheckpoint,
    is_complete_checkpoint,
    use_last_checkpoint_fallback,
)
from lightning_grpo.training.nonfinite import NonFiniteError
from support import forked
from support.fixtures import alternating_reward, make_cpu_trainer

ROOT = Path(__file__).resolve().parents[2]


def _module(path, reward_funcs=(alternating_reward,), **config):
    config = {"num_generations": 4, "max_new_tokens": 8, "max_prompt_length": 256, **config}
    return GRPOModule(path, reward_funcs=list(reward_funcs), config=GRPOConfig(**config), learning_rate=1e-3)


def _data():
    return PromptDataModule(prompts_per_step=2, val_size=0)


class Recorder(Callback):
    """The weights at the start of training and after each optimizer step, and the optimizer steps taken."""

    def __init__(self):
        self.start, self.after_step, self.adam, self.steps = None, [], [], 0

    def on_train_start(self, trainer, module):
        self.start = {k: v.detach().clone() for k, v in module.policy.state_dict().items()}

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.steps += 1

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch.step_end:
            self.after_step.append({k: v.detach().clone() for k, v in module.policy.state_dict().items()})
            state = trainer.optimizers[0].state
            self.adam.append({i: {k: v.clone() for k, v in s.items()} for i, s in enumerate(state.values())})


def _assert_all_finite_checkpoints(folder):
    paths = sorted(glob.glob(os.path.join(folder, "*.ckpt")))
    assert paths
    for path in paths:
        saved = torch.load(path, weights_only=False)
        tensors = list(saved["state_dict"].values())
        for optimizer in saved["optimizer_states"]:
            tensors += [v for state in optimizer["state"].values() for v in state.values()]
        assert tensors and all(torch.isfinite(t).all() for t in tensors if t.is_floating_point()), path


# ---------------------------------------------------------------------------------------------- ckpt_path="last"
def _resolve_last(folder, **checkpoint_kwargs):
    """What fit(ckpt_path="last") loads, through Lightning's own resolution (with the package's extension)."""
    trainer = make_cpu_trainer(folder, 1, logger=False,
                               callbacks=[GRPOModelCheckpoint(dirpath=str(folder), **checkpoint_kwargs)])
    return trainer._checkpoint_connector._select_ckpt_path(TrainerFn.FITTING, "last", model_provided=True,
                                                           model_connected=False)


def _touch_checkpoint(path, step, mtime):
    torch.save({"step": step}, path)
    os.utime(path, (mtime, mtime))


def test_importing_the_package_leaves_lightning_alone(tmp_path, cpu_trainer):
    """No import-time patch: a plain ModelCheckpoint keeps Lightning's own resolution (no complete last.ckpt: a
    first run), and the CLI's helper upgrades only the given trainer's checkpoint callbacks."""
    assert "lightning_grpo" not in ModelCheckpoint._find_last_checkpoints.__module__
    _touch_checkpoint(tmp_path / "epoch=0-step=1.ckpt", 1, time.time())
    plain = cpu_trainer(1, logger=False, callbacks=[ModelCheckpoint(dirpath=str(tmp_path))])
    other = cpu_trainer(1, logger=False, callbacks=[ModelCheckpoint(dirpath=str(tmp_path))])
    select = (TrainerFn.FITTING, "last")
    assert plain._checkpoint_connector._select_ckpt_path(*select, model_provided=True, model_connected=False) is None
    use_last_checkpoint_fallback(plain)
    assert type(plain.checkpoint_callback) is GRPOModelCheckpoint and type(other.checkpoint_callback) is ModelCheckpoint
    with pytest.warns(UserWarning, match="no complete last checkpoint"):
        resolved = plain._checkpoint_connector._select_ckpt_path(*select, model_provided=True, model_connected=False)
    assert resolved == str(tmp_path / "epoch=0-step=1.ckpt")


def test_the_documented_path_resumes_when_a_kill_left_no_last_checkpoint(tmp_path, monkeypatch):
    """docs/resume.md's example, run up to its ``fit``, resolves ``ckpt_path="last"`` to an earlier run's step
    checkpoint when that run was killed before it wrote ``last.ckpt`` (a plain ``ModelCheckpoint`` would start
    again from step 0); and every Python recipe checkpoints with ``GRPOModelCheckpoint``."""
    import ast

    text = (ROOT / "docs" / "resume.md").read_text()
    (block,) = [b.split("\n", 1)[1] for b in text.split("```python")[1:] if "trainer.fit(" in b.split("```")[0]]
    module = ast.parse(block.split("```")[0])
    fit = module.body.pop()
    assert ast.unparse(fit).startswith("trainer.fit("), "the example ends with its fit"
    monkeypatch.chdir(tmp_path)  # the example's default_root_dir: lightning_logs/version_N
    earlier = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    earlier.mkdir(parents=True)
    _touch_checkpoint(earlier / "epoch=0-step=10.ckpt", 10, time.time() - 60)
    namespace: dict = {}
    exec(compile(module, "docs/resume.md", "exec"), namespace)
    with pytest.warns(UserWarning, match="no complete last checkpoint"):
        resolved = namespace["trainer"]._checkpoint_connector._select_ckpt_path(
            TrainerFn.FITTING, "last", model_provided=True, model_connected=False)
    assert resolved == str(earlier / "epoch=0-step=10.ckpt")
    for recipe in sorted((ROOT / "recipes").glob("*.py")):
        calls = [n.func.id for n in ast.walk(ast.parse(recipe.read_text())) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Name) and n.func.id.endswith("ModelCheckpoint")]
        assert set(calls) <= {"GRPOModelCheckpoint"}, (recipe.name, calls)


def test_last_falls_back_to_the_newest_complete_checkpoint(tmp_path):
    now = time.time()
    _touch_checkpoint(tmp_path / "epoch=0-step=1.ckpt", 1, now - 30)
    _touch_checkpoint(tmp_path / "epoch=0-step=2.ckpt", 2, now - 20)
    truncated = tmp_path / "epoch=0-step=3.ckpt"  # a save killed halfway (non-atomic IO): newest, incomplete
    truncated.write_bytes((tmp_path / "epoch=0-step=2.ckpt").read_bytes()[:100])
    assert not is_complete_checkpoint(str(truncated)) and is_complete_checkpoint(str(tmp_path / "epoch=0-step=2.ckpt"))
    with pytest.warns(UserWarning, match="no complete last checkpoint"):
        assert _resolve_last(tmp_path) == str(tmp_path / "epoch=0-step=2.ckpt")

    # a save_last="link" link whose target was removed (kill between the new step checkpoint and the new link)
    os.symlink("epoch=0-step=0.ckpt", tmp_path / "last.ckpt")
    with pytest.warns(UserWarning, match="no complete last checkpoint"):
        assert _resolve_last(tmp_path) == str(tmp_path / "epoch=0-step=2.ckpt")

    # a complete last.ckpt is Lightning's answer, as before
    os.remove(tmp_path / "last.ckpt")
    _touch_checkpoint(tmp_path / "last.ckpt", 1, now - 25)
    assert _resolve_last(tmp_path) == str(tmp_path / "last.ckpt")


def test_last_refuses_a_folder_of_incomplete_checkpoints_and_starts_fresh_in_an_empty_one(tmp_path):
    assert _resolve_last(tmp_path / "missing") is None  # a first run
    (tmp_path / "last.ckpt").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(RuntimeError, match=r"hold \['last.ckpt'\] but none is a complete checkpoint"):
        _resolve_last(tmp_path)


def test_cli_recipe_resumes_with_ckpt_path_last_from_an_earlier_logger_version(tmp_path, tiny_llama_path):
    """The YAML recipe's ModelCheckpoint has no dirpath: it saves into the logger's version folder, new for every
    run; `--ckpt_path last` finds the previous version's last.ckpt (a link, save_last="link")."""
    import yaml

    from lightning_grpo.cli import GRPOCLI

    recipe = yaml.safe_load((ROOT / "recipes" / "gsm8k_grpo.yaml").read_text())
    (checkpoint,) = [c for c in recipe["trainer"]["callbacks"] if c["class_path"].endswith("ModelCheckpoint")]
    assert checkpoint["init_args"]["save_last"] == "link" and "dirpath" not in checkpoint["init_args"]
    checkpoint["init_args"]["every_n_train_steps"] = 1
    callbacks = recipe["trainer"]["callbacks"]  # the progress bar is off below (Lightning refuses both)
    recipe["trainer"]["callbacks"] = [c for c in callbacks if not c["class_path"].endswith("GRPOProgressBar")]
    config = tmp_path / "recipe.yaml"
    config.write_text(yaml.safe_dump(recipe))

    def run(max_steps, *extra):
        return GRPOCLI(GRPOModule, PromptDataModule, save_config_kwargs={"overwrite": True}, args=[
            "fit", "--config", str(config), "--model.model", tiny_llama_path,
            "--trainer.max_steps", str(max_steps), "--trainer.accumulate_grad_batches", "1",
            "--trainer.accelerator", "cpu", "--trainer.default_root_dir", str(tmp_path),
            "--trainer.logger.init_args.save_dir", str(tmp_path), "--trainer.enable_progress_bar", "false",
            "--data.prompts_per_step", "1",
            "--data.val_size", "0", "--model.config.num_generations", "2", "--model.config.max_new_tokens", "8",
            "--model.config.engine.name", "hf", "--model.export_dir", "", *extra]).trainer

    first = run(1)
    last = tmp_path / "lightning_logs" / "version_0" / "checkpoints" / "last.ckpt"
    assert first.global_step == 1 and last.is_symlink()
    with pytest.warns(UserWarning, match="resuming from the newest complete checkpoint"):
        resumed = run(2, "--ckpt_path", "last")
    assert resumed.ckpt_path == str(last) and resumed.global_step == 2
    assert (tmp_path / "lightning_logs" / "version_1" / "checkpoints" / "epoch=0-step=2.ckpt").is_file()


# ---------------------------------------------------------------------------------------------- atomic saves
class _Probe:
    """Pickled inside the checkpoint: records which files exist while torch.save is writing."""

    seen: dict = {}

    def __init__(self, folder, temp):
        self.folder, self.temp = folder, temp

    def __reduce__(self):
        _Probe.seen = {"folder": sorted(os.listdir(self.folder)), "temp": sorted(os.listdir(self.temp))}
        return (dict, ())


class _Kill:
    def __reduce__(self):
        raise KeyboardInterrupt("killed while saving")


def test_atomic_save_writes_next_to_the_target_and_leaves_no_temp_files(tmp_path, monkeypatch):
    folder, temp = tmp_path / "ckpt", tmp_path / "systemp"
    folder.mkdir()
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    stale = folder / f".epoch=0-step=1.ckpt.abc{PARTIAL_SUFFIX}"  # left by a save killed in an earlier process
    stale.write_bytes(b"partial")
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    target = folder / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"weights": torch.arange(3.0), "probe": _Probe(folder, temp)}, target)

    (partial,) = _Probe.seen["folder"]  # while writing: only the partial file, in the checkpoint's own folder
    assert partial.startswith(".last.ckpt.") and partial.endswith(PARTIAL_SUFFIX)
    assert _Probe.seen["temp"] == []  # nothing in the system temp folder
    assert sorted(os.listdir(folder)) == ["last.ckpt"] and os.listdir(temp) == []  # the stale partial is gone
    assert torch.equal(io.load_checkpoint(target, weights_only=False)["weights"], torch.arange(3.0))
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o666 & ~umask  # as a plain open() would create it

    with pytest.raises(KeyboardInterrupt):  # interrupted save: the old checkpoint is intact, no partial remains
        io.save_checkpoint({"weights": torch.zeros(3), "kill": _Kill()}, target)
    assert sorted(os.listdir(folder)) == ["last.ckpt"]
    assert torch.equal(io.load_checkpoint(target, weights_only=False)["weights"], torch.arange(3.0))


# ---------------------------------------------------------------------------------------------- rollout stop flag
def test_hf_engine_stops_within_one_token_and_samples_as_before(tiny_llama_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    prompts = [tokenizer("What is 2 + 2?")["input_ids"]]
    sampling = SamplingConfig(max_new_tokens=40)
    polls = []
    flag = StopFlag()
    flag.watch(lambda: polls.append(1) or len(polls) >= 6)  # set from the 6th poll on
    engine = HFRolloutEngine(model, tokenizer, stop=flag)
    model.train()
    with pytest.raises(RolloutInterrupted):
        engine.generate(prompts, 2, sampling)
    assert len(polls) == 6  # once before generating, then once per token: it stopped at the 5th token
    assert model.training

    flag.watch(lambda: False)  # a flag that is never set changes nothing: same samples as an engine without one
    torch.manual_seed(0)
    watched = engine.generate(prompts, 2, sampling)
    torch.manual_seed(0)
    plain = HFRolloutEngine(model, tokenizer).generate(prompts, 2, sampling)
    assert torch.equal(watched.completion_ids, plain.completion_ids)


@pytest.mark.engine
def test_vllm_engine_aborts_between_engine_steps(tiny_llama_path, vllm_engine):
    """The pooled engine's own stop flag (what ``stop=`` sets at construction), watched from its 4th engine step."""
    polls = []
    engine = vllm_engine(tiny_llama_path)
    flag = engine.stop
    try:
        prompts = [engine.tokenizer("What is 2 + 2?")["input_ids"]] * 2
        flag.watch(lambda: polls.append(1) or len(polls) >= 4)  # set from the 4th engine step on
        with pytest.raises(RolloutInterrupted):
            engine.generate(prompts, 4, SamplingConfig(max_new_tokens=400))
        assert len(polls) == 4
        assert not engine.llm.llm_engine.has_unfinished_requests()  # the requests were aborted, not left behind
        flag.watch(None)
        out = engine.generate(prompts, 4, SamplingConfig(max_new_tokens=5))  # the engine works on
        assert out.completion_ids.shape[0] == 8 and out.completion_mask.sum(dim=1).max() <= 5
    finally:
        flag.watch(None)


# ---------------------------------------------------------------------------------------------- SIGTERM
@pytest.mark.distributed  # a training process to send SIGTERM to
def test_sigterm_during_a_rollout_saves_the_last_step_and_exits_fast(tmp_path, tiny_llama_path, cpu_trainer):
    log = tmp_path / "worker.log"  # the training process: forked from a parent with the libraries imported
    proc = forked.start("support.preemption_worker:main", tiny_llama_path, str(tmp_path), log=log,
                        env={"OMP_NUM_THREADS": "1"})
    marker = tmp_path / "rollout2_started"
    deadline = time.time() + 300
    while not marker.exists() and proc.is_alive() and time.time() < deadline:
        time.sleep(0.2)
    if not marker.exists():
        proc.kill()
        proc.join()
        raise AssertionError(f"no marker: {forked.tail(log)}")
    time.sleep(3)  # well inside the second rollout (100000 new tokens)
    sent = time.time()
    os.kill(proc.pid, signal.SIGTERM)
    proc.join(60)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise AssertionError(f"still running 60 s after SIGTERM: {forked.tail(log)}")
    elapsed = time.time() - sent
    output = log.read_text()
    assert elapsed < 30, (elapsed, output[-3000:])
    assert proc.exitcode == 0, output[-3000:]  # Lightning's SIGTERMException is a SystemExit
    assert not (tmp_path / "finished").exists()
    assert "SIGTERM: stopping at the end of the last finished optimizer step" in output

    # the checkpoint is the state after step 1: the interrupted rollout left no trace
    last = tmp_path / "ckpt" / "last.ckpt"
    assert last.is_symlink() and os.readlink(last) == "epoch=0-step=1.ckpt"
    saved = torch.load(last, weights_only=False)
    assert saved["global_step"] == 1
    (cursor,) = saved["loops"]["fit_loop"]["state_dict"]["rollout_cursors"]
    assert cursor["prompt_batches_drawn"] == 1  # not the interrupted rollout's
    assert saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["completed"] == 1
    after_step1 = torch.load(tmp_path / "after_step1.pt")
    for name, value in after_step1.items():
        assert torch.equal(saved["state_dict"][f"policy.{name}"], value), name
    assert not [p for p in os.listdir(tmp_path / "ckpt") if p.endswith(PARTIAL_SUFFIX)]

    # resuming from it ("last") runs exactly the remaining steps from those weights
    recorder = Recorder()
    resumed = cpu_trainer(3, logger=False, callbacks=[recorder, ModelCheckpoint(dirpath=str(tmp_path / "ckpt"),
                                                                                save_last="link")])
    resumed.fit(_module(tiny_llama_path), datamodule=_data(), ckpt_path="last")
    assert resumed.global_step == 3 and recorder.steps == 2
    for name, value in after_step1.items():
        assert torch.equal(recorder.start[name], value), name


class _SigtermInsideStep(Callback):
    """Sends SIGTERM to this process after the first micro-batch of optimizer step 2 (2 micro-batches per step)."""

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == 1 and not batch.step_end:
            os.kill(os.getpid(), signal.SIGTERM)


def test_sigterm_inside_a_step_stops_at_its_end(tmp_path, tiny_llama_path, cpu_trainer):
    recorder = Recorder()
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=100, save_on_exception=True)
    trainer = cpu_trainer(4, logger=False, accumulate_grad_batches=2,
                          callbacks=[_SigtermInsideStep(), recorder, checkpoint])
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SIGTERMException):
        trainer.fit(_module(tiny_llama_path), datamodule=_data())
    assert signal.getsignal(signal.SIGTERM) == handler  # Lightning restored it
    assert trainer.global_step == 2 and recorder.steps == 2  # step 2 was finished, step 3 never started
    (path,) = glob.glob(str(tmp_path / "ckpt" / "*.ckpt"))
    saved = torch.load(path, weights_only=False)
    assert saved["global_step"] == 2
    progress = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]
    assert progress["completed"] == 4  # 2 steps x 2 micro-batches: a step boundary
    for name, value in recorder.after_step[1].items():
        assert torch.equal(saved["state_dict"][f"policy.{name}"], value), name


# ---------------------------------------------------------------------------------------------- non-finite numbers
class _NaNInTrainingForward(Callback):
    """A faithful NaN: the first decoder layer's output turns NaN in the training forward of optimizer step 2 (as an
    overflow would), so the loss, the gradients and the gradient norm are NaN. Rollouts and no-grad passes are
    untouched."""

    def on_train_start(self, trainer, module):
        def poison(layer, args, output):
            if torch.is_grad_enabled() and trainer.global_step == 1:
                hidden = output[0] if isinstance(output, tuple) else output
                hidden = hidden * float("nan")
                return (hidden, *output[1:]) if isinstance(output, tuple) else hidden
            return output

        module.policy.model.layers[0].register_forward_hook(poison)


def test_nonfinite_loss_stops_the_run_before_the_step(tmp_path, tiny_llama_path, cpu_trainer):
    recorder = Recorder()
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=1, save_top_k=-1)
    trainer = cpu_trainer(3, logger=False, callbacks=[_NaNInTrainingForward(), recorder, checkpoint])
    module = _module(tiny_llama_path)
    with pytest.raises(NonFiniteError, match=r"optimizer step 2 \(global_step=1\): non-finite loss=nan, grad_norm=nan"):
        trainer.fit(module, datamodule=_data())
    assert trainer.global_step == 1
    for name, value in module.policy.state_dict().items():  # the NaN step was not taken
        assert torch.equal(value, recorder.after_step[0][name]), name
    _assert_all_finite_checkpoints(tmp_path / "ckpt")


def test_nonfinite_loss_is_skipped_with_on_nonfinite_skip(tmp_path, tiny_llama_path, cpu_trainer, metrics_rows):
    recorder = Recorder()
    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=1, save_top_k=-1)
    trainer = cpu_trainer(3, callbacks=[_NaNInTrainingForward(), recorder, checkpoint],
                          logger=CSVLogger(str(tmp_path), name="logs"))
    trainer.fit(_module(tiny_llama_path, on_nonfinite="skip"), datamodule=_data())
    assert type(trainer.strategy.checkpoint_io) is AtomicCheckpointIO  # installed by GRPOModule.setup
    assert trainer.global_step == 3 and len(recorder.after_step) == 3
    first, skipped, third = recorder.after_step
    for name in first:  # the skipped step changed no weight (bitwise) and no Adam state; the next one trained
        assert torch.equal(skipped[name], first[name]), name
    assert any(not torch.equal(third[name], first[name]) for name in first)
    assert all(torch.isfinite(v).all() for v in third.values())
    for index, state in recorder.adam[0].items():
        for key, value in state.items():
            assert torch.equal(recorder.adam[1][index][key], value), (index, key)
    rows = metrics_rows("nonfinite_steps")
    assert [float(r["nonfinite_steps"]) for r in rows] == [0.0, 1.0, 1.0]
    _assert_all_finite_checkpoints(tmp_path / "ckpt")
    assert torch.load(tmp_path / "ckpt" / "epoch=0-step=3.ckpt", weights_only=False)[
        "lightning_grpo_nonfinite"] == {"skipped": 1}


class _CorruptAfterStep1(Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if batch.step_end and trainer.global_step == 1:
            with torch.no_grad():
                module.policy.model.layers[1].mlp.up_proj.weight[0, 0] = float("inf")


def test_nonfinite_weights_are_never_sampled_from_or_saved(tmp_path, tiny_llama_path, cpu_trainer):
    trainer = cpu_trainer(3, logger=False, callbacks=[_CorruptAfterStep1()])
    with pytest.raises(NonFiniteError, match=r"non-finite weights before sampling a rollout: "
                                             r"model\.layers\.1\.mlp\.up_proj\.weight \(1 tensors\)"):
        trainer.fit(_module(tiny_llama_path), datamodule=_data())
    assert trainer.global_step == 1

    checkpoint = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=1)
    trainer = cpu_trainer(3, logger=False, callbacks=[_CorruptAfterStep1(), checkpoint])
    with pytest.raises(NonFiniteError, match=r"refusing to save a checkpoint with non-finite values in "
                                             r"state_dict\['policy\.model\.layers\.1\.mlp\.up_proj\.weight'\]"):
        trainer.fit(_module(tiny_llama_path), datamodule=_data())
    assert not glob.glob(str(tmp_path / "ckpt" / "*.ckpt"))


# ---------------------------------------------------------------------------------------------- nothing scored
def _reward_none(prompts, completions, **kwargs):
    return [None] * len(completions)


def test_a_step_without_any_reward_logs_nan_reward_and_zero_tokens(tmp_path, tiny_llama_path, caplog, cpu_trainer,
                                                                   metrics_rows):
    trainer = cpu_trainer(1, logger=CSVLogger(str(tmp_path), name="logs"))
    with caplog.at_level("WARNING"):
        trainer.fit(_module(tiny_llama_path, reward_funcs=[_reward_none]), datamodule=_data())
    (row,) = metrics_rows("loss")
    for key in ("reward", "reward_std", "frac_reward_zero_std", "rewards/_reward_none/mean", "entropy",
                "clip_ratio/region_mean"):
        assert row[key] == "nan", (key, row[key])
    assert float(row["num_tokens"]) == 0.0
    assert float(row["frac_reward_unscored"]) == 1.0
    assert float(row["loss"]) == 0.0
    messages = [r.getMessage() for r in caplog.records]
    assert any("no completion of this rollout was scored" in m for m in messages)
    assert any("no loss tokens" in m for m in messages)
