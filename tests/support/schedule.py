"""Which test files the two pytest-xdist workers run side by side (``scripts/test.sh``: ``-n 2 --dist loadfile``).

xdist's ``loadfile`` hands each free worker the next whole file, those with the most tests first. Two files that
each train on several processes at once (torchrun Megatron layouts, FSDP and DDP runs: 2 to 4 ranks of one torch
thread, synchronising at every collective) then run at the same time on a 2-core machine: up to eight ranks on two
cores, where each collective waits for a rank the kernel has descheduled (a TP2xPP2 test's setup took 99 s beside
another Megatron file against 61 s beside single-process tests; tests/README.md). :class:`MultiProcessFilesInOneChain`
makes those files one unit of work, run one after another by one worker, first; the other worker meanwhile runs
the single-process files, and whichever frees first takes the next file as before.
"""

from __future__ import annotations

from xdist.scheduler import LoadFileScheduling

#: Files whose tests train on two or more processes at once (rank processes of gloo collectives), relative to the
#: repository root as in pytest's node ids. Servers and their clients (one busy process at a time) are not here.
MULTI_PROCESS_FILES = frozenset({
    "tests/episodes/test_multiturn_distributed.py",
    "tests/evaluation/test_eval_distributed.py",
    "tests/launch/test_multinode_loopback.py",
    "tests/rewards/test_reward_model_distributed.py",
    "tests/strategies/test_ddp.py",
    "tests/strategies/test_fsdp.py",
    "tests/strategies/test_megatron_engines.py",
    "tests/strategies/test_megatron_experts.py",
    "tests/strategies/test_megatron_pipeline.py",
    "tests/strategies/test_megatron_strategy.py",
    "tests/test_vision_training.py",
})

#: The unit of work those files make together.
CHAIN = "multi-process files, one after another"


class MultiProcessFilesInOneChain(LoadFileScheduling):
    """``--dist loadfile``, but the :data:`MULTI_PROCESS_FILES` are one unit (:data:`CHAIN`), handed out first."""

    def _split_scope(self, nodeid: str) -> str:
        path = super()._split_scope(nodeid)
        return CHAIN if path in MULTI_PROCESS_FILES else path

    def _assign_work_unit(self, node) -> None:
        if CHAIN in self.workqueue:
            self.workqueue.move_to_end(CHAIN, last=False)
        super()._assign_work_unit(node)
