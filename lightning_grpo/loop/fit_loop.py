"""The generate-then-train loop.

Lightning's fit loop pulls batches from a data fetcher and runs ``training_step`` on each, stepping the
optimizer every ``accumulate_grad_batches`` batches. :class:`GRPOFitLoop` swaps in an
:class:`ExperienceFetcher`, which turns each batch of *prompts* from the user's DataLoader into a rollout
(generate, score, advantages, old/ref logprobs) and then hands out its experience micro-batch by micro-batch,
``num_iterations`` shuffled passes in all. A rollout is made only when the previous one is used up, i.e. after
the optimizer step that consumed it: rollout k+1 samples from the weights after step k.

Asynchronous rollouts (``GRPOConfig.max_staleness`` = k > 0, ``a = k // steps_per_rollout`` rollouts ahead): when a
rollout is needed, the fetcher takes the oldest prefetched one and starts the generation of the next prompt
batches in the background from the current weights until ``a`` are ahead, then makes the experience (scoring,
logprobs, advantages) of the taken one while those generate. So rollout ``j`` of an epoch is generated from the
weights at the start of rollout ``j - a`` (the epoch's first ``a + 1`` from those at the epoch's start; prompt
batches are never drawn across epochs): with one optimizer step per rollout the staleness per step is
``[0, 1, ..., a - 1, a, a, ...]``. A checkpoint first waits for the generations in flight and stores the prefetched
rollouts with their weight versions, so a resumed run trains on the same rollouts.

Everything else (optimizer steps, gradient clipping, accumulation, precision, ``max_steps``, validation,
logging, callbacks, checkpointing) is Lightning's own. ``GRPOModule.setup`` installs the loop, so a plain
``Trainer(...).fit(module, datamodule)`` runs it. Lightning's loop classes are private: the package pins
``lightning>=2.6,<2.7``.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import lightning as L
from lightning.pytorch.loops.fit_loop import _FitLoop
from typing_extensions import override

from lightning_grpo.loop.cursor import CURSOR_KEY, pending_rollouts, saved_cursors
from lightning_grpo.loop.fetcher import ExperienceFetcher, ExperienceSource
from lightning_grpo.loop.resume import REPLICAS_KEY, check_replicas, this_process
from lightning_grpo.loop.schedule import LoopPlan
from lightning_grpo.protocols.collectives import gather_per_process
from lightning_grpo.rollout.streaming import RolloutStream


class GRPOFitLoop(_FitLoop):
    """Lightning's fit loop with an :class:`ExperienceFetcher`, which runs the :class:`LoopPlan` the module hands it
    when the fit starts (:meth:`use_plan`). State (progress counters) is the base class's, so checkpoints of either
    loop load into the other; the fetcher's position is every process's
    :class:`~lightning_grpo.loop.cursor.RolloutCursor` (:data:`~lightning_grpo.loop.cursor.CURSOR_KEY`).

    A training "batch" here is one experience micro-batch; ``val_check_interval`` given as an int counts them,
    as a float it is a fraction of the epoch's micro-batches (the prompt batches times micro-batches per rollout).
    """

    def __init__(self, trainer: "L.Trainer", source: _FitLoop) -> None:
        super().__init__(trainer, min_epochs=source.min_epochs, max_epochs=source.max_epochs)
        self.epoch_loop = source.epoch_loop
        self._data_source = source._data_source  # the Trainer attached the user's datamodule/dataloaders to it
        self.resume_state: Optional[dict] = None  # this process's cursor state of a loaded checkpoint
        self.plan: Optional[LoopPlan] = None  # the module's (use_plan)
        self.stream: Optional[RolloutStream] = None  # streaming rollouts' stream, the module's (use_stream)
        self._experience: Optional[ExperienceFetcher] = None  # the fetcher setup_data made

    def use_plan(self, plan: LoopPlan) -> None:
        """The fit's schedule (the module hands it when the fit starts, and again once the token budget is resolved):
        how many micro-batches a rollout makes, how many rollouts are generated ahead, how a rollout is cut and how a
        step is planned."""
        self.plan = plan
        if self._experience is not None:
            self._experience.use_plan(plan)

    def use_stream(self, stream: Optional[RolloutStream]) -> None:
        """Streaming rollouts: make every rollout from ``stream``'s finished groups (the module hands it when training
        starts, once the engine holds the trainer's weights); None: the fixed schedule."""
        self.stream = stream
        if self._experience is not None:
            self._experience.use_stream(stream)

    @override
    def on_save_checkpoint(self) -> dict:
        """The base state plus the position inside the epoch: every process's
        :meth:`~lightning_grpo.loop.fetcher.ExperienceFetcher.state_dict` (prompt batches drawn, RNG states, a partly
        used rollout, rollouts generated ahead; streaming, the stream's state) and data-parallel replica. A collective
        under multi-process strategies (Lightning builds a checkpoint on every process)."""
        state_dict = super().on_save_checkpoint()
        fetcher = self._experience
        if fetcher is not None and fetcher is self._data_fetcher:  # not torn down
            fetcher.wait_for_rollouts()  # asynchronous: the prefetched rollouts and the RNG states are final now
            state_dict[CURSOR_KEY] = gather_per_process(fetcher.state_dict())
            state_dict[REPLICAS_KEY] = gather_per_process(self._replica())
        return state_dict

    def use_fetcher(self, fetcher: ExperienceFetcher) -> None:
        """Fetch the epoch's micro-batches with ``fetcher`` (``setup_data`` makes it)."""
        self._data_fetcher = self._experience = fetcher

    def _replica(self) -> Optional[list[int]]:
        """This process's data-parallel replica ``[sampler rank, replicas]``, None on one process."""
        kwargs = self.trainer.distributed_sampler_kwargs
        return None if kwargs is None else [int(kwargs["rank"]), int(kwargs["num_replicas"])]

    @override
    def on_load_checkpoint(self, state_dict: dict) -> None:
        """This process's cursor (:func:`~lightning_grpo.loop.cursor.saved_cursors`, which reads the earlier one-key-
        per-part layout too), applied before the resumed run's first micro-batch.

        Raises:
            ValueError: the checkpoint was written by another number of processes, or (with a partly used rollout or
                rollouts generated ahead) by other data-parallel replicas.
        """
        cursors = saved_cursors(state_dict)
        if REPLICAS_KEY in state_dict:  # a collective: every process loads the checkpoint
            check_replicas(state_dict[REPLICAS_KEY], gather_per_process(self._replica()), pending_rollouts(cursors))
        # {}: no position (e.g. a checkpoint of Lightning's own loop), refused when it stopped inside an epoch
        self.resume_state = {} if cursors is None else this_process(cursors, "rollout cursors")
        super().on_load_checkpoint(state_dict)

    @override
    def setup_data(self) -> None:
        first = self._combined_loader is None or self._should_reload_train_dl
        trainer = self.trainer
        val_check_interval = trainer.val_check_interval
        trainer.val_check_interval = 1.0  # the base class would check an int against prompt batches
        try:
            super().setup_data()
        finally:
            trainer.val_check_interval = val_check_interval
        if not first or self._combined_loader is None:
            return
        if self.plan is None:
            raise RuntimeError("GRPOFitLoop runs the LoopPlan its module hands it when the fit starts "
                               "(GRPOFitLoop.use_plan, as GRPOModule.on_fit_start does): none was handed")
        source: ExperienceSource = trainer.lightning_module  # type: ignore[assignment]
        per_rollout = self.plan.micro_batches_per_rollout()
        fetcher = ExperienceFetcher(source, self.plan, self.resume_state)
        fetcher.use_stream(self.stream)
        fetcher.setup(self._combined_loader)
        iter(fetcher)
        self.use_fetcher(fetcher)
        keep_micro_batch_dtypes(trainer, fetcher)
        if per_rollout is None:
            install_step_boundaries(self, fetcher)
            if self.max_batches != 0:
                self.max_batches = float("inf")  # the micro-batches per rollout vary: the epoch ends with the data
            if isinstance(val_check_interval, float) and val_check_interval != 1.0:
                raise ValueError(
                    f"Trainer(val_check_interval={val_check_interval}) is a fraction of an epoch, whose length in "
                    "micro-batches is unknown with GRPOConfig.max_tokens_per_microbatch: give an int (micro-batches) "
                    "or 1.0 (once per epoch)"
                )
        elif self.max_batches != float("inf"):
            self.max_batches = int(self.max_batches) * per_rollout
        if trainer._val_check_time_interval is not None or self.max_batches == 0:  # Lightning 2.6 (canary test)
            return
        if isinstance(val_check_interval, int):
            trainer.val_check_batch = val_check_interval
        elif self.max_batches != float("inf"):
            trainer.val_check_batch = max(1, int(self.max_batches * val_check_interval))


