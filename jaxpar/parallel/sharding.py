"""Logical axis rules -> `PartitionSpec`s / `NamedSharding`s for params, optimizer state, batch and train state.

A logical name maps to a mesh axis through `config.rules`; a dimension the mesh axis does not divide stays
replicated (e.g. 6 heads on tensor 4 would not be allowed by validation, but `seq` of odd length is fine).
ZeRO (Rajbhandari et al. 2020, sec. 5) adds the replica axes (`data`, `expert`, `context`: those the parameter is
replicated over) to the first dimension of a tensor that they divide and that is not already sharded.
"""
from __future__ import annotations

import math

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.parallel.logical import mesh_axes, spec


def _fits(p: P, shape, mesh) -> P:
    """Drop mesh axes that do not divide their dimension."""
    out = []
    for dim, ax in zip(shape, tuple(p) + (None,) * (len(shape) - len(p))):
        size = math.prod(mesh.shape[a] for a in mesh_axes(ax))
        out.append(ax if dim % size == 0 else None)
    return P(*out)


BATCH_AXES = ("data", "expert")  # the batch's rows split: every parameter but the routed experts is replicated over both
CONTEXT = "context"  # the sequence's split (context parallelism)
# the axes every parameter (but a routed expert's, split over `expert`) is replicated over: its gradient is reduced
# over them and ZeRO shards over them
REPLICA_AXES = BATCH_AXES + (CONTEXT,)


def batch_axes(mesh) -> tuple:
    """The mesh axes of `BATCH_AXES` with more than one device (the rows' split)."""
    return tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1)


def replica_axes(mesh) -> tuple:
    """The mesh axes of `REPLICA_AXES` with more than one device."""
    return tuple(a for a in REPLICA_AXES if mesh.shape.get(a, 1) > 1)


def xs_spec(ndim: int, mesh, along: bool = True) -> P:
    """The spec of a microbatched input `[M, rows, seq, ...]` (ndim >= 3, `along` the sequence) or `[M, rows, ...]`
    inside a region manual over the replica axes: rows over the batch axes, the sequence over `context`."""
    seq = CONTEXT if along and ndim >= 3 and mesh.shape.get(CONTEXT, 1) > 1 else None
    return P(None, entry(batch_axes(mesh)), seq) if seq else P(None, entry(batch_axes(mesh)))


def xs_specs(xs, mesh, per_row=()):
    """`xs_spec` of every leaf of a dict of microbatched inputs; those under the keys `per_row` hold values per row
    (their axis 2 is not the sequence)."""
    return {k: jax.tree.map(lambda a, k=k: xs_spec(a.ndim, mesh, k not in per_row), v) for k, v in xs.items()}


def entry(axes: tuple):
    """A `PartitionSpec` entry for mesh axes `axes`: None, one name, or a tuple of names."""
    return None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))


def batch_spec(mesh) -> P:
    """`[global_batch, ...]` split over the batch axes (`data` when none has more than one device)."""
    return P(entry(batch_axes(mesh)) or "data")


def zero_axes(p: P, mesh) -> tuple:
    """The replica axes a parameter with spec `p` is replicated over: what ZeRO shards it over and what its gradient
    is reduced over (a routed expert's weight is split over `expert` already: `data` and `context` only)."""
    used = {a for ax in p for a in mesh_axes(ax)}
    return tuple(a for a in replica_axes(mesh) if a not in used)


def zero_dim(p: P, axes: tuple):
    """Index of the dimension of spec `p` that holds the ZeRO axes `axes`, or None."""
    for i, ax in enumerate(p):
        if axes and axes[0] in mesh_axes(ax):
            return i
    return None


def add_data_axis(p: P, shape, mesh, skip=()) -> P:
    """ZeRO: also shard over the replica axes it is replicated over (`zero_axes`: `data` and `context`, and `expert`
    for all but the experts) along the first dimension they divide (replicated if none is), never along the dimensions in `skip`
    (the `layers` axis, so ZeRO-3 can gather one layer at a time)."""
    parts = list(tuple(p) + (None,) * (len(shape) - len(p)))
    axes = zero_axes(P(*parts), mesh)
    if not axes:
        return P(*parts)
    n = math.prod(mesh.shape[a] for a in axes)
    for i, (dim, ax) in enumerate(zip(shape, parts)):
        if i in skip:
            continue
        have = mesh_axes(ax)
        if dim % (n * math.prod(mesh.shape[a] for a in have)) == 0:
            # a batch axis already here (`expert`) stays major: ZeRO splits each device's own piece further; the
            # compiler's axes (`tensor`) minor, as the data-parallel region sees them whole
            parts[i] = entry(tuple(a for a in have if a in REPLICA_AXES) + axes
                             + tuple(a for a in have if a not in REPLICA_AXES))
            return P(*parts)
    return P(*parts)


def param_specs(names_tree, shapes_tree, rules, mesh, zero: bool = False):
    """Per-parameter `PartitionSpec` from logical names; `zero=True` adds the `data` axis (ZeRO sharding)."""
    def one(names, shape):
        p = _fits(spec(names, rules), shape.shape, mesh)
        skip = tuple(i for i, n in enumerate(names) if n == "layers")
        return add_data_axis(p, shape.shape, mesh, skip) if zero else p

    return jax.tree.map(one, names_tree, shapes_tree, is_leaf=lambda t: isinstance(t, tuple))


def named(mesh, specs):
    return jax.tree.map(lambda p: NamedSharding(mesh, p), specs, is_leaf=lambda p: isinstance(p, P))


def opt_state_specs(optimizer, opt_shapes, param_specs_tree):
    """Optimizer-state specs: leaves that mirror a parameter take its spec; the rest (counts, scales) replicate."""
    return optax.tree_map_params(optimizer, lambda _, s: s, opt_shapes, param_specs_tree,
                                 transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P))
