"""Loss-spike skipping (`train.skip_spikes`): the statistics of the last applied steps, and the rule.

The statistics are the loss and the global gradient norm of the last `train.spike_window` applied steps, oldest
first, how many of those slots hold a step (`count`, at most the window), and the spikes skipped so far and the
last one's step (`skipped`, `last`: -1 before any): `{"loss": float32 [N], "grad_norm": float32 [N], "count",
"skipped", "last": int32 []}`, part of the train state (so of checkpoints: a resumed run decides
what the uninterrupted one would). A step is a spike when the window is full and its loss or its gradient norm
exceeds the window's mean by more than `train.spike_threshold` of the window's standard deviations (population);
a spike's update is skipped and the step stays out of the window, as does every other skipped step. A checkpoint
written before the statistics existed starts an empty window; one written with another window keeps its most
recent steps.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

GROUP = "spikes"  # the train state's key
KEYS = ("loss", "grad_norm")
COUNTS = ("count", "skipped", "last")


def init(window: int) -> dict:
    """An empty window of `window` applied steps."""
    i32 = lambda v: jnp.full((), v, jnp.int32)  # noqa: E731
    return {"loss": jnp.zeros((window,), jnp.float32), "grad_norm": jnp.zeros((window,), jnp.float32),
            "count": i32(0), "skipped": i32(0), "last": i32(-1)}


def is_spike(stats: dict, values: dict, threshold: float):
    """bool []: the window is full and one of `values` (loss, grad_norm: scalars) is above its mean by more than
    `threshold` standard deviations. Non-finite values are the non-finite rule's, not a spike."""
    full = stats["count"] >= stats["loss"].shape[0]
    out = jnp.zeros((), bool)
    for k in KEYS:
        w = stats[k]
        v = values[k].astype(jnp.float32)
        out = out | (jnp.isfinite(v) & (v > w.mean() + threshold * w.std()))
    return full & out


def record(stats: dict, values: dict, applied, spike, step) -> dict:
    """The statistics after step `step` (1 = the first): its values appended (the oldest dropped) when `applied`;
    a `spike` counted."""
    new = {k: jnp.where(applied, jnp.concatenate([stats[k][1:], values[k].astype(jnp.float32)[None]]), stats[k])
           for k in KEYS}
    n = stats["loss"].shape[0]
    return {**new, "count": jnp.where(applied, jnp.minimum(stats["count"] + 1, n), stats["count"]),
            "skipped": stats["skipped"] + spike.astype(jnp.int32), "last": jnp.where(spike, step, stats["last"])}


def resize(saved: dict | None, window: int) -> dict:
    """Host values of a restored window (None: the checkpoint has none) as a window of `window` steps: its most
    recent steps kept."""
    if saved is None:
        return {k: np.asarray(v) for k, v in init(window).items()}
    count = min(int(saved["count"]), window)
    out = {}
    for k in KEYS:
        vals = np.asarray(saved[k], np.float32)[len(saved[k]) - count:] if count else np.zeros(0, np.float32)
        out[k] = np.concatenate([np.zeros(window - count, np.float32), vals])
    return {**out, "count": np.asarray(count, np.int32), "skipped": np.asarray(saved.get("skipped", 0), np.int32),
            "last": np.asarray(saved.get("last", -1), np.int32)}


def restore_target(abstract_state, saved: dict):
    """A checkpoint restore's target with the statistics as saved (none, in checkpoints written before they existed;
    another `train.spike_window`), and (the window asked for, its shardings), or None when the saved statistics
    fit as they are. `saved`: {leaf name 'spikes.loss': metadata with .shape and .dtype} of the checkpoint."""
    if not isinstance(abstract_state, dict) or GROUP not in abstract_state:
        return abstract_state, None
    want = abstract_state[GROUP]
    saved = {n.split(".", 1)[1]: m for n, m in saved.items() if n.startswith(GROUP + ".")}
    if saved.keys() == want.keys() and all(tuple(saved[k].shape) == tuple(a.shape) for k, a in want.items()):
        return abstract_state, None
    rest = {k: v for k, v in abstract_state.items() if k != GROUP}
    shardings = {k: a.sharding for k, a in want.items()}
    if saved:
        rest[GROUP] = {k: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=shardings["count"]) for k, m in saved.items()}
    return rest, (want["loss"].shape[0], shardings)