def install_step_boundaries(loop: GRPOFitLoop, fetcher: ExperienceFetcher) -> None:
    """Let the micro-batches' ``step_start``/``step_end`` flags, not a count, decide where Lightning zeroes the
    gradients and steps the optimizer (token-budget micro-batches: ``Trainer(accumulate_grad_batches=1)`` and a
    varying number of micro-batches per step). Patches two private methods of Lightning 2.6's training epoch loop
    on this instance only."""
    epoch_loop = loop.epoch_loop
    accumulation = epoch_loop.automatic_optimization
    count_reached = type(epoch_loop)._accumulated_batches_reached.__get__(epoch_loop)
    count_zero_grad = type(accumulation)._make_zero_grad_fn.__get__(accumulation)

    def accumulated_batches_reached() -> bool:
        current = fetcher.current
        return count_reached() if current is None else current.step_end

    def make_zero_grad_fn(batch_idx: int, optimizer: Any) -> Any:
        zero_grad = count_zero_grad(batch_idx, optimizer)
        current = fetcher.current
        return zero_grad if current is None or current.step_start else None

    epoch_loop._accumulated_batches_reached = accumulated_batches_reached  # type: ignore[method-assign]
    accumulation._make_zero_grad_fn = make_zero_grad_fn  # type: ignore[method-assign]


