"""Helpers for code inside `jax.shard_map` bodies (manual mesh axes), shared by the pipeline engines and ZeRO."""
from __future__ import annotations

import jax


def varying_axes(x) -> frozenset:
    """Manual mesh axes along which x differs per device (`.vma` in older JAX, `.manual_axis_type` in 0.10+)."""
    t = jax.typeof(x)
    if hasattr(t, "vma"):
        return t.vma
    mat = getattr(t, "manual_axis_type", None)
    return mat.varying if mat is not None else frozenset()


def vary(tree):
    """Mark every leaf as differing per device along every manual mesh axis (shard_map's varying-axes types).

    A differentiated value that is invariant along a manual axis gets a `psum` over that axis in its transpose; cast
    up front, the gradient stays per device, to be reduced once where the caller says. Outside a shard_map (no manual
    axes) this is the identity."""
    manual = tuple(jax.sharding.get_abstract_mesh().manual_axes)

    def cast(x):
        missing = tuple(a for a in manual if a not in varying_axes(x))
        return jax.lax.pcast(x, missing, to="varying") if missing else x
    return jax.tree.map(cast, tree)


def vary_like(x, like):
    """x typed as varying along every manual axis `like` varies along."""
    missing = tuple(a for a in varying_axes(like) if a not in varying_axes(x))
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def take(tree, i):
    """Entry i (int or traced int32) of every leaf's axis 0: `[n, ...]` -> `[...]`."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def put(buf, i, value):
    """`buf` `[n, ...]` with entry i replaced by `value` `[...]`."""
    return jax.lax.dynamic_update_index_in_dim(buf, value, i, 0)
