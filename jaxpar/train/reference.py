"""DPO's precomputed reference (`dpo.precompute_reference`, TRL's `precompute_ref_log_probs`).

Before the first step, one pass of the reference model (the initial policy; with LoRA its base, the adapters off)
goes over every preference pair of the train and validation splits. Each pair's two sums of response-token
log-probs (chosen, rejected) are written to the run directory, `reference_logps/<split>-<k>.npy` (float64
`[pairs, 2]`, by document of source k's packed split), and come with every batch as `ref`, so training holds no
reference weights and runs no reference forward pass. They live beside the run's checkpoints, not in the shared
prepared-data cache, because they belong to this run's initial weights: a resumed run reads them back (its policy
has moved on, so they are never recomputed after step 0).

`reference_logps/made_by.json` records what made the tables: the starting weights' digest (`weights_digest`: exact
integer sums of the weights' bits, the same on every layout), `init_from`, `lora.adapter` and the data's identity.
Tables made from other starting weights or data are refused in one line, never reused and never deleted.
"""
from __future__ import annotations

import hashlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.data import DataError

DIR = "reference_logps"
MADE_BY = "made_by.json"
_UINT = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def weights_digest(params) -> str:
    """A digest of a params tree, the same on every layout and device count: per leaf, the sums (mod 2^32) of its
    elements' bit patterns and of their squares (integer sums: exact in any order of reduction)."""
    def leaf(a):
        bits = jax.lax.bitcast_convert_type(a, _UINT[a.dtype.itemsize])
        u = (bits ^ (bits >> 32)).astype(jnp.uint32) if a.dtype.itemsize == 8 else bits.astype(jnp.uint32)
        return jnp.stack([jnp.sum(u, dtype=jnp.uint32), jnp.sum(u * u, dtype=jnp.uint32)])

    sums = jax.device_get(jax.jit(lambda p: jax.tree.map(leaf, p))(params))
    text = json.dumps([[jax.tree_util.keystr(k), v.tolist()] for k, v in jax.tree_util.tree_leaves_with_path(sums)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def check_made_by(workdir: str, made_by: dict, start: int) -> None:
    """Refuse tables in WORKDIR made from other starting weights or data (`made_by`: this run's; at a resume, when
    the starting weights are gone, its data alone); at step 0 tables with no record are refused too.

    Raises:
      DataError: one line naming what differs and the fix."""
    folder = os.path.join(workdir, DIR)
    if not (os.path.isdir(folder) and any(f.endswith(".npy") for f in os.listdir(folder))):
        return
    saved = {}
    if os.path.isfile(os.path.join(folder, MADE_BY)):
        with open(os.path.join(folder, MADE_BY)) as f:
            saved = json.load(f)
    keys = [k for k in made_by if start == 0 or k == "data"]
    diff = [f"{k}: tables {saved.get(k)!r} vs now {made_by[k]!r}" for k in keys if saved.get(k) != made_by[k]]
    if diff:
        raise DataError(f"{folder} holds reference log-probs (dpo.precompute_reference) made from other "
                        f"starting weights or data ({'; '.join(diff)}); move that folder away, or use a new run "
                        f"directory.")


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


def attach(workdir: str, splits, start: int, run, rows: tuple[int, int], made_by: dict) -> None:
    """Give each packed source of `splits` (train and val `Batches`) its reference table: read from `workdir`, or at
    step 0 computed with `run` and written (by process 0) with `made_by` (what made it: `check_made_by`).

    Raises:
      DataError: tables made from other starting weights or data; a resumed run (`start` > 0) whose tables are
        missing or do not fit its data."""
    check_made_by(workdir, made_by, start)
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
                    _write_made_by(workdir, made_by)
                    np.save(f + ".tmp.npy", table)
                    os.replace(f + ".tmp.npy", f)
            packed.reference = table


def _write_made_by(workdir: str, made_by: dict) -> None:
    path = os.path.join(workdir, DIR, MADE_BY)
    with open(path + ".tmp", "w") as f:
        json.dump(made_by, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)
