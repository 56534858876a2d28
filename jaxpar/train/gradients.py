"""Gradient strategies: the loss and its gradients over one step's microbatches, three ways, chosen once per layout.

Each takes the microbatched inputs `xs` (leaves `[M, batch / M, ...]`: x, y int32 `[.., seq]`, w float32 mask,
ids int32 global row index, optional seg int32 `[.., seq]` document segments, optional routes int32
`[.., seq, layers, k]`: GRPO's routing replay, `Forward.block`) and offers

    loss_and_grads(params, xs, norm, rng, reg_norm) -> (loss_sum, grads of norm · loss_sum + reg_norm · the MoE
        regularisers, MoE stats summed over the batch or None, the objective's count)   (at least float32)
    loss(params, xs, objective=None, rng=None) -> (loss_sum, count)    (evaluation, a reference pass; `rng`: its
        dropout, keyed like the training pass's: DPO's reference with `dpo.dropout`)

The loss is the training objective's (`jaxpar/train/objectives/`), computed where the head runs.

- `Accumulate` (no pipeline): a scan over the microbatches on each data shard; ZeRO's reductions by hand
  (`zero.DataParallel`).
- `PipelineAutodiff` (GPipe, circular): the backward pass is autodiff of the pipeline's forward tick loop.
- `PipelineLoop` (1F1B, ZB-H1): the backward pass runs inside the tick loop; evaluation runs the circular forward
  loop over the same stage-major layer order.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar import model as gpt
from jaxpar.model import moe
from jaxpar.parallel import pipeline
from jaxpar.dtypes import at_least_f32
from jaxpar.parallel.logical import activation_rules, mesh_axes
from jaxpar.parallel.shard_map_body import vary
from jaxpar.parallel.sharding import CONTEXT, replica_axes, xs_specs



def _to_device(tree):
    """`tree` in device memory (inside a jitted function; the identity for what is there already)."""
    return jax.device_put(tree, jax.memory.Space.Device)


class Accumulate:
    """Microbatches accumulated in a `lax.scan` under `DataParallel.run` (manual over `data` when it has > 1 device).

    ZeRO-3 gathers each layer's params inside the layer scan and the shared ones once per microbatch."""

    def __init__(self, fwd: gpt.Forward, objective, dp, rules, mesh, fetch: bool = False):
        self.fwd, self.objective, self.dp, self.rules, self.mesh = fwd, objective, dp, rules, mesh
        self.gather_layer = dp.layer_gather(lambda tree: gpt.split_params(tree)[1])
        # optim.offload=params: the params arrive in host memory; each layer's are brought to the device inside the
        # layer scan, the rest once per microbatch, and the gradients (host-typed, as their params) come back
        self.fetch = _to_device if fetch else (lambda tree: tree)

    def loss_and_grads(self, params, xs, norm, rng, reg_norm=0.0):
        extras = {"norm": norm, "reg_norm": reg_norm, "rng": None if rng is None else jax.random.key_data(rng)}
        sums, grads = self.dp.run(self._per_shard, params, xs, extras)
        return sums["loss"], grads, sums["moe"], sums["count"]

    def _per_shard(self, params, xs, ex):
        """On one batch shard: grads of sum(loss) · norm + the MoE regularisers · reg_norm over M microbatches,
        reduced as the ZeRO stage says; -> ({"loss": loss sum, "moe": MoE stats summed, or None}, grads)."""
        rng = None if ex["rng"] is None else jax.random.wrap_key_data(ex["rng"])
        fwd, dp = self.fwd, self.dp

        def shared(p):
            rest, layers = gpt.split_params(p)
            return dp.gather_shared(gpt.join_params(self.fetch(rest), layers))

        trained, frozen = gpt.split_trainable(params, fwd.cfg)

        def grad_mb(mb):
            def f(t):  # differentiated with respect to what trains only (LoRA: no gradient of the base at all)
                p = gpt.merge_trainable(t, frozen)
                s, n, st = fwd.loss_and_stats(shared(p), mb["x"], mb["y"], mb["w"], rng, mb["ids"],
                                              prepare=lambda lp: self.gather_layer(self.fetch(lp)),
                                              segments=mb.get("seg"), positions=mb.get("pos"),
                                              head=lambda hp, x: self.objective.head(fwd, hp, x, mb),
                                              routes=mb.get("routes"))
                return s * ex["norm"] + moe.regulariser(st, fwd.cfg) * ex["reg_norm"], {"loss": s, "moe": st,
                                                                                        "count": n}

            g, sums = jax.grad(f, has_aux=True)(trained)
            return dp.reduce_microbatch(jax.tree.map(lambda a: a.astype(at_least_f32(a.dtype)), self.fetch(g))), sums

        def body(carry, mb):
            g, sums = grad_mb(mb)
            return jax.tree.map(jnp.add, carry, (g, sums)), None

        with activation_rules(self.rules, None if dp.manual else self.mesh, manual=dp.manual):
            shapes = jax.eval_shape(grad_mb, jax.tree.map(lambda a: a[0], xs))
            zeros = lambda a: vary(jnp.zeros(a.shape, a.dtype))  # noqa: E731
            (grads, sums), _ = jax.lax.scan(body, jax.tree.map(zeros, shapes), xs)
        return sums, grads

    def loss(self, params, xs, objective=None, rng=None):
        objective = objective or self.objective
        if CONTEXT not in self.dp.manual:
            return self._loss(params, xs, objective, rng=rng)
        # context parallel: each device runs its piece of every sequence, under the same manual region as training
        with activation_rules(self.rules, None, manual=self.dp.manual):
            return self.dp.run_forward(
                lambda p, x: self._loss(p, x, objective, self.dp.gather_shared, self.gather_layer), params, xs)

    def _loss(self, params, xs, objective, gather=lambda p: p, prepare=None, rng=None):
        def one(mb):
            return self.fwd.loss_and_stats(gather(params), mb["x"], mb["y"], mb["w"], rng, mb["ids"], prepare=prepare,
                                           segments=mb.get("seg"), positions=mb.get("pos"),
                                           head=lambda hp, x: objective.head(self.fwd, hp, x, mb),
                                           routes=mb.get("routes"))[:2]

        def body(acc, mb):
            return jax.tree.map(jnp.add, acc, one(mb)), None

        shapes = jax.eval_shape(one, jax.tree.map(lambda a: a[0], xs))
        zeros = vary(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes))
        return jax.lax.scan(body, zeros, xs)[0]


