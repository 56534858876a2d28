"""Logical axis rules -> `PartitionSpec`s / `NamedSharding`s for params, optimizer state, batch and train state.

A logical name maps to a mesh axis through `config.rules`; a dimension the mesh axis does not divide stays
replicated (e.g. 6 heads on tensor 4 would not be allowed by validation, but `seq` of odd length is fine).
ZeRO (Rajbhandari et al. 2020, sec. 5) adds `data` to the first dimension of a tensor that it divides and that is
not already sharded.
"""
from __future__ import annotations

import math

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.logical import mesh_axes, spec


def _fits(p: P, shape, mesh) -> P:
    """Drop mesh axes that do not divide their dimension."""
    out = []
    for dim, ax in zip(shape, tuple(p) + (None,) * (len(shape) - len(p))):
        size = math.prod(mesh.shape[a] for a in mesh_axes(ax))
        out.append(ax if dim % size == 0 else None)
    return P(*out)


def add_data_axis(p: P, shape, mesh, skip=()) -> P:
    """ZeRO: also shard over `data` along the first dimension divisible by it (replicated if none is), never along
    the dimensions in `skip` (the `layers` axis, so ZeRO-3 can gather one layer at a time)."""
    d = mesh.shape["data"]
    parts = list(tuple(p) + (None,) * (len(shape) - len(p)))
    if d == 1 or any("data" in mesh_axes(a) for a in parts):
        return P(*parts)
    for i, (dim, ax) in enumerate(zip(shape, parts)):
        if i in skip:
            continue
        axes = mesh_axes(ax)
        if dim % (d * math.prod(mesh.shape[a] for a in axes)) == 0:
            parts[i] = ("data",) + axes if axes else "data"
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
