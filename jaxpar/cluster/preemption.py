"""Preemption: SIGTERM (what SLURM sends before it kills a job) noted and agreed on by every process, so all of
them stop at the same step boundary with a checkpoint; `train.py` exits with PREEMPTED_EXIT_CODE."""
from __future__ import annotations

import functools

import jax
import numpy as np

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): "try again"; the SLURM template requeues on it


class Preempted(Exception):
    """Raised after SIGTERM once a complete checkpoint of step `step` is on disk; train.py exits with
    PREEMPTED_EXIT_CODE."""

    def __init__(self, step: int):
        super().__init__(f"preempted (SIGTERM): checkpoint of step {step} saved; rerun the same command to resume.")
        self.step = step


class PreemptionWatch:
    """Notes SIGTERM (what SLURM sends before it kills a job, `#SBATCH --signal`) and, at each step boundary, says
    whether to stop there. With several processes every one stops at the same step, and no boundary waits for the
    step just queued: each boundary queues an all-reduce of the processes' flags (`any_process`, a tiny program
    that runs behind the step) and reads the one queued at the boundary before, which the devices finished long
    ago. A signal seen by any process stops all of them one boundary later than a single process stops."""

    def __init__(self, agree=None):
        import signal

        self.requested = False
        self._signal = signal
        self._previous = signal.signal(signal.SIGTERM, self._note)
        self._agree = agree if agree is not None else any_process if jax.process_count() > 1 else None
        self._pending = None

    def _note(self, signum, frame):
        self.requested = True

    def reached(self) -> bool:
        if self._agree is None:
            return self.requested
        previous, self._pending = self._pending, self._agree(self.requested)  # queued, not read
        return previous is not None and bool(previous)

    def close(self):
        self._signal.signal(self._signal.SIGTERM, self._previous)


def any_process(flag: bool) -> jax.Array:
    """Whether any process's `flag` is set: an all-reduce over every device, returned unread (asynchronous)."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("processes",))
    local = np.full((jax.local_device_count(),), bool(flag))
    flags = jax.make_array_from_process_local_data(jax.NamedSharding(mesh, jax.P("processes")), local)
    return _any(flags, jax.NamedSharding(mesh, jax.P()))


@functools.partial(jax.jit, static_argnums=1)
def _any(flags, replicated):
    return jax.lax.with_sharding_constraint(flags.any(), replicated)
