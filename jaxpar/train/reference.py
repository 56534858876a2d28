"""DPO's precomputed reference (`dpo.precompute_reference`, TRL's `precompute_ref_log_probs`).

Before the first step, one pass of the reference model (the initial policy; with LoRA its base, the adapters off)
goes over every preference pair of the train and validation splits. Each pair's two sums of response-token
log-probs (chosen, rejected) are written to the run directory, `reference_logps/<split>-<k>.npy` (float64
`[pairs, 2]`, by document of source k's packed split), and come with every batch as `ref`, so training holds no
reference weights and runs no reference forward pass. They live beside the run's checkpoints, not in the shared
prepared-data cache, because they belong to this run's initial weights: a resumed run reads them back (its policy
has moved on, so they are never recomputed after step 0).
"""
from __future__ import annotations

import os

import jax
import numpy as np

from jaxpar.data import DataError

DIR = "reference_logps"


def path(workdir: str, split: str, k: int) -> str:
    return os.path.join(workdir, DIR, f"{split}-{k}.npy")


def compute(batches, k: int, run, rows: tuple[int, int]) -> np.ndarray:
    """Source k's table: its packed rows in global batches (the last one filled up with repeats, whose sums are
    dropped), `run(this process's rows) -> [global batch, pairs per row, 2]`; `rows`: this process's [start, stop)."""
    packed, B = batches.packed[k], batches.global_batch
    table = np.full((packed.sizes.size, 2), np.nan)
    for first in range(0, packed.num_samples, B):
        idx = np.minimum(np.arange(first, first + B), packed.num_samples - 1)
        out = run(batches.source_rows(k, idx[rows[0]:rows[1]]))
        for r, b in enumerate(idx[:packed.num_samples - first].tolist()):
            for seg, d in enumerate(packed.bins[b]):
                table[d] = out[r, seg]
    return table


def attach(workdir: str, splits, start: int, run, rows: tuple[int, int]) -> None:
    """Give each packed source of `splits` (train and val `Batches`) its reference table: read from `workdir`, or at
    step 0 computed with `run` and written (by process 0).

    Raises:
      DataError: a resumed run (`start` > 0) whose tables are missing or do not fit its data."""
    for batches in splits:
        for k, packed in enumerate(batches.packed):
            f = path(workdir, batches.split, k)
            if os.path.exists(f):
                table = np.load(f)
                if table.shape != (packed.sizes.size, 2):
                    raise DataError(f"{f}: reference log-probs of {table.shape[0]} pairs, but source "
                                    f"{batches.names[k]} ({batches.split}) packs {packed.sizes.size}: the data "
                                    f"changed since this run started; train it in a new run directory.")
            elif start > 0:
                raise DataError(f"{f} is missing: this run (dpo.precompute_reference) resumes at step {start}, and "
                                f"the reference (the initial weights) can no longer be recomputed; restore the file "
                                f"or start a new run directory.")
            else:
                table = compute(batches, k, run, rows)
                if jax.process_index() == 0:
                    os.makedirs(os.path.dirname(f), exist_ok=True)
                    np.save(f + ".tmp.npy", table)
                    os.replace(f + ".tmp.npy", f)
            packed.reference = table
