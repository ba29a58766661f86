"""A logger made to emit a level for the length of a test, whatever the process's logging set-up (an earlier test in
the same worker, or a library it imported, may have raised the logger's level or called ``logging.disable``)."""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator


@contextlib.contextmanager
def emitting(name: str, level: int = logging.DEBUG) -> Iterator[logging.Logger]:
    """The logger ``name`` with records at ``level`` and above created (its own level ``level``, ``logging.disable``
    lifted, not disabled); restored on exit."""
    logger = logging.getLogger(name)
    saved = logger.level, logger.disabled, logging.root.manager.disable
    logger.setLevel(level)
    logger.disabled = False
    logging.disable(logging.NOTSET)
    try:
        yield logger
    finally:
        logger.setLevel(saved[0])
        logger.disabled = saved[1]
        logging.disable(saved[2])
