"""The pipeline whose backward pass is autodiff of its forward loop (GPipe, circular): one `lax.scan` of ticks over
the mesh axis `stage`, `ppermute` between stages.

Knows nothing about models. The caller supplies three functions over one microbatch:

    first_fn(shared, mb)            -> activation          (stage 0, first pass: e.g. the embedding)
    stage_fn(chunk, act, chunk, mb) -> activation, or (activation, aux, stats)
                                       (one stage's layers; chunk = global chunk index; aux: a scalar the stage adds
                                        to the objective, e.g. MoE balancing losses; stats: a pytree of per-layer
                                        values, leaves `[layers of the chunk, ...]`, summed over microbatches, or None)
    last_fn(shared, act, mb)        -> (loss_sum, count)   (last stage, last pass: e.g. final norm, head, loss)

`mb` is the microbatch's slice of the `xs` pytree (`[M, ...]` leaves). The schedule is a forward tick table
(`tables.gpipe`, `tables.circular`): which microbatch and which of its local chunks each stage runs at each tick.

Bubbles never touch the loss or the gradients: slots without work are skipped with `lax.cond` (no compute, and no
0 · NaN in the backward pass), and the first and last functions run only on their own stage and slot, so the
embedding and the head are computed once per microbatch, not once per stage. Autodiff through the scan gives GPipe's
backward pass; `remat=True` checkpoints `stage_fn` so a stage keeps only its inputs per tick.

The loop runs under `shard_map` manual over `stage` and the batch axes (`data`, and `expert` when the experts are
split: each device on its own rows, `tensor` left to the compiler): the params are cast to per-device values once
before the loop, so the transpose of that cast, a `psum` over `stage` (shared params) and the batch axes each
parameter is replicated over, is the data-parallel gradient reduction, once per step.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.parallel.shard_map_body import put, take, vary
from jaxpar.parallel.pipeline.tables import Schedule

AXIS = "stage"
DATA = "data"  # manual too: each device runs its rows; the gradient is reduced over `data` once, after the loop


def run(first_fn, stage_fn, last_fn, shared, stacked, xs, schedule: Schedule, mesh, *, remat: bool = True,
        bubble_fill: float = 0.0, skip_bubbles: bool = True, batch_axes=(DATA,), stacked_specs=None, xs_specs=None):
    """Run the pipeline -> (loss_sum, count, per_microbatch_loss_sum `[M]`, aux sum, stats `[L, ...]` in stacked's
    stage-major order) in `last_fn`'s dtypes (float32; float64 in float64 runs), summed over microbatches.

    Args:
      shared: params used by first_fn / last_fn (replicated over `stage`).
      stacked: params of all stages, every leaf `[L, ...]` in stage-major order (`to_stage_major`), sharded on
        `stage` along axis 0; stage s's chunk r is `leaf[(s·v + r)·Lc : (s·v + r + 1)·Lc]`.
      xs: per-microbatch inputs, leaves `[M, ...]` (e.g. tokens `[M, micro_batch, seq]`).
      bubble_fill: value of the activation buffers before any work arrives (tests pass NaN).
      skip_bubbles: skip the stage's compute in bubble slots (`lax.cond`); False computes every slot on a zeroed
        input and discards the result (for measuring what skipping saves).
      batch_axes: the mesh axes the params are replicated over (manual here, with `stage`; losses and gradients are
        summed over them): those the rows of `xs` are split over, and `context`, which splits their sequence.
      stacked_specs: `PartitionSpec`s of `stacked` over `stage` and the batch axes (default: `stage` on axis 0).
      xs_specs: `PartitionSpec`s of `xs` over the manual axes (default: rows over `batch_axes`).
    """
    tables = tuple(jnp.asarray(t["f"]) for t in (schedule.mb, schedule.rep, schedule.ok))
    ticks = _Ticks(first_fn, with_side(stage_fn), last_fn, schedule, remat, bubble_fill, skip_bubbles,
                   tuple(batch_axes))
    f = jax.shard_map(ticks.local, mesh=mesh, axis_names={AXIS, *batch_axes},
                      in_specs=(P(), P(AXIS) if stacked_specs is None else stacked_specs,
                                _xs_specs(xs, batch_axes, xs_specs), P()),
                      out_specs=(P(), P(), P(), P(), P(AXIS)))
    return f(shared, stacked, xs, tables)


def _xs_specs(xs, batch_axes, xs_specs):
    """`xs_specs`, or rows over `batch_axes`."""
    if xs_specs is not None:
        return xs_specs
    rows = batch_axes[0] if len(batch_axes) == 1 else tuple(batch_axes)
    return P(None, rows)


def with_side(fn):
    """`fn` returning (output, aux, stats): a function returning only its output gets aux 0 and no stats."""
    def f(*args):
        out = fn(*args)
        return out if isinstance(out, tuple) else (out, jnp.zeros((), jnp.float32), None)
    return f


class _Ticks:
    """The per-device body of `run`: the slot functions and the tick loop."""

    def __init__(self, first_fn, stage_fn, last_fn, schedule, remat, bubble_fill, skip_bubbles, batch_axes):
        self.schedule, self.fill_value, self.skip, self.batch_axes = schedule, bubble_fill, skip_bubbles, batch_axes
        # Always inside a checkpoint: its inputs are its residuals, so the (loop-invariant) stack of chunks stays one
        # buffer, where a `cond`'s own residuals would copy the selected chunk at every tick. remat=False saves every
        # matmul output (no matmul is recomputed; slices of the weights are, which costs no FLOPs).
        policy = None if remat else jax.checkpoint_policies.dots_saveable
        self.stage_fn = stage_fn
        self.work = jax.checkpoint(self._work, prevent_cse=False, policy=policy)
        # The embedding and the head are recomputed in the backward pass (their one-hot and logits buffers,
        # [micro_batch, seq, vocab], would otherwise be kept for every tick); checkpointed around their `cond`s for
        # the same reason as `work`.
        self.first = jax.checkpoint(lambda shared, mb, x, pred: jax.lax.cond(
            pred, lambda: vary(first_fn(shared, mb)), lambda: x), prevent_cse=False)
        self.last = jax.checkpoint(lambda shared, y, mb, pred: jax.lax.cond(
            pred, lambda: vary(last_fn(shared, y, mb)), lambda: _zeros(self.out_shapes)), prevent_cse=False)
        self.first_fn, self.last_fn = first_fn, last_fn

    def _work(self, chunks, r, x, cid, mb, ok):
        """The stage's layers on its slot, skipped in bubbles: (activation, aux, stats)."""
        idle = lambda: (x, *vary(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), self.side)))  # noqa: E731
        if self.skip:
            return jax.lax.cond(ok, lambda: vary(self.stage_fn(take(chunks, r), x, cid, mb)), idle)
        y = vary(self.stage_fn(take(chunks, r), jnp.where(ok, x, 0), cid, mb))  # bubble input zeroed: never NaN
        return jax.tree.map(lambda a, b: jnp.where(ok, a, b), y, idle())

    def local(self, shared, stacked, xs, tables):
        sc = self.schedule
        S, v, M = sc.stages, sc.virtual, sc.microbatches
        s = jax.lax.axis_index(AXIS)
        act = jax.eval_shape(self.first_fn, shared, take(xs, 0))
        # params become per-device values once, here: the transpose, a psum of their gradient over `stage` and
        # `data` (the data-parallel reduction), then runs once after the loop, not inside a stage's `cond` (where the
        # other stages would never join it)
        chunks = jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), vary(stacked))  # [v, Lc, ...]
        shared = vary(shared)
        self.out_shapes = jax.eval_shape(
            lambda sh, mb: self.last_fn(sh, vary(jnp.zeros(act.shape, act.dtype)), mb), shared, take(xs, 0))
        self.side = jax.eval_shape(lambda: self.stage_fn(take(chunks, 0), vary(jnp.zeros(act.shape, act.dtype)),
                                                         0, take(xs, 0))[1:])  # (aux, stats) shapes

        def tick(carry, row):
            recv, loop_buf, loss, count, per_mb, aux, stats = carry
            mbs, reps, valids = row
            i, r, ok = mbs[s], reps[s], valids[s]
            mb = take(xs, i)
            # stage 0 starts a microbatch (pass 0) or takes it back from the loop buffer (pass r > 0)
            x = jnp.where(s == 0, take(loop_buf, i), recv) if v > 1 else recv
            x = self.first(shared, mb, x, ok & (s == 0) & (r == 0))
            y, a, st = self.work(chunks, r, x, sc.chunk(r, s), mb, ok)
            aux, stats = aux + a, jax.tree.map(lambda acc, d: put(acc, r, take(acc, r) + d), stats, st)
            ls, c = self.last(shared, y, mb, ok & (s == S - 1) & (r == v - 1))
            # a full ring also for GPipe (stage 0 never reads what stage S-1 sends there)
            nxt = jax.lax.ppermute(y, AXIS, sc.sends("f", ring=True))
            if v > 1:  # what stage S-1 just sent round to stage 0 is parked until its next pass
                j, back = mbs[S - 1], valids[S - 1] & (reps[S - 1] < v - 1)
                loop_buf = jax.lax.cond(back & (s == 0), lambda: put(loop_buf, j, nxt), lambda: loop_buf)
            per_mb = per_mb + jnp.where(jnp.arange(M) == i, ls, 0.0)
            return (nxt, loop_buf, loss + ls, count + c, per_mb, aux, stats), None

        fill = lambda *lead: vary(jnp.full(lead + act.shape, self.fill_value, act.dtype))
        zero_side = vary(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), self.side[0]))
        zero_stats = vary(jax.tree.map(lambda a: jnp.zeros((v,) + a.shape, a.dtype), self.side[1]))
        init = (fill(), fill(M if v > 1 else 1), *_zeros(self.out_shapes),
                vary(jnp.zeros((M,), self.out_shapes[0].dtype)),
                zero_side, zero_stats)
        (_, _, loss, count, per_mb, aux, stats), _ = jax.lax.scan(tick, init, tables)
        every = (AXIS, *self.batch_axes)
        stats = jax.tree.map(lambda a: jax.lax.psum(a.reshape(-1, *a.shape[2:]), self.batch_axes), stats)
        return (*(jax.lax.psum(t, every) for t in (loss, count, per_mb, aux)), stats)


def _zeros(shapes):
    """Per-device zeros of (loss_sum, count) in `last_fn`'s shapes and dtypes (a count may be any array: summed)."""
    return tuple(vary(jnp.zeros(a.shape, a.dtype)) for a in shapes)
