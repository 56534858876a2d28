"""Data parallelism with ZeRO's gradient reduction, written by hand over the parameters' replica axes (`data`;
`expert` when the experts are split; `context` when the sequence is: `sharding.REPLICA_AXES`).

Left to the compiler, the gradient of a replicated parameter inside a microbatch loop (or the pipeline's tick loop)
is all-reduced at every iteration, and XLA:CPU turns a reduce-scatter into an all-reduce plus a slice. So the
loss-and-grads function runs under `shard_map`, manual over the replica axes only (tensor and stage stay with the
compiler and the pipeline), on this shard's rows (and, with `context`, its piece of each sequence), and the reduction
is explicit, as in ZeRO (Rajbhandari et al. 2020, sec. 5):

| ZeRO stage | params inside            | per microbatch                 | at the end of the step |
|------------|--------------------------|--------------------------------|------------------------|
| 0, 1       | replicated               | accumulate locally (full size) | one all-reduce (psum)  |
| 2          | replicated               | reduce-scatter into a 1/N buffer | —                    |
| 3          | sharded; gathered layer by layer where used (the gather's transpose is the reduce-scatter) | — | — |

Each parameter is replicated over, sharded by ZeRO over, and reduced over its own replica axes (`sharding.zero_axes`):
all of them for every parameter but a routed expert's weights, which are split over `expert` already and use `data`
(and `context`) only
(the all-to-all inside the MoE layer, `logical.exchange_experts`, brought them every token they serve).
A parameter too small to split stays replicated and is all-reduced once at the end, whatever the stage.
ZeRO-3's gathers are keyed by logical axis names: a leaf with a `layers` axis is gathered one layer at a time inside
the layer scan (`layer_gather`), the others (embeddings, final norm) once per microbatch (`gather_shared`).
"""
from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jaxpar.parallel.logical import mesh_axes
from jaxpar.parallel.shard_map_body import vary
from jaxpar.parallel.sharding import replica_axes, xs_specs, zero_axes, zero_dim

LAYERS = "layers"  # the logical axis of stacked per-layer params (scanned over, so absent inside a layer)


def _manual_only(spec: P, manual: tuple) -> P:
    """`spec` with only the mesh axes in `manual` (what a shard_map's in/out specs may name)."""
    keep = lambda ax: tuple(a for a in mesh_axes(ax) if a in manual)  # noqa: E731
    return P(*[(k[0] if len(k) == 1 else k) if (k := keep(ax)) else None for ax in spec])


