"""The pipeline with the backward pass inside the loop: 1F1B and ZB-H1 over the mesh axis `stage`, one SPMD program.

GPipe through autodiff (`jaxpar/pipeline.py`) keeps what every in-flight microbatch needs for its backward pass until
the loop ends, O(M). Here each tick of a `lax.scan` runs up to three lanes per stage, from a `LoopSchedule`
(`jaxpar/schedules.py`): F (forward), B (backward by `jax.vjp`; the input gradient only when the schedule splits it)
and W (the weight gradient of a split schedule). Activations travel to stage s + 1 and cotangents to stage s - 1 with
`ppermute` at the end of every tick. A stage keeps, in fixed-size ring buffers indexed by microbatch mod R (R from the
table, O(S), never O(M)):

- its stage inputs until their B (`remat=True`: B recomputes the stage's forward from them), or the vjp residuals
  of the stage's layers (`remat=False`: no recompute);
- with a split schedule, each layer's input and output cotangent `[Lc, ...]` from B until W (W = the per-layer vjp
  with respect to the weights only; B's per-layer cotangents come from a zero "tap" added to each layer's output).

Knows nothing about GPT. The caller supplies, over one microbatch `mb` (a slice of the `xs` pytree):

    first_fn(shared, mb)             -> activation          (stage 0: e.g. the embedding; recomputed in B)
    layer_fn(layer, act, index, mb)  -> activation          (one layer; `index` = global layer index)
    last_fn(shared, act, mb)         -> (loss_sum, count)   (last stage: e.g. final norm, head, loss)

The last stage computes its loss inside its B (forward, head, loss and vjp at once), so the head's cotangent is ready
there and then, and the shared params (embedding, head) get one gradient, summed over stages once after the loop.
Bubbles are `lax.cond`/`lax.switch` branches that compute nothing.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.pipeline import AXIS, DATA, vary
from jaxpar.schedules import LANES, LoopSchedule


def run(first_fn, layer_fn, last_fn, shared, stacked, xs, schedule: LoopSchedule, mesh, seed, *,
        remat: bool = True):
    """Loss and gradients of `seed · Σ_microbatches loss_sum` through the pipeline.

    Args:
      shared: params of first_fn / last_fn, replicated (pytree).
      stacked: the layers' params, leaves `[L, ...]`, sharded on `stage` along axis 0 (stage s: layers
        s·L/S … (s+1)·L/S - 1), replicated over `data`.
      xs: per-microbatch inputs, leaves `[M, batch / M, ...]`, rows sharded on `data` (axis 1).
      seed: float32 scalar, the cotangent of each microbatch's loss_sum (e.g. 1 / tokens of the global batch).
      remat: True: keep stage inputs and recompute the forward in B; False: keep the vjp residuals (1F1B only).

    Returns:
      (loss_sum, count, per-microbatch loss sums `[M]`, shared grads, stacked grads): float32, summed over
      microbatches and the `data` axis (one all-reduce per step), grads shaped like `shared` / `stacked`.
    """
    S, M = schedule.stages, schedule.microbatches
    if not remat and schedule.split:
        raise ValueError("remat=False (keep vjp residuals) is implemented for 1f1b only; zb_h1 recomputes")
    tables = {k: (jnp.asarray(schedule.mb[k]), jnp.asarray(schedule.ok[k])) for k in LANES}
    R = {k: schedule.ring(k) for k in ("act", "grad", "res", "wgrad")}
    take = lambda tree, i: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)
    f32 = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32), t)
    zeros_like = lambda t: vary(jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), t))

    def local(shared, chunk, xs, seed, tables):
        s = jax.lax.axis_index(AXIS)
        shared, chunk, seed = vary(shared), vary(chunk), vary(seed)  # gradients stay per device until the end
        Lc = jax.tree.leaves(chunk)[0].shape[0]
        act = jax.eval_shape(first_fn, shared, take(xs, 0))
        zact = lambda: vary(jnp.zeros(act.shape, act.dtype))
        zero = lambda: vary(jnp.zeros((), jnp.float32))

        def stage(chunk, x, mb, taps=None):
            """The chunk's Lc layers; with `taps` `[Lc, ...]` added to the layer outputs, also the layer inputs."""
            def one(a, inp):
                p, l, tap = inp
                y = layer_fn(p, a, s * Lc + l, mb)
                return (y if tap is None else y + tap), a
            y, inputs = jax.lax.scan(one, x, (chunk, jnp.arange(Lc), taps))
            return y, inputs

        pull_def = []  # the treedef of the stage's vjp function (a pytree whose leaves are its residuals)

        def fwd_vjp(x, chunk, mb):
            """Stage forward keeping the vjp's residuals: (y, residual leaves)."""
            y, pull = jax.vjp(lambda c, a: stage(c, a, mb)[0], chunk, x)
            leaves, tdef = jax.tree.flatten(pull)
            pull_def[:] = [tdef]
            return y, leaves

        if not remat:  # the residuals' shapes
            res_shapes = jax.eval_shape(lambda: fwd_vjp(zact(), chunk, take(xs, 0)))[1]

        def pull_from(res):
            return jax.tree.unflatten(pull_def[0], res)

        # ---- lanes -------------------------------------------------------------------------------------------
        def f_lane(bufs, i, ok):
            """Stage s < S-1 forwards microbatch i: -> (activation to send, residuals or None)."""
            mb = take(xs, i)
            x = jax.lax.cond(s == 0, lambda: vary(first_fn(shared, mb)), lambda: take(bufs["act"], i % R["act"]))
            if remat:
                y = jax.lax.cond(ok, lambda: vary(stage(chunk, x, mb)[0]), zact)
                return y, None
            zres = lambda: vary([jnp.zeros(r.shape, r.dtype) for r in res_shapes])
            return jax.lax.cond(ok, lambda: vary(fwd_vjp(x, chunk, mb)), lambda: (zact(), zres()))

        def b_full(bufs, i, role):
            """Backward (input and weight gradients) of microbatch i by role 0 first / 1 middle / 2 last."""
            mb = take(xs, i)
            g = take(bufs["grad"], i % R["grad"])
            x = take(bufs["act"], i % R["act"])

            def first():
                if remat:
                    _, pull = jax.vjp(lambda c, sh: stage(c, first_fn(sh, mb), mb)[0], chunk, shared)
                    dc, dsh = pull(g)
                else:
                    dc, da = pull_from(take(bufs["res"], i % R["res"]))(g)
                    dsh = jax.vjp(lambda sh: first_fn(sh, mb), shared)[1](da)[0]
                return f32(dc), f32(dsh), zact(), zero(), zero()

            def middle():
                if remat:
                    dc, dx = jax.vjp(lambda c, a: stage(c, a, mb)[0], chunk, x)[1](g)
                else:
                    dc, dx = pull_from(take(bufs["res"], i % R["res"]))(g)
                return f32(dc), zeros_like(shared), dx, zero(), zero()

            def last():
                (ls, cnt), pull = jax.vjp(lambda c, sh, a: last_fn(sh, stage(c, a, mb)[0], mb), chunk, shared, x)
                dc, dsh, dx = pull((seed, jnp.zeros_like(cnt)))
                return f32(dc), f32(dsh), dx, ls, cnt

            idle = lambda: (zeros_like(chunk), zeros_like(shared), zact(), zero(), zero())
            return jax.lax.switch(role, [lambda: vary(first()), lambda: vary(middle()), lambda: vary(last()), idle])

        def b_split(bufs, i, role):
            """Input-gradient backward of microbatch i; -> (shared grads, dx, loss, count, layer inputs, cotangents)."""
            mb = take(xs, i)
            g = take(bufs["grad"], i % R["grad"])
            x = take(bufs["act"], i % R["act"])
            taps0 = vary(jnp.zeros((Lc,) + act.shape, act.dtype))

            def first():
                _, pull, ins = jax.vjp(lambda sh, t: stage(chunk, first_fn(sh, mb), mb, t), shared, taps0,
                                       has_aux=True)
                dsh, cts = pull(g)
                return f32(dsh), zact(), zero(), zero(), ins, cts

            def middle():
                _, pull, ins = jax.vjp(lambda a, t: stage(chunk, a, mb, t), x, taps0, has_aux=True)
                dx, cts = pull(g)
                return zeros_like(shared), dx, zero(), zero(), ins, cts

            def last():
                def f(sh, a, t):
                    y, ins = stage(chunk, a, mb, t)
                    ls, cnt = last_fn(sh, y, mb)
                    return (ls, cnt), ins
                (ls, cnt), pull, ins = jax.vjp(f, shared, x, taps0, has_aux=True)
                dsh, dx, cts = pull((seed, jnp.zeros_like(cnt)))
                return f32(dsh), dx, ls, cnt, ins, cts

            idle = lambda: (zeros_like(shared), zact(), zero(), zero(), taps0, taps0)
            return jax.lax.switch(role, [lambda: vary(first()), lambda: vary(middle()), lambda: vary(last()), idle])

        def w_lane(bufs, i, ok):
            """Weight gradient of microbatch i from B's saved layer inputs and output cotangents."""
            mb = take(xs, i)
            ins, cts = take(bufs["w_in"], i % R["wgrad"]), take(bufs["w_ct"], i % R["wgrad"])

            def grads():
                def one(_, inp):
                    p, l, a, g = inp
                    return None, f32(jax.vjp(lambda q: layer_fn(q, a, s * Lc + l, mb), p)[1](g)[0])
                return vary(jax.lax.scan(one, None, (chunk, jnp.arange(Lc), ins, cts))[1])
            return jax.lax.cond(ok, grads, lambda: zeros_like(chunk))

        # ---- the tick loop -----------------------------------------------------------------------------------
        def put(buf, i, value, ok):
            slot = i % buf.shape[0]
            return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(ok, value, take(buf, slot)), slot, 0)

        def tick(carry, row):
            bufs, dchunk, dshared, loss, count, per_mb = carry
            (fm, fo), (bm, bo), (wm, wo) = row["f"], row["b"], row["w"]
            role = jnp.where(s == 0, 0, jnp.where(s == S - 1, 2, 1))
            y, res = f_lane(bufs, fm[s], fo[s] & (s < S - 1))
            brole = jnp.where(bo[s], role, 3)
            if schedule.split:
                dsh, dx, ls, cnt, ins, cts = b_split(bufs, bm[s], brole)
                dc = w_lane(bufs, wm[s], wo[s])
                bufs = dict(bufs, w_in=put(bufs["w_in"], bm[s], ins, bo[s]),
                            w_ct=put(bufs["w_ct"], bm[s], cts, bo[s]))
            else:
                dc, dsh, dx, ls, cnt = b_full(bufs, bm[s], brole)
            if res is not None:  # residuals of this tick's forward, kept until its B
                bufs = dict(bufs, res=[put(b, fm[s], r, fo[s] & (s < S - 1)) for b, r in zip(bufs["res"], res)])
            # end of tick: activations to s + 1, cotangents to s - 1; receivers file them by microbatch
            a_in = jax.lax.ppermute(y, AXIS, [(j, j + 1) for j in range(S - 1)])
            g_in = jax.lax.ppermute(dx, AXIS, [(j + 1, j) for j in range(S - 1)])
            prev, nxt = jnp.maximum(s - 1, 0), jnp.minimum(s + 1, S - 1)
            bufs = dict(bufs, act=put(bufs["act"], fm[prev], a_in, (s > 0) & fo[prev]),
                        grad=put(bufs["grad"], bm[nxt], g_in, (s < S - 1) & bo[nxt]))
            add = lambda a, b: jax.tree.map(jnp.add, a, b)
            per_mb = per_mb + jnp.where(jnp.arange(M) == bm[s], ls, 0.0)
            return (bufs, add(dchunk, dc), add(dshared, dsh), loss + ls, count + cnt, per_mb), None

        ring = lambda n: vary(jnp.zeros((n,) + act.shape, act.dtype))
        bufs = {"act": ring(R["act"]), "grad": ring(R["grad"])}
        if schedule.split:
            bufs["w_in"] = vary(jnp.zeros((R["wgrad"], Lc) + act.shape, act.dtype))
            bufs["w_ct"] = vary(jnp.zeros((R["wgrad"], Lc) + act.shape, act.dtype))
        if not remat:
            bufs["res"] = [vary(jnp.zeros((R["res"],) + r.shape, r.dtype)) for r in res_shapes]
        init = (bufs, zeros_like(chunk), zeros_like(shared), zero(), zero(), vary(jnp.zeros((M,), jnp.float32)))
        (_, dchunk, dshared, loss, count, per_mb), _ = jax.lax.scan(tick, init, tables)
        both = (AXIS, DATA)
        return (jax.lax.psum(loss, both), jax.lax.psum(count, both), jax.lax.psum(per_mb, both),
                jax.lax.psum(dshared, both), jax.lax.psum(dchunk, DATA))

    f = jax.shard_map(local, mesh=mesh, axis_names={AXIS, DATA},
                      in_specs=(P(), P(AXIS), P(None, DATA), P(), P()),
                      out_specs=(P(), P(), P(), P(), P(AXIS)))
    return f(shared, stacked, xs, seed, tables)

