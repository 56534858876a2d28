"""The pipeline with the backward pass inside the loop: 1F1B and ZB-H1 over the mesh axis `stage`, one SPMD program.

GPipe through autodiff (`jaxpar/parallel/pipeline/autodiff.py`) keeps what every in-flight microbatch needs for its backward
pass until the loop ends, O(M). Here each tick of a `lax.scan` runs up to three lanes per stage, from a loop table
(`jaxpar/parallel/pipeline/tables.py`): F (forward), B (backward by `jax.vjp`; the input gradient only when the schedule
splits it) and W (the weight gradient of a split schedule), each on one microbatch and one of the stage's v chunks
of layers (interleaved 1F1B: v > 1). Activations travel to the next chunk's stage and cotangents to the previous
one's with `ppermute` at the end of every tick (round the ring of stages when v > 1). A stage keeps, in fixed-size
ring buffers indexed by `Schedule.key(microbatch, chunk)` mod R (R read off the table: O(v·S), never O(M)):

- its stage inputs until their B (`remat=True`: B recomputes the stage's forward from them), or the vjp residuals
  of the stage's layers (`remat=False`: no recompute);
- with a split schedule, each layer's input and output cotangent `[Lc, ...]` from B until W (W = the per-layer vjp
  with respect to the weights only; B's per-layer cotangents come from a zero "tap" added to each layer's output).

Knows nothing about GPT. The caller supplies, over one microbatch `mb` (a slice of the `xs` pytree):

    first_fn(shared, mb)             -> activation          (stage 0: e.g. the embedding; recomputed in B)
    layer_fn(layer, act, index, mb)  -> activation, or (activation, aux, stats)
                                        (one layer; `index` = global layer index; aux: a scalar the layer adds to
                                         the objective, its cotangent `reg_seed`; stats: a pytree summed over
                                         microbatches per layer, or None)
    last_fn(shared, act, mb)         -> (loss_sum, count)   (last stage: e.g. final norm, head, loss)

The last stage computes its loss inside its B (forward, head, loss and vjp at once), so the head's cotangent is ready
there and then, and the shared params (embedding, head) get one gradient, summed over stages once after the loop.
Bubbles are `lax.cond`/`lax.switch` branches that compute nothing.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.dtypes import at_least_f32
from jaxpar.parallel.shard_map_body import put as put_at, take, vary
from jaxpar.parallel.pipeline.autodiff import AXIS, DATA, _xs_specs, with_side
from jaxpar.parallel.pipeline.tables import LANES, Schedule

FIRST, MIDDLE, LAST, IDLE = range(4)  # a B lane's role: the chunk's place in the model, or no work


def run(first_fn, layer_fn, last_fn, shared, stacked, xs, schedule: Schedule, mesh, seed, *,
        remat: bool = True, reg_seed=0.0, batch_axes=(DATA,), stacked_specs=None, xs_specs=None,
        frozen=None, join=None):
    """Loss and gradients of `seed · Σ_microbatches loss_sum` through the pipeline.

    Args:
      shared: params of first_fn / last_fn, replicated (pytree).
      stacked: the layers' params, leaves `[L, ...]` in stage-major order (`tables.to_stage_major`: with v chunks
        per stage, stage s holds chunks s, s + S, ...), sharded on `stage` along axis 0, replicated over `data`.
      xs: per-microbatch inputs, leaves `[M, batch / M, ...]`, rows sharded on `data` (axis 1).
      seed: scalar in the loss sum's dtype, the cotangent of each microbatch's loss_sum (e.g. 1 / tokens of the global batch).
      remat: True: keep stage inputs and recompute the forward in B; False: keep the vjp residuals (1F1B only).
      reg_seed: the cotangent of each layer's aux (e.g. the MoE regularisers' weight over the global batch).
      batch_axes, stacked_specs, xs_specs: as in `autodiff.run` (the params' replica axes; `stacked`'s and `xs`'s
        specs over the manual axes).
      frozen: (frozen shared, frozen stacked, the frozen stacked's specs), params the functions use that get no
        gradient (e.g. a base model under adapters): the functions get `join(params, frozen params)`; None: none.

    Returns:
      (loss_sum, count, per-microbatch loss sums `[M]`, shared grads, stacked grads, layer stats `[L, ...]`): sums
      in `last_fn`'s dtypes, grads at least float32 (`dtypes.at_least_f32`: float64 in float64 runs), summed over
      microbatches and the batch axes each parameter is replicated over (one all-reduce per step), grads shaped like
      `shared` / `stacked`, stats in `stacked`'s stage-major order.
    """
    if not remat and schedule.split:
        raise ValueError(f"remat=False with the split schedule {schedule.name!r} (see pipeline.registry.errors)")
    tables = {k: (jnp.asarray(schedule.mb[k]), jnp.asarray(schedule.rep[k]), jnp.asarray(schedule.ok[k]))
              for k in LANES}
    specs = jax.tree.map(lambda _: P(AXIS), stacked) if stacked_specs is None else stacked_specs
    fshared, fstacked, fspecs = ({}, {}, {}) if frozen is None else frozen
    engine = _Engine(first_fn, with_side(layer_fn), last_fn, schedule, remat, tuple(batch_axes), specs,
                     join or (lambda p, _: p))
    f = jax.shard_map(engine.local, mesh=mesh, axis_names={AXIS, *batch_axes},
                      in_specs=(P(), specs, _xs_specs(xs, batch_axes, xs_specs), P(), P(), P(), P(), fspecs),
                      out_specs=(P(), P(), P(), P(), specs, P(AXIS)))
    return f(shared, stacked, xs, seed, jnp.asarray(reg_seed), tables, fshared, fstacked)


def _f32(t):
    """Gradients in their buffer dtype: at least float32 (float64 in float64 reference runs)."""
    return jax.tree.map(lambda a: a.astype(at_least_f32(a.dtype)), t)


def _zeros_like(t):
    return vary(jax.tree.map(lambda a: jnp.zeros(a.shape, at_least_f32(a.dtype)), t))


class _Engine:
    """The per-device body of `run`. `local` sets the device's context (stage index, its chunks, the activation
    shape), then scans `_tick`; each tick runs the lanes, files their outputs in the ring buffers and exchanges."""

    def __init__(self, first_fn, layer_fn, last_fn, schedule: Schedule, remat: bool, batch_axes, specs, join):
        # the callers' functions get the params joined with their frozen part (none: the params as they are)
        self.first_fn = lambda sh, mb: first_fn(join(sh, self.fshared), mb)
        self.last_fn = lambda sh, a, mb: last_fn(join(sh, self.fshared), a, mb)
        self.layer_fn = lambda p, a, index, mb, fp: layer_fn(join(p, fp), a, index, mb)
        self.sc, self.remat, self.batch_axes = schedule, remat, batch_axes
        # each stacked leaf's gradient is summed over the batch axes it is replicated over (not `expert` for experts)
        self.reduce_axes = jax.tree.map(lambda p: tuple(a for a in batch_axes if a not in p), specs,
                                        is_leaf=lambda p: isinstance(p, P))
        self.R = {k: schedule.ring(k) for k in ("act", "grad", "res", "wgrad")}
        self._pull_def = None  # the treedef of a chunk's vjp function (a pytree whose leaves are its residuals)

    def local(self, shared, stacked, xs, seed, reg_seed, tables, fshared, fstacked):
        sc, v = self.sc, self.sc.virtual
        self.s = jax.lax.axis_index(AXIS)
        # per device like the params (a custom VJP's cotangent of a frozen param is per device too, then dropped)
        self.fshared = vary(fshared)
        self.fchunks = jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), vary(fstacked))
        # gradients stay per device until the end
        self.shared, stacked, self.seed, self.xs = vary(shared), vary(stacked), vary(seed), xs
        self.chunks = jax.tree.map(lambda a: a.reshape(v, a.shape[0] // v, *a.shape[1:]), stacked)  # [v, Lc, ...]
        self.Lc = jax.tree.leaves(stacked)[0].shape[0] // v
        self.act = jax.eval_shape(self.first_fn, self.shared, take(xs, 0))
        self.out_shapes = jax.eval_shape(lambda sh, mb: self.last_fn(sh, self._zact(), mb), self.shared, take(xs, 0))
        self.seed = self.seed.astype(self.out_shapes[0].dtype)  # the cotangent of a loss sum has its dtype
        aux, self.stats = jax.eval_shape(lambda: self._stage(take(self.chunks, 0), self._zact(), 0, take(xs, 0),
                                                             fchunk=take(self.fchunks, 0))[2:])
        self.reg_seed = vary(reg_seed.astype(aux.dtype))  # the cotangent of the layers' aux has its dtype
        if not self.remat:  # the residuals' shapes
            self.res_shapes = jax.eval_shape(
                lambda: self._fwd_vjp(self._zact(), take(self.chunks, 0), self.s, take(xs, 0),
                                      take(self.fchunks, 0)))[1]
        init = (self._buffers(), _zeros_like(self.chunks), _zeros_like(self.shared), *self._zeros(),
                vary(jnp.zeros((sc.microbatches,), self.out_shapes[0].dtype)),
                vary(jax.tree.map(lambda a: jnp.zeros((v,) + a.shape, a.dtype), self.stats)))
        (_, dchunks, dshared, loss, count, per_mb, stats), _ = jax.lax.scan(self._tick, init, tables)
        flat = lambda t: jax.tree.map(lambda a: a.reshape(v * self.Lc, *a.shape[2:]), t)  # noqa: E731
        every = (AXIS, *self.batch_axes)
        dstacked = jax.tree.map(lambda g, ax: jax.lax.psum(g, ax) if ax else g, flat(dchunks), self.reduce_axes)
        return (jax.lax.psum(loss, every), jax.lax.psum(count, every), jax.lax.psum(per_mb, every),
                jax.lax.psum(dshared, every), dstacked, jax.lax.psum(flat(stats), self.batch_axes))

    # ---- pieces -------------------------------------------------------------------------------------------------
    def _zeros(self):
        """Per-device zero (loss_sum, count) in the shapes and dtypes `last_fn` returns (float64 loss sums in float64
        runs; a count may be any array: summed)."""
        return tuple(vary(jnp.zeros(a.shape, a.dtype)) for a in self.out_shapes)

    def _zact(self):
        return vary(jnp.zeros(self.act.shape, self.act.dtype))

    def _stage(self, chunk, x, c, mb, taps=None, fchunk=None):
        """Global chunk c's Lc layers -> (output, the layer inputs `[Lc, ...]`, the layers' aux summed, their stats
        `[Lc, ...]`); `taps` `[Lc, ...]` are added to the layer outputs; `fchunk`: the chunk's frozen params."""
        def one(a, inp):
            p, fp, l, tap = inp
            y, aux, st = self.layer_fn(p, a, c * self.Lc + l, mb, fp)
            return (y if tap is None else y + tap), (a, aux, st)
        y, (ins, aux, st) = jax.lax.scan(one, x, (chunk, fchunk, jnp.arange(self.Lc), taps))
        return y, ins, jnp.sum(aux), st

    def _diff(self, chunk, x, c, mb, taps=None, fchunk=None):
        """`_stage` as (differentiated outputs (y, aux), (layer inputs, stats))."""
        y, ins, aux, st = self._stage(chunk, x, c, mb, taps, fchunk)
        return (y, vary(aux)), (ins, st)  # aux typed like its cotangent `reg_seed` (varying: a constant 0 is not)

    def _ct(self, g):
        """The cotangent of a chunk's (y, aux): the activation's, and `reg_seed` for the aux."""
        return g, self.reg_seed

    def _fwd_vjp(self, x, chunk, c, mb, fchunk):
        """Chunk forward keeping the vjp's residuals: (y, residual leaves, stats)."""
        (y, _), pull, (_, st) = jax.vjp(lambda p, a: self._diff(p, a, c, mb, fchunk=fchunk), chunk, x,
                                        has_aux=True)
        leaves, self._pull_def = jax.tree.flatten(pull)
        return y, leaves, st

    def _pull_from(self, res):
        return jax.tree.unflatten(self._pull_def, res)

    def _slot(self, i, r):
        """Microbatch i on local chunk r: (its inputs, global chunk index, the chunk's params, its frozen params)."""
        return take(self.xs, i), self.sc.chunk(r, self.s), take(self.chunks, r), take(self.fchunks, r)

    @staticmethod
    def _by_role(role, first, middle, last, idle):
        return jax.lax.switch(role, [lambda: vary(first()), lambda: vary(middle()), lambda: vary(last()), idle])

    # ---- ring buffers ------------------------------------------------------------------------------------------
    def _buffers(self) -> dict:
        act = self.act
        buf = lambda n, *shape: vary(jnp.zeros((n,) + shape + act.shape, act.dtype))
        bufs = {"act": buf(self.R["act"]), "grad": buf(self.R["grad"])}
        if self.sc.split:
            bufs["w_in"], bufs["w_ct"] = buf(self.R["wgrad"], self.Lc), buf(self.R["wgrad"], self.Lc)
        if not self.remat:
            bufs["res"] = [vary(jnp.zeros((self.R["res"],) + a.shape, a.dtype)) for a in self.res_shapes]
        return bufs

    def _at(self, buf, i, r):
        return take(buf, self.sc.key(i, r) % jax.tree.leaves(buf)[0].shape[0])

    def _put(self, buf, i, r, value, ok):
        slot = self.sc.key(i, r) % buf.shape[0]
        return put_at(buf, slot, jnp.where(ok, value, take(buf, slot)))

    # ---- lanes: microbatch i through local chunk r -------------------------------------------------------------
    def _zstats(self):
        return vary(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), self.stats))

    def _f_lane(self, bufs, i, r, ok):
        """Forward of a chunk before the last: -> (activation to send, residuals or None, the layers' stats)."""
        mb, c, chunk, fchunk = self._slot(i, r)
        x = lambda: jax.lax.cond(c == 0, lambda: vary(self.first_fn(self.shared, mb)),
                                 lambda: self._at(bufs["act"], i, r))
        if self.remat:
            y, st = jax.lax.cond(ok, lambda: vary(self._stage(chunk, x(), c, mb, fchunk=fchunk)[::3]),
                                 lambda: (self._zact(), self._zstats()))
            return y, None, st
        zres = lambda: vary([jnp.zeros(a.shape, a.dtype) for a in self.res_shapes])
        return jax.lax.cond(ok, lambda: vary(self._fwd_vjp(x(), chunk, c, mb, fchunk)),
                            lambda: (self._zact(), zres(), self._zstats()))

    def _last(self, sh, a, mb, stage):
        """The last chunk and the loss: (((loss_sum, count), aux), (layer inputs, stats)); `stage(a)` -> `_diff`."""
        (y, aux), side = stage(a)
        return (self.last_fn(sh, y, mb), aux), side

    def _b_full(self, bufs, i, r, role):
        """Backward (input and weight gradients) -> (chunk grads, shared grads, dx, loss, count, stats of the last
        chunk, whose forward runs here)."""
        mb, c, chunk, fchunk = self._slot(i, r)
        g, x, shared = self._at(bufs["grad"], i, r), self._at(bufs["act"], i, r), self.shared

        def first():
            if self.remat:
                _, pull, _ = jax.vjp(lambda p, sh: self._diff(p, self.first_fn(sh, mb), c, mb, fchunk=fchunk), chunk,
                                     shared, has_aux=True)
                dc, dsh = pull(self._ct(g))
            else:
                dc, da = self._pull_from(self._at(bufs["res"], i, r))(self._ct(g))
                dsh = jax.vjp(lambda sh: self.first_fn(sh, mb), shared)[1](da)[0]
            return _f32(dc), _f32(dsh), self._zact(), *self._zeros(), self._zstats()

        def middle():
            if self.remat:
                dc, dx = jax.vjp(lambda p, a: self._diff(p, a, c, mb, fchunk=fchunk), chunk, x,
                                 has_aux=True)[1](self._ct(g))
            else:
                dc, dx = self._pull_from(self._at(bufs["res"], i, r))(self._ct(g))
            return _f32(dc), _zeros_like(shared), dx, *self._zeros(), self._zstats()

        def last():
            ((ls, cnt), _), pull, (_, st) = jax.vjp(
                lambda p, sh, a: self._last(sh, a, mb, lambda a: self._diff(p, a, c, mb, fchunk=fchunk)), chunk,
                shared, x, has_aux=True)
            dc, dsh, dx = pull(((self.seed, jnp.zeros_like(cnt)), self.reg_seed))
            return _f32(dc), _f32(dsh), dx, ls, cnt, st

        idle = lambda: (_zeros_like(chunk), _zeros_like(shared), self._zact(), *self._zeros(), self._zstats())
        return self._by_role(role, first, middle, last, idle)

    def _b_split(self, bufs, i, r, role):
        """Input-gradient backward -> (shared grads, dx, loss, count, layer inputs, layer output cotangents, stats of
        the last chunk)."""
        mb, c, chunk, fchunk = self._slot(i, r)
        g, x, shared = self._at(bufs["grad"], i, r), self._at(bufs["act"], i, r), self.shared
        taps0 = vary(jnp.zeros((self.Lc,) + self.act.shape, self.act.dtype))
        stage = lambda a, t: self._diff(chunk, a, c, mb, t, fchunk)

        def first():
            _, pull, (ins, _) = jax.vjp(lambda sh, t: stage(self.first_fn(sh, mb), t), shared, taps0, has_aux=True)
            dsh, cts = pull(self._ct(g))
            return _f32(dsh), self._zact(), *self._zeros(), ins, cts, self._zstats()

        def middle():
            _, pull, (ins, _) = jax.vjp(stage, x, taps0, has_aux=True)
            dx, cts = pull(self._ct(g))
            return _zeros_like(shared), dx, *self._zeros(), ins, cts, self._zstats()

        def last():
            ((ls, cnt), _), pull, (ins, st) = jax.vjp(lambda sh, a, t: self._last(sh, a, mb, lambda a: stage(a, t)),
                                                      shared, x, taps0, has_aux=True)
            dsh, dx, cts = pull(((self.seed, jnp.zeros_like(cnt)), self.reg_seed))
            return _f32(dsh), dx, ls, cnt, ins, cts, st

        idle = lambda: (_zeros_like(shared), self._zact(), *self._zeros(), taps0, taps0, self._zstats())
        return self._by_role(role, first, middle, last, idle)

    def _w_lane(self, bufs, i, r, ok):
        """Weight gradient from B's saved layer inputs and output cotangents (per-layer vjp, weights only)."""
        mb, c, chunk, fchunk = self._slot(i, r)
        ins, cts = self._at(bufs["w_in"], i, r), self._at(bufs["w_ct"], i, r)

        def grads():
            def one(_, inp):
                p, fp, l, a, g = inp
                f = lambda q: (lambda y, aux, _: (y, vary(aux)))(*self.layer_fn(q, a, c * self.Lc + l, mb, fp))  # noqa
                return None, _f32(jax.vjp(f, p)[1](self._ct(g))[0])
            return vary(jax.lax.scan(one, None, (chunk, fchunk, jnp.arange(self.Lc), ins, cts))[1])
        return jax.lax.cond(ok, grads, lambda: _zeros_like(chunk))

    # ---- the tick ----------------------------------------------------------------------------------------------
    def _tick(self, carry, row):
        bufs, dchunks, dshared, loss, count, per_mb, stats = carry
        (fm, fr, fo), (bm, br, bo), (wm, wr, wo) = row["f"], row["b"], row["w"]
        s, C = self.s, self.sc.virtual * self.sc.stages
        cf, cb = self.sc.chunk(fr[s], s), self.sc.chunk(br[s], s)
        fwd_ok = fo[s] & (cf < C - 1)  # the last chunk's forward runs in its B
        y, res, st = self._f_lane(bufs, fm[s], fr[s], fwd_ok)
        stats = _add_at(stats, fr[s], st)
        role = jnp.where(bo[s], jnp.where(cb == 0, FIRST, jnp.where(cb == C - 1, LAST, MIDDLE)), IDLE)
        if self.sc.split:
            dsh, dx, ls, cnt, ins, cts, st = self._b_split(bufs, bm[s], br[s], role)
            dchunks = _add_at(dchunks, wr[s], self._w_lane(bufs, wm[s], wr[s], wo[s]))
            bufs = dict(bufs, w_in=self._put(bufs["w_in"], bm[s], br[s], ins, bo[s]),
                        w_ct=self._put(bufs["w_ct"], bm[s], br[s], cts, bo[s]))
        else:
            dc, dsh, dx, ls, cnt, st = self._b_full(bufs, bm[s], br[s], role)
            dchunks = _add_at(dchunks, br[s], dc)
        stats = _add_at(stats, br[s], st)
        if res is not None:  # residuals of this tick's forward, kept until its B
            bufs = dict(bufs, res=[self._put(b, fm[s], fr[s], a, fwd_ok) for b, a in zip(bufs["res"], res)])
        bufs = self._exchange(bufs, row, y, dx)
        per_mb = per_mb + jnp.where(jnp.arange(self.sc.microbatches) == bm[s], ls, 0.0)
        return (bufs, dchunks, jax.tree.map(jnp.add, dshared, dsh), loss + ls, count + cnt, per_mb, stats), None

    def _exchange(self, bufs, row, y, dx):
        """End of tick: activations to the next chunk's stage, cotangents to the previous one's (round the ring when
        v > 1); each receiver files what arrived under (microbatch, its local chunk)."""
        sc, s = self.sc, self.s
        (fm, fr, fo), (bm, br, bo) = row["f"], row["b"]
        S, C = sc.stages, sc.virtual * sc.stages
        a_in = jax.lax.ppermute(y, AXIS, sc.sends("f"))
        g_in = jax.lax.ppermute(dx, AXIS, sc.sends("b"))
        prev, nxt = (s - 1) % S, (s + 1) % S
        c_from, c_to = sc.chunk(fr[prev], prev) + 1, sc.chunk(br[nxt], nxt) - 1  # the chunks they are for
        return dict(bufs, act=self._put(bufs["act"], fm[prev], sc.local(c_from), a_in, fo[prev] & (c_from < C)),
                    grad=self._put(bufs["grad"], bm[nxt], sc.local(c_to), g_in, bo[nxt] & (c_to >= 0)))


def _add_at(acc, r, d):
    """acc `[v, Lc, ...]` += d at local chunk r."""
    return jax.tree.map(lambda a, b: put_at(a, r, take(a, r) + b), acc, d)
