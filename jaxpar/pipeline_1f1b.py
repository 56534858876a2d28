"""The pipeline with the backward pass inside the loop: 1F1B and ZB-H1 over the mesh axis `stage`, one SPMD program.

GPipe through autodiff (`jaxpar/pipeline.py`) keeps what every in-flight microbatch needs for its backward pass until
the loop ends, O(M). Here each tick of a `lax.scan` runs up to three lanes per stage, from a `LoopSchedule`
(`jaxpar/schedules.py`): F (forward), B (backward by `jax.vjp`; the input gradient only when the schedule splits it)
and W (the weight gradient of a split schedule), each on one microbatch and one of the stage's v chunks of layers
(interleaved 1F1B: v > 1). Activations travel to the next chunk's stage and cotangents to the previous one's with
`ppermute` at the end of every tick (round the ring of stages when v > 1). A stage keeps, in fixed-size ring buffers
indexed by `LoopSchedule.key(microbatch, chunk)` mod R (R read off the table: O(v·S), never O(M)):

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
      stacked: the layers' params, leaves `[L, ...]` in stage-major order (`pipeline.to_stage_major`: with v chunks
        per stage, stage s holds chunks s, s + S, ...), sharded on `stage` along axis 0, replicated over `data`.
      xs: per-microbatch inputs, leaves `[M, batch / M, ...]`, rows sharded on `data` (axis 1).
      seed: float32 scalar, the cotangent of each microbatch's loss_sum (e.g. 1 / tokens of the global batch).
      remat: True: keep stage inputs and recompute the forward in B; False: keep the vjp residuals (1F1B only).

    Returns:
      (loss_sum, count, per-microbatch loss sums `[M]`, shared grads, stacked grads): float32, summed over
      microbatches and the `data` axis (one all-reduce per step), grads shaped like `shared` / `stacked`.
    """
    S, M, v = schedule.stages, schedule.microbatches, schedule.virtual
    C = v * S  # global chunks; stage s holds chunks s, s + S, ... (stage-major layer order, as `circular`)
    if not remat and schedule.split:
        raise ValueError("remat=False (keep vjp residuals) is implemented for 1f1b only; zb_h1 recomputes")
    tables = {k: (jnp.asarray(schedule.mb[k]), jnp.asarray(schedule.rep[k]), jnp.asarray(schedule.ok[k]))
              for k in LANES}
    R = {k: schedule.ring(k) for k in ("act", "grad", "res", "wgrad")}
    take = lambda tree, i: jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)
    f32 = lambda t: jax.tree.map(lambda a: a.astype(jnp.float32), t)
    zeros_like = lambda t: vary(jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), t))

    def local(shared, stacked, xs, seed, tables):
        s = jax.lax.axis_index(AXIS)
        shared, stacked, seed = vary(shared), vary(stacked), vary(seed)  # gradients stay per device until the end
        chunks = jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), stacked)  # [v, Lc, ...]
        Lc = jax.tree.leaves(stacked)[0].shape[0] // v
        act = jax.eval_shape(first_fn, shared, take(xs, 0))
        zact = lambda: vary(jnp.zeros(act.shape, act.dtype))
        zero = lambda: vary(jnp.zeros((), jnp.float32))
        at = lambda buf, i, r: take(buf, schedule.key(i, r) % jax.tree.leaves(buf)[0].shape[0])

        def stage(chunk, x, c, mb, taps=None):
            """Global chunk c's Lc layers; with `taps` `[Lc, ...]` added to the layer outputs, also the layer inputs."""
            def one(a, inp):
                p, l, tap = inp
                y = layer_fn(p, a, c * Lc + l, mb)
                return (y if tap is None else y + tap), a
            return jax.lax.scan(one, x, (chunk, jnp.arange(Lc), taps))

        pull_def = []  # the treedef of the chunk's vjp function (a pytree whose leaves are its residuals)

        def fwd_vjp(x, chunk, c, mb):
            """Chunk forward keeping the vjp's residuals: (y, residual leaves)."""
            y, pull = jax.vjp(lambda p, a: stage(p, a, c, mb)[0], chunk, x)
            leaves, tdef = jax.tree.flatten(pull)
            pull_def[:] = [tdef]
            return y, leaves

        if not remat:  # the residuals' shapes
            res_shapes = jax.eval_shape(lambda: fwd_vjp(zact(), take(chunks, 0), s, take(xs, 0)))[1]

        def pull_from(res):
            return jax.tree.unflatten(pull_def[0], res)

        # ---- lanes: microbatch i through local chunk r (global chunk c = r·S + s) -----------------------------
        def f_lane(bufs, i, r, ok):
            """Forward of a chunk before the last: -> (activation to send, residuals or None)."""
            mb, c, chunk = take(xs, i), r * S + s, take(chunks, r)
            x = lambda: jax.lax.cond(c == 0, lambda: vary(first_fn(shared, mb)), lambda: at(bufs["act"], i, r))
            if remat:
                return jax.lax.cond(ok, lambda: vary(stage(chunk, x(), c, mb)[0]), zact), None
            zres = lambda: vary([jnp.zeros(a.shape, a.dtype) for a in res_shapes])
            return jax.lax.cond(ok, lambda: vary(fwd_vjp(x(), chunk, c, mb)), lambda: (zact(), zres()))

        def b_full(bufs, i, r, role):
            """Backward (input and weight gradients) by role 0 first chunk / 1 middle / 2 last / 3 idle."""
            mb, c, chunk = take(xs, i), r * S + s, take(chunks, r)
            g, x = at(bufs["grad"], i, r), at(bufs["act"], i, r)

            def first():
                if remat:
                    _, pull = jax.vjp(lambda p, sh: stage(p, first_fn(sh, mb), c, mb)[0], chunk, shared)
                    dc, dsh = pull(g)
                else:
                    dc, da = pull_from(at(bufs["res"], i, r))(g)
                    dsh = jax.vjp(lambda sh: first_fn(sh, mb), shared)[1](da)[0]
                return f32(dc), f32(dsh), zact(), zero(), zero()

            def middle():
                if remat:
                    dc, dx = jax.vjp(lambda p, a: stage(p, a, c, mb)[0], chunk, x)[1](g)
                else:
                    dc, dx = pull_from(at(bufs["res"], i, r))(g)
                return f32(dc), zeros_like(shared), dx, zero(), zero()

            def last():
                (ls, cnt), pull = jax.vjp(lambda p, sh, a: last_fn(sh, stage(p, a, c, mb)[0], mb), chunk, shared, x)
                dc, dsh, dx = pull((seed, jnp.zeros_like(cnt)))
                return f32(dc), f32(dsh), dx, ls, cnt

            idle = lambda: (zeros_like(chunk), zeros_like(shared), zact(), zero(), zero())
            return jax.lax.switch(role, [lambda: vary(first()), lambda: vary(middle()), lambda: vary(last()), idle])

        def b_split(bufs, i, r, role):
            """Input-gradient backward; -> (shared grads, dx, loss, count, layer inputs, layer output cotangents)."""
            mb, c, chunk = take(xs, i), r * S + s, take(chunks, r)
            g, x = at(bufs["grad"], i, r), at(bufs["act"], i, r)
            taps0 = vary(jnp.zeros((Lc,) + act.shape, act.dtype))

            def first():
                _, pull, ins = jax.vjp(lambda sh, t: stage(chunk, first_fn(sh, mb), c, mb, t), shared, taps0,
                                       has_aux=True)
                dsh, cts = pull(g)
                return f32(dsh), zact(), zero(), zero(), ins, cts

            def middle():
                _, pull, ins = jax.vjp(lambda a, t: stage(chunk, a, c, mb, t), x, taps0, has_aux=True)
                dx, cts = pull(g)
                return zeros_like(shared), dx, zero(), zero(), ins, cts

            def last():
                def f(sh, a, t):
                    y, ins = stage(chunk, a, c, mb, t)
                    return last_fn(sh, y, mb), ins
                (ls, cnt), pull, ins = jax.vjp(f, shared, x, taps0, has_aux=True)
                dsh, dx, cts = pull((seed, jnp.zeros_like(cnt)))
                return f32(dsh), dx, ls, cnt, ins, cts

            idle = lambda: (zeros_like(shared), zact(), zero(), zero(), taps0, taps0)
            return jax.lax.switch(role, [lambda: vary(first()), lambda: vary(middle()), lambda: vary(last()), idle])

        def w_lane(bufs, i, r, ok):
            """Weight gradient from B's saved layer inputs and output cotangents (per-layer vjp, weights only)."""
            mb, c, chunk = take(xs, i), r * S + s, take(chunks, r)
            ins, cts = at(bufs["w_in"], i, r), at(bufs["w_ct"], i, r)

            def grads():
                def one(_, inp):
                    p, l, a, g = inp
                    return None, f32(jax.vjp(lambda q: layer_fn(q, a, c * Lc + l, mb), p)[1](g)[0])
                return vary(jax.lax.scan(one, None, (chunk, jnp.arange(Lc), ins, cts))[1])
            return jax.lax.cond(ok, grads, lambda: zeros_like(chunk))

        # ---- the tick loop -----------------------------------------------------------------------------------
        def put(buf, i, r, value, ok):
            slot = schedule.key(i, r) % buf.shape[0]
            return jax.lax.dynamic_update_index_in_dim(buf, jnp.where(ok, value, take(buf, slot)), slot, 0)

        def add_at(acc, r, d):  # acc [v, Lc, ...] += d at local chunk r
            return jax.tree.map(lambda a, b: jax.lax.dynamic_update_index_in_dim(a, take(a, r) + b, r, 0), acc, d)

        def tick(carry, row):
            bufs, dchunks, dshared, loss, count, per_mb = carry
            (fm, fr, fo), (bm, br, bo), (wm, wr, wo) = row["f"], row["b"], row["w"]
            cf, cb = fr[s] * S + s, br[s] * S + s
            y, res = f_lane(bufs, fm[s], fr[s], fo[s] & (cf < C - 1))  # the last chunk's forward runs in its B
            role = jnp.where(bo[s], jnp.where(cb == 0, 0, jnp.where(cb == C - 1, 2, 1)), 3)
            if schedule.split:
                dsh, dx, ls, cnt, ins, cts = b_split(bufs, bm[s], br[s], role)
                dchunks = add_at(dchunks, wr[s], w_lane(bufs, wm[s], wr[s], wo[s]))
                bufs = dict(bufs, w_in=put(bufs["w_in"], bm[s], br[s], ins, bo[s]),
                            w_ct=put(bufs["w_ct"], bm[s], br[s], cts, bo[s]))
            else:
                dc, dsh, dx, ls, cnt = b_full(bufs, bm[s], br[s], role)
                dchunks = add_at(dchunks, br[s], dc)
            if res is not None:  # residuals of this tick's forward, kept until its B
                bufs = dict(bufs, res=[put(b, fm[s], fr[s], a, fo[s] & (cf < C - 1))
                                       for b, a in zip(bufs["res"], res)])
            # end of tick: activations to the next chunk's stage, cotangents to the previous one's (round the ring
            # when v > 1); each receiver files what arrived under (microbatch, its local chunk)
            ring = v > 1
            a_in = jax.lax.ppermute(y, AXIS, [(j, (j + 1) % S) for j in range(S if ring else S - 1)])
            g_in = jax.lax.ppermute(dx, AXIS, [((j + 1) % S, j) for j in range(S if ring else S - 1)])
            prev, nxt = (s - 1) % S, (s + 1) % S
            c_from, c_to = fr[prev] * S + prev + 1, br[nxt] * S + nxt - 1  # the chunks they are for
            bufs = dict(bufs, act=put(bufs["act"], fm[prev], c_from // S, a_in, fo[prev] & (c_from < C)),
                        grad=put(bufs["grad"], bm[nxt], c_to // S, g_in, bo[nxt] & (c_to >= 0)))
            per_mb = per_mb + jnp.where(jnp.arange(M) == bm[s], ls, 0.0)
            return (bufs, dchunks, jax.tree.map(jnp.add, dshared, dsh), loss + ls, count + cnt, per_mb), None

        buf = lambda n, *shape: vary(jnp.zeros((n,) + shape + act.shape, act.dtype))
        bufs = {"act": buf(R["act"]), "grad": buf(R["grad"])}
        if schedule.split:
            bufs["w_in"], bufs["w_ct"] = buf(R["wgrad"], Lc), buf(R["wgrad"], Lc)
        if not remat:
            bufs["res"] = [vary(jnp.zeros((R["res"],) + a.shape, a.dtype)) for a in res_shapes]
        init = (bufs, zeros_like(chunks), zeros_like(shared), zero(), zero(), vary(jnp.zeros((M,), jnp.float32)))
        (_, dchunks, dshared, loss, count, per_mb), _ = jax.lax.scan(tick, init, tables)
        dstacked = jax.tree.map(lambda a: a.reshape(v * Lc, *a.shape[2:]), dchunks)
        both = (AXIS, DATA)
        return (jax.lax.psum(loss, both), jax.lax.psum(count, both), jax.lax.psum(per_mb, both),
                jax.lax.psum(dshared, both), jax.lax.psum(dstacked, DATA))

    f = jax.shard_map(local, mesh=mesh, axis_names={AXIS, DATA},
                      in_specs=(P(), P(AXIS), P(None, DATA), P(), P()),
                      out_specs=(P(), P(), P(), P(), P(AXIS)))
    return f(shared, stacked, xs, seed, tables)
