"""Pipeline parallelism over the mesh axis `stage`: one `lax.scan` of ticks, `ppermute` between stages.

Knows nothing about GPT. The caller supplies three functions over one microbatch:

    first_fn(shared, mb)            -> activation          (stage 0, first pass: e.g. the embedding)
    stage_fn(chunk, act, chunk, mb) -> activation          (one stage's layers; chunk = global chunk index)
    last_fn(shared, act, mb)        -> (loss_sum, count)   (last stage, last pass: e.g. final norm, head, loss)

`mb` is the microbatch's slice of the `xs` pytree (`[M, ...]` leaves). The schedule is data (`Schedule`): which
microbatch and which of its local chunks each stage runs at each tick. GPipe (Huang et al. 2019) runs
M + S - 1 ticks; the circular schedule (interleaved virtual stages: Narayanan et al. 2021, sec. 2.2; the
"circular repeat" of GSPMD pipelining, Xu et al. 2021, sec. 3.3) gives each stage v chunks and loops the microbatches
v times, v·M + S - 1 ticks, so the bubble fraction falls from (S-1)/(M+S-1) to (S-1)/(v·M+S-1).

Bubbles never touch the loss or the gradients: slots without work are skipped with `lax.cond` (no compute, and no
0 · NaN in the backward pass), and the first and last functions run only on their own stage and slot, so the
embedding and the head are computed once per microbatch, not once per stage. Autodiff through the scan gives GPipe's
backward pass; `remat=True` checkpoints `stage_fn` so a stage keeps only its inputs per tick.

The loop runs under `shard_map` manual over `stage` and `data` (each device on its own rows, `tensor` left to the
compiler): the params are cast to per-device values once before the loop, so the transpose of that cast, a `psum`
over `stage` (shared params) and `data` (all params), is the data-parallel gradient reduction, once per step.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

AXIS = "stage"
DATA = "data"  # manual too: each device runs its rows; the gradient is reduced over `data` once, after the loop


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A forward tick table: for tick t and stage s, `mb[t, s]` (microbatch), `rep[t, s]` (local chunk, i.e. pass
    number), `valid[t, s]` (work or bubble). Arrays are int32/bool `[ticks, stages]`."""
    name: str
    stages: int
    virtual: int
    microbatches: int
    mb: np.ndarray
    rep: np.ndarray
    valid: np.ndarray

    @property
    def ticks(self) -> int:
        return self.valid.shape[0]

    def bubble_fraction(self) -> float:
        """Idle slots / all slots: (S - 1) / (v·M + S - 1) for these schedules."""
        return 1.0 - float(self.valid.mean())


