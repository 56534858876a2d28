"""How a failed checkpoint save reaches the user: `CheckpointSaveError` (a full disk says the bytes free and needed
and what to do), and the Orbax noise around a failed save cut down (one line per log record from its background
threads; asyncio's echoes of the same failure dropped)."""
from __future__ import annotations

import errno
import logging
import os
import sys

import jax
import numpy as np


class CheckpointSaveError(RuntimeError):
    """A checkpoint save failed (raised synchronously, or at the next `save`/`wait`/`close` for an async one).

    `step` is the step whose save failed; the original error is chained as `__cause__`. Older complete
    checkpoints are left on disk.
    """

    def __init__(self, step: int | None, cause: BaseException, full: str = ""):
        self.step = step
        where = f"step {step}" if step is not None else "a step"
        why = full or f"{type(cause).__name__}: {cause}"
        super().__init__(f"checkpoint save of {where} failed: {why}")


def disk_full(error: BaseException) -> bool:
    """Whether `error` (or what it was raised from) is a write into a full disk (ENOSPC, also as tensorstore says)."""
    while error is not None:
        if getattr(error, "errno", None) == errno.ENOSPC or "No space left on device" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def tree_bytes(tree) -> int:
    """Bytes of every array in `tree` (global sizes): about what a checkpoint of it writes."""
    return int(sum(np.prod(np.shape(a)) * np.dtype(getattr(a, "dtype", np.float32)).itemsize
                   for a in jax.tree.leaves(tree)))


class _OneLineOrbaxErrors(logging.Filter):
    """Orbax's background save threads log each failure with its traceback, several times over, and asyncio logs
    their tasks' exceptions again when they are collected; the failure reaches the training loop as one
    `CheckpointSaveError` naming its cause. So Orbax's records keep their first line, and asyncio's echoes of a full
    disk or of the event loop that failure closed are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "asyncio" and record.exc_info:
            value = record.exc_info[1]
            return not (disk_full(value) or _closed_loop_echo(value))
        if record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname:
            record.msg, record.args = record.getMessage().splitlines()[0][:300], None
            record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


for _name in ("absl", "asyncio"):
    logging.getLogger(_name).addFilter(_OneLineOrbaxErrors())


def _closed_loop_echo(value) -> bool:
    return isinstance(value, RuntimeError) and "Event loop is closed" in str(value)


def _ignore_closed_loop_echoes() -> None:
    """When a save fails, Orbax's other writer threads finish into the event loop the failure closed, and Python
    prints each "Event loop is closed" (as an unraisable exception, or from a callback through `sys.excepthook`).
    They echo the failure the training loop raises as one `CheckpointSaveError`: not printed."""
    if getattr(sys.unraisablehook, "jaxpar", False):
        return
    unraisable, excepthook = sys.unraisablehook, sys.excepthook

    def on_unraisable(u):
        if not _closed_loop_echo(u.exc_value):
            unraisable(u)

    def on_exception(kind, value, tb):
        if not _closed_loop_echo(value):
            excepthook(kind, value, tb)
    on_unraisable.jaxpar = True
    sys.unraisablehook, sys.excepthook = on_unraisable, on_exception


_ignore_closed_loop_echoes()
