"""Logical activation constraints: the only sharding vocabulary the model sees.

The model calls `constrain(x, ("batch", "seq", "embed"))`. Outside `activation_rules(...)` that is the identity; inside,
the names are mapped through the rules table to a `PartitionSpec` over the ambient mesh (`jax.set_mesh`) and applied
with `jax.lax.with_sharding_constraint`. Mesh axes listed in `manual` (e.g. `stage` inside the pipeline's shard_map)
are dropped, since the compiler does not own them there.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

_RULES: contextvars.ContextVar = contextvars.ContextVar("jaxpar_rules", default=None)


def mesh_axes(entry) -> tuple:
    """One `PartitionSpec` entry (None, a mesh axis name, or a tuple of names) or rule target -> a tuple of names."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def spec(names, rules, skip=()) -> P:
    """Logical names -> `PartitionSpec`; each mesh axis is used at most once (first come), `skip` axes never.

    Raises:
      KeyError: a logical name missing from the rules table.
    """
    table = dict(rules)
    used, out = set(skip), []
    for n in names:
        if n is None:
            out.append(None)
            continue
        if n not in table:
            raise KeyError(f"logical axis {n!r} has no rule; add ({n!r}, mesh_axis_or_None) to config.rules")
        axes = tuple(a for a in mesh_axes(table[n]) if a not in used)
        used.update(axes)
        out.append(axes[0] if len(axes) == 1 else (axes or None))
    return P(*out)


@contextlib.contextmanager
def activation_rules(rules, mesh=None, manual=()):
    """Within this context `constrain` applies `rules` (pairs of logical name, mesh axis) on `mesh` (None: the
    ambient mesh of `jax.set_mesh` / a shard_map body); `manual` mesh axes are skipped."""
    token = _RULES.set((tuple(rules), mesh, tuple(manual)))
    try:
        yield
    finally:
        _RULES.reset(token)


def constrain(x: jax.Array, names) -> jax.Array:
    """Constrain activation `x` (one logical name per dimension) to its sharding; identity outside a rules context."""
    ctx = _RULES.get()
    if ctx is None:
        return x
    rules, mesh, manual = ctx
    p = spec(names, rules, skip=manual)
    return jax.lax.with_sharding_constraint(x, p if mesh is None else NamedSharding(mesh, p))


def per_shard(fn, in_names, out_names):
    """`fn` run on each device's shard (`jax.shard_map` over the mesh axes the compiler still owns) with its
    inputs and output laid out by the logical names `in_names` (one tuple per argument) and `out_names` (one tuple,
    or a tuple of them for several outputs): for kernels
    the SPMD partitioner cannot split (fused attention). Outside a rules context: `fn` itself."""
    ctx = _RULES.get()
    if ctx is None:
        return fn
    rules, mesh, manual = ctx
    current = jax.sharding.get_abstract_mesh()
    if current.manual_axes:  # inside a shard_map: also one traced after its rules context was left (a custom_vjp's
        # backward, transposed inside the pipeline's shard_map), so the mesh in force is the one to split over
        mesh, manual = None, tuple(dict.fromkeys((*manual, *current.manual_axes)))
    m = mesh if mesh is not None else current
    auto = frozenset(a for a in m.axis_names if a not in manual and a not in m.manual_axes)
    if not auto:
        return fn
    in_specs = tuple(spec(n, rules, skip=manual) for n in in_names)
    out_specs = (tuple(spec(n, rules, skip=manual) for n in out_names) if isinstance(out_names[0], tuple)
                 else spec(out_names, rules, skip=manual))
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         axis_names=auto, check_vma=False)


EXPERT = "expert"  # the mesh axis of expert parallelism


def exchange_experts(x: jax.Array, split_axis: int, concat_axis: int) -> jax.Array:
    """A MoE layer's all-to-all: inside a `shard_map` manual over the `expert` mesh axis (the step's data-parallel
    region), split `x` along `split_axis` into one piece per expert device, send piece i to device i, concatenate
    what arrives along `concat_axis`; anywhere else (one device, expert size 1, the compiler's own sharding) the
    identity."""
    mesh = jax.sharding.get_abstract_mesh()
    if EXPERT not in mesh.manual_axes or mesh.shape[EXPERT] == 1:
        return x
    return jax.lax.all_to_all(x, EXPERT, split_axis, concat_axis, tiled=True)


def exchange_ragged(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes) -> jax.Array:
    """`jax.lax.ragged_all_to_all` over the `expert` mesh axis (inside the step's `shard_map`, manual over it): rows
    `operand[input_offsets[j]:][:send_sizes[j]]` go to expert device j, where they land at `output_offsets[j]` of its
    `output`; `recv_sizes[j]` rows arrive from device j. Only XLA:GPU runs it (XLA:CPU has no ragged all-to-all)."""
    return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                     axis_name=EXPERT)


def expert_rank() -> jax.Array:
    """This device's index on the `expert` axis (inside the step's `shard_map`, manual over it)."""
    return jax.lax.axis_index(EXPERT)


def expert_split() -> int:
    """Devices the experts are split over here: the `expert` axis's size inside a `shard_map` manual over it (the
    step's data-parallel region), else 1."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.shape[EXPERT] if EXPERT in mesh.manual_axes else 1


CONTEXT = "context"  # the mesh axis of context parallelism


def context_split() -> int:
    """Devices this code's sequences are split over: the `context` axis's size inside a `shard_map` manual over it
    (the step's data-parallel region, the pipelines'), else 1."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.shape[CONTEXT] if CONTEXT in mesh.manual_axes else 1


def context_rank():
    """This device's index along `context` (inside a region manual over it)."""
    return jax.lax.axis_index(CONTEXT)


def sum_context(x: jax.Array) -> jax.Array:
    """`x` summed over the `context` devices (inside a region manual over it; else `x`): for integer counts."""
    return jax.lax.psum(x, CONTEXT) if context_split() > 1 else x


def gather_context(x: jax.Array, axis: int = 1) -> jax.Array:
    """The pieces of `x` along `axis` from every `context` device, concatenated in device order (all-gather); its
    gradient is the reduce-scatter back to each piece's device, summed in at least float32."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return jax.lax.all_gather(x, CONTEXT, axis=axis, tiled=True)
    return _gather_context(x, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather_context(x, axis):
    return jax.lax.all_gather(x, CONTEXT, axis=axis, tiled=True)


def _gather_context_bwd(axis, _, g):
    # the partial dK/dV of every device summed in float32 (XLA:CPU also aborts on a bfloat16 reduce-scatter)
    wide = g.astype(jnp.promote_types(g.dtype, jnp.float32))
    return (jax.lax.psum_scatter(wide, CONTEXT, scatter_dimension=axis, tiled=True).astype(g.dtype),)


_gather_context.defvjp(lambda x, axis: (_gather_context(x, axis), None), _gather_context_bwd)


def split_size(name: str) -> int:
    """Devices the logical axis `name` is split over in the rules context in force (its mesh axes the compiler
    still owns), 1 outside one."""
    ctx = _RULES.get()
    if ctx is None:
        return 1
    rules, mesh, manual = ctx
    sizes = dict((mesh if mesh is not None else jax.sharding.get_abstract_mesh()).shape)
    return math.prod(sizes.get(a, 1) for a in mesh_axes(spec((name,), rules, skip=manual)[0]))