def circular(stages: int, virtual: int, microbatches: int, name: str = "circular") -> Schedule:
    """Stage s works at tick t on slot k = t - s: microbatch k mod M, pass k div M (valid while k < v·M).

    Microbatch i leaves the last stage after pass r at tick r·M + i + S - 1 and is needed back on stage 0 at
    tick (r+1)·M + i, so M >= S is required (validated in config).

    Raises:
      ValueError: M < S with v > 1.
    """
    S, v, M = stages, virtual, microbatches
    if v > 1 and M < S:
        raise ValueError(f"circular schedule needs microbatches >= stages; got M={M}, S={S}")
    t = np.arange(v * M + S - 1)[:, None]
    k = t - np.arange(S)[None, :]
    valid = (k >= 0) & (k < v * M)
    kc = np.clip(k, 0, v * M - 1)
    return Schedule(name, S, v, M, (kc % M).astype(np.int32), (kc // M).astype(np.int32), valid)


def gpipe(stages: int, microbatches: int) -> Schedule:
    return circular(stages, 1, microbatches, name="gpipe")


def make_schedule(name: str, stages: int, virtual: int, microbatches: int) -> Schedule:
    if name == "gpipe":
        return gpipe(stages, microbatches)
    if name == "circular":
        return circular(stages, virtual, microbatches)
    raise ValueError(f"unknown pipeline schedule {name!r}")


def to_stage_major(x, stages: int, virtual: int):
    """Layer axis 0 in canonical order -> the order whose contiguous split over `stages` gives stage s the chunks
    s, s + S, ..., s + (v-1)·S (what the circular schedule needs). Identity for v = 1."""
    if virtual == 1:
        return x
    L = x.shape[0]
    c = x.reshape(virtual, stages, L // (virtual * stages), *x.shape[1:])  # [v, S, Lc, ...]: chunk r·S + s
    return c.swapaxes(0, 1).reshape(x.shape)


def from_stage_major(x, stages: int, virtual: int):
    """Inverse of `to_stage_major`."""
    if virtual == 1:
        return x
    L = x.shape[0]
    c = x.reshape(stages, virtual, L // (virtual * stages), *x.shape[1:])
    return c.swapaxes(0, 1).reshape(x.shape)


def _varying_axes(x) -> frozenset:
    """Manual mesh axes along which x differs per device (`.vma` in older JAX, `.manual_axis_type` in 0.10+)."""
    t = jax.typeof(x)
    if hasattr(t, "vma"):
        return t.vma
    mat = getattr(t, "manual_axis_type", None)
    return mat.varying if mat is not None else frozenset()


def vary(tree):
    """Mark every leaf as differing per device along every manual mesh axis (shard_map's varying-axes types).

    A differentiated value that is invariant along a manual axis gets a `psum` over that axis in its transpose; cast
    up front, the gradient stays per device, to be reduced once where the caller says."""
    manual = tuple(jax.sharding.get_abstract_mesh().manual_axes)

    def cast(x):
        missing = tuple(a for a in manual if a not in _varying_axes(x))
        return jax.lax.pcast(x, missing, to="varying") if missing else x
    return jax.tree.map(cast, tree)


def run(first_fn, stage_fn, last_fn, shared, stacked, xs, schedule: Schedule, mesh, *, remat: bool = True,
        bubble_fill: float = 0.0, skip_bubbles: bool = True):
    """Run the pipeline -> (loss_sum, count, per_microbatch_loss_sum `[M]`), float32, summed over microbatches.

    Args:
      shared: params used by first_fn / last_fn (replicated over `stage`).
      stacked: params of all stages, every leaf `[L, ...]` in stage-major order (`to_stage_major`), sharded on
        `stage` along axis 0; stage s's chunk r is `leaf[(s·v + r)·Lc : (s·v + r + 1)·Lc]`.
      xs: per-microbatch inputs, leaves `[M, ...]` (e.g. tokens `[M, micro_batch, seq]`).
      bubble_fill: value of the activation buffers before any work arrives (tests pass NaN).
      skip_bubbles: skip the stage's compute in bubble slots (`lax.cond`); False computes every slot on a zeroed
        input and discards the result (for measuring what skipping saves).
    """
    S, v, M = schedule.stages, schedule.virtual, schedule.microbatches
    tables = tuple(jnp.asarray(a) for a in (schedule.mb, schedule.rep, schedule.valid))
    take = lambda tree, i: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)

    def local(shared, stacked, xs, tables):
        s = jax.lax.axis_index(AXIS)
        act_shape = jax.eval_shape(first_fn, shared, jax.tree.map(lambda a: a[0], xs))
        chunks = jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), vary(stacked))  # [v, Lc, ...]

        fill = lambda: vary(jnp.full(act_shape.shape, bubble_fill, act_shape.dtype))
        zero = lambda: vary(jnp.zeros((), jnp.float32))
        # params become per-device values once, here (`chunks` above too): the transpose, a psum of their gradient
        # over `stage` and `data` (the data-parallel reduction), then runs once after the loop, not inside a stage's
        # `cond` (where the other stages would never join it)
        shared = vary(shared)

        def work(chunks, r, x, cid, mb, ok):
            """The stage's layers on its slot, skipped in bubbles."""
            if skip_bubbles:
                return jax.lax.cond(ok, lambda: vary(stage_fn(take(chunks, r), x, cid, mb)), lambda: x)
            y = vary(stage_fn(take(chunks, r), jnp.where(ok, x, 0), cid, mb))  # bubble input zeroed: never NaN
            return jnp.where(ok, y, x)

        # Always inside a checkpoint: its inputs are its residuals, so the (loop-invariant) stack of chunks stays one
        # buffer, where a `cond`'s own residuals would copy the selected chunk at every tick. remat=False saves every
        # matmul output (no matmul is recomputed; slices of the weights are, which costs no FLOPs).
        policy = None if remat else jax.checkpoint_policies.dots_saveable
        work = jax.checkpoint(work, prevent_cse=False, policy=policy)

        # The embedding and the head are recomputed in the backward pass (their one-hot and logits buffers,
        # [micro_batch, seq, vocab], would otherwise be kept for every tick); checkpointed around their `cond`s for
        # the same reason as `work`.
        first = jax.checkpoint(lambda shared, mb, x, pred: jax.lax.cond(
            pred, lambda: vary(first_fn(shared, mb)), lambda: x), prevent_cse=False)
        last = jax.checkpoint(lambda shared, y, mb, pred: jax.lax.cond(
            pred, lambda: vary(last_fn(shared, y, mb)), lambda: (zero(), zero())), prevent_cse=False)

        def tick(carry, row):
            recv, loop_buf, loss, count, per_mb = carry
            mbs, reps, valids = row
            i, r, ok = mbs[s], reps[s], valids[s]
            mb = take(xs, i)
            # stage 0 starts a microbatch (pass 0) or takes it back from the loop buffer (pass r > 0)
            if v > 1:
                x = jnp.where(s == 0, take(loop_buf, i), recv)
            else:
                x = recv
            x = first(shared, mb, x, ok & (s == 0) & (r == 0))
            y = work(chunks, r, x, r * S + s, mb, ok)
            ls, c = last(shared, y, mb, ok & (s == S - 1) & (r == v - 1))
            nxt = jax.lax.ppermute(y, AXIS, [(j, (j + 1) % S) for j in range(S)])
            if v > 1:  # what stage S-1 just sent round to stage 0 is parked until its next pass
                j, back = mbs[S - 1], valids[S - 1] & (reps[S - 1] < v - 1)
                loop_buf = jax.lax.cond(back & (s == 0),
                                        lambda: jax.lax.dynamic_update_index_in_dim(loop_buf, nxt, j, 0),
                                        lambda: loop_buf)
            per_mb = per_mb + jnp.where(jnp.arange(M) == i, ls, 0.0)
            return (nxt, loop_buf, loss + ls, count + c, per_mb), None

        buf = vary(jnp.full((M if v > 1 else 1,) + act_shape.shape, bubble_fill, act_shape.dtype))
        init = (fill(), buf, zero(), zero(), vary(jnp.zeros((M,), jnp.float32)))
        (_, _, loss, count, per_mb), _ = jax.lax.scan(tick, init, tables)
        both = (AXIS, DATA)
        return jax.lax.psum(loss, both), jax.lax.psum(count, both), jax.lax.psum(per_mb, both)

    f = jax.shard_map(local, mesh=mesh, axis_names={AXIS, DATA},
                      in_specs=(P(), P(AXIS), P(None, DATA), P()), out_specs=(P(), P(), P()))
    return f(shared, stacked, xs, tables)