class PipelineAutodiff:
    """The pipeline over `stage` (GPipe, circular); grads by autodiff of its tick loop.

    The pipeline's shard_map is manual over `stage` and `data`: the data-parallel gradient reduction is one psum per
    step, after the tick loop. The params enter and the grads leave the tick loop unsharded over `data` (ZeRO-3
    gathers the stage's params once, before the loop; ZeRO-2 scatters after it): a `data` collective that the
    compiler would place inside a stage's `cond` is one the devices of other stages never join."""

    def __init__(self, fwd: gpt.Forward, objective, forward_table, mesh, rules, unsharded, remat: bool,
                 skip_bubbles: bool, per_row=()):
        self.fwd, self.objective, self.forward_table, self.mesh, self.rules = fwd, objective, forward_table, mesh, rules
        self.unsharded, self.remat, self.skip_bubbles, self.per_row = unsharded, remat, skip_bubbles, per_row
        # manual with `stage`: the params' replica axes (`data` always; `expert`, `context` with > 1 device)
        self.batch_axes = ("data",) + tuple(a for a in replica_axes(mesh) if a != "data")
        self.manual = ("stage",) + self.batch_axes
        # the stacked layers' shardings over the manual axes: `stage` on the layers, `expert` on the routed experts
        man = lambda sh: P(*[tuple(a for a in mesh_axes(e) if a in self.manual) or None for e in sh.spec])  # noqa
        self.stacked_specs = jax.tree.map(man, gpt.split_params(unsharded)[1])

    def fence(self, tree):
        return jax.lax.with_sharding_constraint(tree, self.unsharded)

    def fence_grads(self, grads):
        """The gradients (of what trains: `model.trainable`) where `fence` puts their params, at least float32."""
        grads = jax.tree.map(lambda a: a.astype(at_least_f32(a.dtype)), grads)
        return jax.lax.with_sharding_constraint(grads, gpt.trainable(self.unsharded, self.fwd.cfg))

    def _ends(self, params, rng, objective=None):
        """(shared params, layer params, the pipeline's first and last functions over one microbatch)."""
        shared, layers = gpt.split_params(params)
        objective = objective or self.objective
        first = lambda sh, mb: self.fwd.embed(sh, mb["x"], rng, mb["ids"], segments=mb.get("seg"),  # noqa: E731
                                              positions=mb.get("pos"))
        last = lambda sh, a, mb: objective.head(self.fwd, sh, a, mb)  # noqa: E731
        return shared, layers, first, last

    def _forward(self, params, xs, rng, objective=None):
        """(loss_sum, count, per-microbatch sums) of all microbatches through the forward tick loop."""
        tab = self.forward_table
        Lc = self.fwd.cfg.layers // (tab.stages * tab.virtual)
        shared, layers, first, last = self._ends(params, rng, objective)
        cfg = self.fwd.cfg

        def stage(chunk, a, cid, mb):
            y, st = self.fwd.layers_and_stats(chunk, a, rng, mb["ids"], first_layer=cid * Lc, segments=mb.get("seg"),
                                              positions=mb.get("pos"), routes=mb.get("routes"))
            return y, moe.regulariser(st, cfg), st

        with activation_rules(self.rules, None, manual=self.manual):
            return pipeline.run(first, stage, last, shared, layers, xs, tab, self.mesh, remat=self.remat,
                                skip_bubbles=self.skip_bubbles, batch_axes=self.batch_axes,
                                stacked_specs=self.stacked_specs, xs_specs=xs_specs(xs, self.mesh, self.per_row))

    def loss_and_grads(self, params, xs, norm, rng, reg_norm=0.0):
        trained, frozen = gpt.split_trainable(params, self.fwd.cfg)

        def f(t):
            lsum, count, _, reg, stats = self._forward(self.fence(gpt.merge_trainable(t, frozen)), xs, rng)
            return lsum * norm + reg * reg_norm, (lsum, stats, count)

        grads, (lsum, stats, count) = jax.grad(f, has_aux=True)(trained)
        return lsum, self.fence_grads(grads), stats, count

    def loss(self, params, xs, objective=None, rng=None):
        return self._forward(self.fence(params), xs, rng, objective)[:2]


