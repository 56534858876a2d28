"""Decode attention over a paged KV pool with JAX's Pallas paged-attention kernel
(`jax.experimental.pallas.ops.gpu.paged_attention`: Triton on GPU, Pallas' interpret mode elsewhere). Knows no model.

The pool `[kv_heads, layers, blocks, block, head_dim]` (`POOL_NAMES`: KV heads over tensor, blocks split as the rows,
over data x expert, in `parts` equal parts numbered locally by the block table `[parts, rows / parts, width]`; each
block's positions split over `context` under context parallelism, where the kernel does not apply) is
the kernel's own page layout with the layers folded into its pages: layer l's block j of part p is page
`(l x parts + p) x blocks a part + j` of a `[kv_heads, layers x blocks, block, head_dim]` view, a reshape, no copy.
One query per row (a decode step) reads its row's pages up to its length; the softmax is float32 inside the kernel.
The kernel runs per shard (`per_shard`): each device its rows, its part of the pool, its KV heads and their queries.

`choose(implementation, ...)` resolves `model.attention` for a paged decode step: "auto" (and "cudnn", whose fused
kernel has no paged form) take the kernel on a GPU where it applies, XLA elsewhere; "pallas" takes it wherever it
applies (interpret mode off GPU: slow, for tests) and raises where it cannot; "xla" never.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxpar.kernels.attention import on_gpu
from jaxpar.parallel.logical import per_shard, split_size

POOL_NAMES = ("kv_heads", None, "batch", "kv_block", "kv")  # the pool's logical axes: blocks split as the rows are
_Q, _TABLE = ("batch", None, "heads", None), ("batch", None, None)


def _divisor(n: int, most: int) -> int:
    return max(d for d in range(1, min(n, most) + 1) if n % d == 0)


def reason(dtype, head_dim: int, block: int, heads: int, kv_heads: int, parts: int) -> str | None:
    """Why the kernel cannot run this decode step here (the layout from the rules context in force), or None."""
    if jnp.dtype(dtype) == jnp.float64:
        return "the paged kernel computes in float32 at most, not float64"
    if head_dim < 16 or head_dim & (head_dim - 1):
        return f"the paged kernel needs head_dim a power of two >= 16, not {head_dim}"
    if block < 16 or block & (block - 1):
        return f"the paged kernel needs kv_block a power of two >= 16, not {block}"
    split = split_size("kv_heads")
    if kv_heads % split or split_size("heads") != split:
        return f"the paged kernel needs the KV heads ({kv_heads}) split as the query heads ({heads}) are"
    if split_size("kv_block") > 1:
        return "the paged kernel reads a row's blocks whole on one device, not split over context"
    if parts != split_size("batch"):
        return f"the paged kernel needs the pool in one part per shard of the rows, not {parts}"
    return None


def choose(implementation: str, backend: str | None = None, **shape) -> str:
    """`model.attention` -> the kernel a paged decode step runs: pallas | xla (`reason`'s keyword arguments)."""
    why = reason(**shape)
    if implementation == "pallas":
        if why is not None:
            raise ValueError(f"model.attention='pallas' cannot decode here: {why}; use 'auto' or 'xla'")
        return "pallas"
    gpu = (backend or jax.default_backend()) == "gpu"
    return "pallas" if implementation in ("auto", "cudnn") and gpu and why is None else "xla"


def attention(q, pool_k, pool_v, table, layer, lengths):
    """One query per row, q `[b, 1, heads, head_dim]`, over its first `lengths[b]` positions in layer `layer` of the
    pool (`table`'s blocks) -> `[b, 1, heads, head_dim]` in q's dtype."""
    names = (_Q, POOL_NAMES, POOL_NAMES, _TABLE, (), ("batch",))
    return per_shard(on_gpu(_local), names, _Q)(q, pool_k, pool_v, table, layer, lengths)


def _local(interpret: bool, q, pool_k, pool_v, table, layer, lengths):
    from jax.experimental.pallas.ops.gpu import paged_attention as pa

    g, layers, blocks, block, d = pool_k.shape
    parts, rows, width = table.shape
    per = blocks // parts
    first = layer * blocks + jnp.arange(parts)[:, None, None] * per  # each part's first page in layer `layer`
    pages = (jnp.minimum(table, per - 1) + first).reshape(parts * rows, width)  # (unreserved: masked by the length)
    fold = lambda p: p.reshape(g, layers * blocks, block, d)  # noqa: E731
    splits = _divisor(width, 16)
    out = pa.paged_attention((q[:, 0] / math.sqrt(d)).astype(q.dtype), fold(pool_k), fold(pool_v), pages,
                             lengths.astype(jnp.int32), k_splits=splits,
                             pages_per_compute_block=_divisor(width // splits, 8), interpret=interpret)
    return out[:, None]