def keep_micro_batch_dtypes(trainer: "L.Trainer", fetcher: ExperienceFetcher) -> None:
    """Hand the fetcher's experience micro-batches to ``training_step`` as they are: the precision plugin's input
    conversion (``Trainer(precision="bf16-true")``, ``"16-true"``: every floating-point tensor of a batch to the half
    dtype) would round their float32 advantages and old / reference / sampler logprobs to 8 bits of mantissa (the
    first step's ratio would no longer be exactly 1) and refuses their frozen step plans. The model's inputs are token
    ids; the policy casts images to its own dtype. Other batches (validation prompts) are converted as before. Wraps
    the public ``convert_input`` of this trainer's precision plugin, on this instance only."""
    plugin = trainer.precision_plugin
    convert = type(plugin).convert_input.__get__(plugin)

    def convert_input(data: Any) -> Any:
        return data if data is fetcher.current else convert(data)

    plugin.convert_input = convert_input  # type: ignore[method-assign]


#: The loops installed (so that installing is idempotent without asking the trainer's loop its type). A weak set of
#: the loops, not a map from trainers: a loop holds its trainer, so a map's values would keep every trainer (and its
#: model, optimizer and engine) alive for the life of the process.
_INSTALLED: "weakref.WeakSet[GRPOFitLoop]" = weakref.WeakSet()


def install_loop(trainer: "L.Trainer") -> GRPOFitLoop:
    """Replace ``trainer.fit_loop`` with a :class:`GRPOFitLoop` (idempotent). Returns the installed loop."""
    for loop in _INSTALLED:
        if trainer.fit_loop is loop:
            return loop
    loop = GRPOFitLoop(trainer, trainer.fit_loop)
    _INSTALLED.add(loop)
    trainer.fit_loop = loop
    return loop