class PipelineLoop(PipelineAutodiff):
    """The pipeline with the backward pass inside the tick loop (1F1B, ZB-H1); `table` is its loop tick table."""

    def __init__(self, fwd: gpt.Forward, objective, table, forward_table, *args):
        super().__init__(fwd, objective, forward_table, *args)
        self.table = table

    def loss_and_grads(self, params, xs, norm, rng, reg_norm=0.0):
        shared, layers, first, last = self._ends(self.fence(params), rng)
        cfg = self.fwd.cfg
        (shared, fshared), (layers, flayers) = (gpt.split_trainable(t, cfg) for t in (shared, layers))
        specs, fspecs = gpt.split_trainable(self.stacked_specs, cfg)

        def layer(p, a, index, mb):
            y, st = self.fwd.block(p, a, rng, mb["ids"], index, segments=mb.get("seg"), stats=True,
                                   positions=mb.get("pos"), routes=mb.get("routes"))
            return y, moe.regulariser(st, cfg), st

        with activation_rules(self.rules, None, manual=self.manual):
            lsum, count, _, dshared, dlayers, stats = pipeline.run_loop(
                first, layer, last, shared, layers, xs, self.table, self.mesh, jnp.asarray(norm),
                remat=self.remat, reg_seed=reg_norm, batch_axes=self.batch_axes, stacked_specs=specs,
                xs_specs=xs_specs(xs, self.mesh, self.per_row), frozen=(fshared, flayers, fspecs),
                join=gpt.merge_trainable)
        return lsum, self.fence_grads(gpt.join_params(dshared, dlayers)), stats, count