class DataParallel:
    """Per-leaf plan for the params/grads trees: its batch axes, where ZeRO splits it over them, and how its gradient
    is reduced.

    Args:
      base_specs, param_specs, grad_specs: `PartitionSpec` trees of the params without ZeRO, of the params, and of
        the float32 gradient buffer.
      zero_stage: 0-3 (`optim.zero_stage`).
      names: the params tree of logical axis names (tuples), for the ZeRO-3 gathers.
      select: params-shaped tree -> the part that has gradients (`grad_specs`' structure; LoRA: the adapters).
    """

    def __init__(self, mesh, base_specs, param_specs, grad_specs, zero_stage: int, names, select=lambda t: t,
                 per_row=()):
        self.mesh, self.names, self.per_row = mesh, names, tuple(per_row)  # (`sharding.xs_specs`)
        self.manual = replica_axes(mesh)  # mesh axes that are manual inside `run` (none: no shard_map at all)
        is_p = lambda x: isinstance(x, P)  # noqa: E731
        self.axes = jax.tree.map(lambda b: zero_axes(b, mesh), base_specs, is_leaf=is_p)
        self.pspec, self.gspec = param_specs, grad_specs
        self.pdim = jax.tree.map(zero_dim, param_specs, self.axes, is_leaf=is_p)
        # the gradients' side: the trees below have `grad_specs`' structure
        self.gaxes, self.gpspec = select(self.axes), select(param_specs)
        self.gdim = jax.tree.map(lambda g, a: zero_dim(g, a) if zero_stage >= 2 else None, grad_specs, self.gaxes,
                                 is_leaf=is_p)
        # 'ad': gathered param, AD already reduce-scatters; 'scatter': reduce-scatter per microbatch; 'sum': psum
        self.mode = jax.tree.map(lambda p, g: "ad" if p is not None else ("scatter" if g is not None else "sum"),
                                 select(self.pdim), self.gdim, is_leaf=lambda x: x is None or isinstance(x, int))

    def _map(self, fn, *trees):
        return jax.tree.map(fn, *trees, is_leaf=lambda x: x is None or isinstance(x, P))

    def gather(self, params, pdim, axes):
        """All-gather the ZeRO-sharded leaves of `params` (ZeRO-3) along their split dims; others unchanged."""
        return jax.tree.map(lambda a, d, ax: a if d is None else jax.lax.all_gather(a, ax, axis=d, tiled=True),
                            params, pdim, axes, is_leaf=lambda x: x is None)

    def gather_shared(self, params):
        """ZeRO-3: all-gather the sharded leaves without a `layers` axis; the per-layer leaves unchanged."""
        return jax.tree.map(lambda a, d, ax, n: a if LAYERS in n or d is None
                            else jax.lax.all_gather(a, ax, axis=d, tiled=True),
                            params, self.pdim, self.axes, self.names, is_leaf=lambda x: x is None)

    def layer_gather(self, select):
        """ZeRO-3: a function that all-gathers one layer's params (the leaves of `select(params)` without their
        `layers` axis, as inside the layer scan). `select` picks the per-layer subtree from a params-shaped tree."""
        def within_layer(d, n):
            return None if d is None or LAYERS not in n else d - (n.index(LAYERS) < d)
        dims = select(jax.tree.map(within_layer, self.pdim, self.names, is_leaf=lambda x: x is None))
        axes = select(self.axes)
        return lambda layer_params: self.gather(layer_params, dims, axes)

    def reduce_microbatch(self, grads):
        """Inside the shard_map: reduce-scatter the 'scatter' leaves (ZeRO-2), leave the rest local."""
        def r(g, mode, d, ax):
            return jax.lax.psum_scatter(g, ax, scatter_dimension=d, tiled=True) if mode == "scatter" else g
        return jax.tree.map(r, grads, self.mode, self.gdim, self.gaxes, is_leaf=lambda x: x is None)

    def reduce_end(self, grads):
        """Inside the shard_map: all-reduce the 'sum' leaves (accumulated locally over the microbatches) over their
        batch axes."""
        return jax.tree.map(lambda g, mode, ax: jax.lax.psum(g, ax) if mode == "sum" and ax else g,
                            grads, self.mode, self.gaxes, is_leaf=lambda x: x is None)

    def psum(self, x):
        """Sum over every batch axis (loss sums, MoE load counts)."""
        return jax.tree.map(lambda a: jax.lax.psum(a, self.manual), x) if self.manual else x

    def run_forward(self, fn, params, xs):
        """`fn(params, xs) -> sums` (no gradients: evaluation) on each shard, summed over the shards."""
        man = lambda spec: _manual_only(spec, self.manual)  # noqa: E731
        f = jax.shard_map(lambda p, x: self.psum(fn(p, x)), mesh=self.mesh, axis_names=set(self.manual),
                          in_specs=(self._map(man, self.pspec), xs_specs(xs, self.mesh, self.per_row)),
                          out_specs=P())
        return f(params, xs)

    def run(self, fn, params, xs, extras):
        """Call `fn(params, xs, extras) -> (sums, grads)` on each batch shard; returns the sums added over the shards
        (a pytree: the loss sum, MoE stats) and the reduced grads (sharded where ZeRO >= 2 says so).

        Inside `fn`, `params` are per-shard values: replicated leaves are marked varying (so their gradients stay
        local until `reduce_*`), ZeRO-3 leaves are this shard's slice (gather them with `gather` where used), and a
        routed expert's weights hold this device's experts.
        xs leaves are `[M, micro_batch, ...]` split over the batch axes on axis 1; `extras` are replicated.
        """
        if not self.manual:
            return fn(params, xs, extras)
        man = lambda spec: _manual_only(spec, self.manual)  # noqa: E731
        pin = self._map(man, self.pspec)
        gout = self._map(lambda g, p, mode: man(g if mode == "scatter" else p), self.gspec, self.gpspec, self.mode)

        def local(params, xs, extras):
            sums, grads = fn(vary(params), xs, extras)
            return self.psum(sums), self.reduce_end(grads)

        f = jax.shard_map(local, mesh=self.mesh, axis_names=set(self.manual),
                          in_specs=(pin, xs_specs(xs, self.mesh, self.per_row),
                                    jax.tree.map(lambda a: P(), extras)),
                          out_specs=(P(), gout))
        return f(params, xs, extras)
