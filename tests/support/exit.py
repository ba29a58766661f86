"""Ending a worker process without the interpreter's teardown."""

from __future__ import annotations

import os
import sys


def end_process() -> None:
    """Flush standard output and error, then end the process with status 0 at once (``os._exit``), skipping the
    interpreter's teardown: finalizing every module and object that torch, Lightning and transformers made takes ~1 s
    of a core after a run, in every rank of every multi-process test. For the rank processes whose launcher reads
    only their exit status (torchrun; Lightning's launcher for ranks > 0), once they have closed what they wrote."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def end_if_launched_rank() -> None:
    """:func:`end_process` in a rank that Lightning's launcher started (``LOCAL_RANK`` > 0). Rank 0 is the process the
    test waits for and ends as usual."""
    if int(os.environ.get("LOCAL_RANK", "0")) > 0:
        end_process()
