"""Data parallelism with ZeRO's gradient reduction, written by hand over the mesh axis `data`.

Left to the compiler, the gradient of a replicated parameter inside a microbatch loop (or the pipeline's tick loop)
is all-reduced at every iteration, and XLA:CPU turns a reduce-scatter into an all-reduce plus a slice. So the
loss-and-grads function runs under `shard_map`, manual over `data` only (tensor and stage stay with the compiler and
the pipeline), on this shard's rows, and the reduction is explicit, as in ZeRO (Rajbhandari et al. 2020, sec. 5):

| ZeRO stage | params inside            | per microbatch                 | at the end of the step |
|------------|--------------------------|--------------------------------|------------------------|
| 0, 1       | replicated               | accumulate locally (full size) | one all-reduce (psum)  |
| 2          | replicated               | reduce-scatter into a 1/N buffer | —                    |
| 3          | sharded; gathered layer by layer where used (the gather's transpose is the reduce-scatter) | — | — |

A parameter too small to split over `data` stays replicated and is all-reduced once at the end, whatever the stage.
ZeRO-3's gathers are keyed by logical axis names: a leaf with a `layers` axis is gathered one layer at a time inside
the layer scan (`layer_gather`), the others (embeddings, final norm) once per microbatch (`gather_shared`).
"""
from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from jaxpar.logical import mesh_axes
from jaxpar.shard_map_body import vary

AXIS = "data"
LAYERS = "layers"  # the logical axis of stacked per-layer params (scanned over, so absent inside a layer)


def data_dim(spec: P):
    """Index of the dimension a `PartitionSpec` shards over `data`, or None."""
    for i, ax in enumerate(spec):
        if AXIS in mesh_axes(ax):
            return i
    return None


def _only_data(dim, ndim) -> P:
    return P(*[AXIS if i == dim else None for i in range(ndim)])


class DataParallel:
    """Per-leaf plan for the params/grads trees: where `data` splits each, and how its gradient is reduced.

    Args:
      param_specs, grad_specs: `PartitionSpec` trees of the params and of the float32 gradient buffer.
      zero_stage: 0-3 (`optim.zero_stage`).
      names: the params tree of logical axis names (tuples), for the ZeRO-3 gathers.
    """

    def __init__(self, mesh, param_specs, grad_specs, zero_stage: int, names):
        self.mesh, self.names = mesh, names
        self.size = mesh.shape[AXIS]  # with a 1-device axis there is nothing to reduce: no shard_map at all
        self.manual = (AXIS,) if self.size > 1 else ()  # mesh axes that are manual inside `run`
        is_p = lambda x: isinstance(x, P)
        self.pdim = jax.tree.map(data_dim, param_specs, is_leaf=is_p)
        self.gdim = jax.tree.map(lambda g: data_dim(g) if zero_stage >= 2 else None, grad_specs, is_leaf=is_p)
        # 'ad': gathered param, AD already reduce-scatters; 'scatter': reduce-scatter per microbatch; 'sum': psum
        self.mode = jax.tree.map(lambda p, g: "ad" if p is not None else ("scatter" if g is not None else "sum"),
                                 self.pdim, self.gdim, is_leaf=lambda x: x is None or isinstance(x, int))

    def _leaves(self, tree, *plans):
        return jax.tree.map(lambda *a: a, tree, *plans, is_leaf=lambda x: x is None)

    def gather(self, params, pdim):
        """All-gather the `data`-sharded leaves of `params` (ZeRO-3) along their split dims; others unchanged."""
        def g(a, d):
            return a if d is None or self.size == 1 else jax.lax.all_gather(a, AXIS, axis=d, tiled=True)
        return jax.tree.map(g, params, pdim, is_leaf=lambda x: x is None)

    def gather_shared(self, params):
        """ZeRO-3: all-gather the `data`-sharded leaves without a `layers` axis; the per-layer leaves unchanged."""
        return jax.tree.map(lambda a, d, n: a if LAYERS in n else self.gather(a, d), params, self.pdim, self.names,
                            is_leaf=lambda x: x is None)

    def layer_gather(self, select):
        """ZeRO-3: a function that all-gathers one layer's params (the leaves of `select(params)` without their
        `layers` axis, as inside the layer scan). `select` picks the per-layer subtree from a params-shaped tree."""
        def within_layer(d, n):
            return None if d is None or LAYERS not in n else d - (n.index(LAYERS) < d)
        dims = select(jax.tree.map(within_layer, self.pdim, self.names, is_leaf=lambda x: x is None))
        return lambda layer_params: self.gather(layer_params, dims)

    def reduce_microbatch(self, grads):
        """Inside the shard_map: reduce-scatter the 'scatter' leaves (ZeRO-2), leave the rest local."""
        def r(g, mode, d):
            if mode != "scatter" or self.size == 1:
                return g
            return jax.lax.psum_scatter(g, AXIS, scatter_dimension=d, tiled=True)
        return jax.tree.map(r, grads, self.mode, self.gdim, is_leaf=lambda x: x is None)

    def reduce_end(self, grads):
        """Inside the shard_map: all-reduce the 'sum' leaves (accumulated locally over the microbatches)."""
        return jax.tree.map(lambda g, mode: self.psum(g) if mode == "sum" else g, grads, self.mode)

    def psum(self, x):
        return x if self.size == 1 else jax.lax.psum(x, AXIS)

    def run(self, fn, params, xs, extras):
        """Call `fn(params, xs, extras) -> (loss_sum, grads)` on each data shard; returns the global loss sum and the
        reduced grads (sharded over `data` where ZeRO >= 2 says so).

        Inside `fn`, `params` are per-shard values: replicated leaves are marked varying (so their gradients stay
        local until `reduce_*`), ZeRO-3 leaves are this shard's slice (gather them with `gather` where used).
        xs leaves are `[M, micro_batch, ...]` split over `data` on axis 1; `extras` are replicated.
        """
        if self.size == 1:
            return fn(params, xs, extras)
        pin = jax.tree.map(lambda a, d: P() if d is None else _only_data(d, a.ndim), params, self.pdim,
                           is_leaf=lambda x: x is None)
        gout = jax.tree.map(lambda a, mode, gd, pd: P() if mode == "sum" else _only_data(gd if mode == "scatter"
                            else pd, a.ndim), params, self.mode, self.gdim, self.pdim,
                            is_leaf=lambda x: x is None)

        def local(params, xs, extras):
            params = jax.tree.map(lambda a, d: vary(a) if d is None else a, params, self.pdim,
                                  is_leaf=lambda x: x is None)
            lsum, grads = fn(params, xs, extras)
            return self.psum(lsum), self.reduce_end(grads)

        f = jax.shard_map(local, mesh=self.mesh, axis_names={AXIS},
                          in_specs=(pin, jax.tree.map(lambda a: P(None, AXIS), xs), jax.tree.map(lambda a: P(), extras)),
                          out_specs=(P(), gout))
        return f(params, xs, extras)
