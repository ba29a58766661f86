"""Every private Lightning name the package uses still exists (the package pins lightning>=2.6,<2.7): an upgrade that
renames one fails here, loudly, instead of misbehaving in a run.

The list is kept by hand; `grep -rn "\\._[a-z]" lightning_grpo` and the `@override`s name the places."""

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loops.fetchers import _DataFetcher
from lightning.pytorch.loops.fit_loop import _FitLoop
from lightning.pytorch.loops.optimization.automatic import _AutomaticOptimization
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

#: (where, the private attribute): classes and the attributes the package reads, calls or overrides.
CLASS_ATTRIBUTES = [
    (_TrainingEpochLoop, "_accumulated_batches_reached"),  # loop/fit_loop.install_step_boundaries
    (_AutomaticOptimization, "_make_zero_grad_fn"),  # loop/fit_loop.install_step_boundaries
    (ModelCheckpoint, "_find_last_checkpoints"),  # runtime/checkpointing.GRPOModelCheckpoint
    (ModelCheckpoint, "_ModelCheckpoint__resolve_ckpt_dir"),
    (LightningCLI, "_add_configure_optimizers_method_to_model"),  # cli.GRPOCLI (--optimizer, --lr_scheduler)
    (LightningCLI, "_get"),
]

#: Attributes set on instances (constructed without arguments).
INSTANCE_ATTRIBUTES = [
    (_DataFetcher, "_start_profiler"),  # loop/fetcher.ExperienceFetcher.__next__
    (_DataFetcher, "_stop_profiler"),
    (TQDMProgressBar, "_train_progress_bar"),  # callbacks/progress (the bar's refresh thread)
]

#: Attributes of a constructed Trainer (and its fit loop) the package reads.
TRAINER_ATTRIBUTES = ["_signal_connector", "_accelerator_connector", "_val_check_time_interval",
                      "_checkpoint_connector"]
FIT_LOOP_ATTRIBUTES = ["_data_source", "_data_fetcher", "_combined_loader", "_should_reload_train_dl", "epoch_loop"]


@pytest.mark.parametrize("owner, name", CLASS_ATTRIBUTES, ids=lambda x: getattr(x, "__name__", x))
def test_the_private_class_attributes_exist(owner, name):
    assert hasattr(owner, name), f"Lightning {L.__version__}: {owner.__name__}.{name} is gone"


@pytest.mark.parametrize("owner, name", INSTANCE_ATTRIBUTES, ids=lambda x: getattr(x, "__name__", x))
def test_the_private_instance_attributes_exist(owner, name):
    assert hasattr(owner(), name), f"Lightning {L.__version__}: {owner.__name__}().{name} is gone"


def test_the_private_trainer_and_loop_attributes_exist(tmp_path):
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        default_root_dir=str(tmp_path))
    missing = [n for n in TRAINER_ATTRIBUTES if not hasattr(trainer, n)]
    missing += [f"fit_loop.{n}" for n in FIT_LOOP_ATTRIBUTES if not hasattr(trainer.fit_loop, n)]
    assert isinstance(trainer.fit_loop, _FitLoop) and not missing, f"Lightning {L.__version__}: {missing} are gone"
    assert hasattr(trainer._accelerator_connector, "cluster_environment")
    assert hasattr(trainer._signal_connector, "received_sigterm") or hasattr(trainer, "received_sigterm")
