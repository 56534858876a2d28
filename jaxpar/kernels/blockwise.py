"""Blockwise causal attention with an online softmax (Milakov & Gimelshein 2018; FlashAttention's forward and
backward, Dao 2023) in plain JAX: no `[queries, keys]` score matrix is ever whole, only one `[block_q, block_k]` tile
per head at a time. Knows no model and no mesh.

Causality is by each token's index in its original sequence (`q_idx`, `k_idx`), not by where it sits in the arrays:
context parallelism hands each device a load-balanced permutation of the sequence (`jaxpar/parallel/context.py`), whose
queries attend to the keys gathered from every device. A tile whose keys all come after its queries is skipped
(`lax.cond`): the causal half of the work is never done. With segment ids (packed documents) a query attends only
to keys of its own segment, or of its shared prefix (`jaxpar/kernels/segments.py`).

Shapes: q `[batch, tq, heads, head_dim]`; k, v `[batch, tk, kv_heads, head_dim]` with heads a multiple of kv_heads
(grouped-query attention: query head j reads KV head j // (heads / kv_heads), as Hugging Face's `repeat_kv`; the
K/V heads are never repeated); q_idx `[tq]`, k_idx `[tk]` int32; q_seg `[batch, tq]`, k_seg `[batch, tk]` int32 or
None. The softmax runs in float32 (float64 in float64 reference runs); the output has q's dtype.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxpar.dtypes import at_least_f32
from jaxpar.kernels import segments
from jaxpar.parallel.shard_map_body import vary, vary_like


def block_size(n: int, most: int = 512) -> int:
    """The largest divisor of `n` that is at most `most`."""
    return max(d for d in range(1, min(n, most) + 1) if n % d == 0)


def _tiles(q, k, v, q_idx, k_idx, q_seg, k_seg, bq, bk):
    """Blocked views: q `[nq, b, bq, g, r, d]`, k, v `[nk, b, bk, g, d]`, idx `[n, bx]`, seg `[n, b, bx]`."""
    b, tq, h, d = q.shape
    g = k.shape[2]
    qb = q.reshape(b, tq // bq, bq, g, h // g, d).swapaxes(0, 1)
    kb, vb = (a.reshape(b, a.shape[1] // bk, bk, g, d).swapaxes(0, 1) for a in (k, v))
    seg = lambda s, n: None if s is None else s.reshape(b, -1, n).swapaxes(0, 1)  # noqa: E731
    return qb, kb, vb, q_idx.reshape(-1, bq), k_idx.reshape(-1, bk), seg(q_seg, bq), seg(k_seg, bk)


def _scores(q, k, qi, ki, qs, ks, scale, f):
    """One tile's masked scores `[b, g, r, bq, bk]` (-inf where a query may not see a key)."""
    s = jnp.einsum("bqgrd,bkgd->bgrqk", q.astype(f), k.astype(f)) * scale
    ok = (qi[:, None] >= ki[None, :])[None]
    if qs is not None:
        ok = ok & segments.visible(qs[:, :, None], ks[:, None, :])
    return jnp.where(ok[:, None, None], s, -jnp.inf)


def _needed(qi, ki):
    """Whether any query of the tile may see any of its keys (causally)."""
    return qi.max() >= ki.min()


def _loop(body, carry, xs):
    """`body(carry, x)` over the leading axis of `xs` in a `lax.while_loop` -> the final carry."""
    n = jax.tree.leaves(xs)[0].shape[0]

    def step(state):
        i, c = state
        return i + 1, body(c, jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), xs))

    return jax.lax.while_loop(lambda state: state[0] < n, step, (vary(jnp.zeros((), jnp.int32)), carry))[1]


def _forward(q, k, v, q_idx, k_idx, q_seg, k_seg, bq, bk):
    """-> (out `[b, tq, h, d]` in q's dtype, lse `[nq, b, g, r, bq]`, tiles computed (int32))."""
    f = at_least_f32(q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1])
    qb, kb, vb, qi, ki, qs, ks = _tiles(q, k, v, q_idx, k_idx, q_seg, k_seg, bq, bk)

    def q_block(n, x):
        qt, qit, qst = x
        b, bq_, g, r, _ = qt.shape
        acc, stat = vary(jnp.zeros(qt.shape, f)), vary(jnp.full((b, g, r, bq_), -jnp.inf, f))

        def k_block(carry, y):
            kt, vt, kit, kst = y

            def tile(carry):
                o, m, l, n = carry
                s = _scores(qt, kt, qit, kit, qst, kst, scale, f)
                m_new = jnp.maximum(m, s.max(-1))
                safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.exp(s - safe[..., None])
                corr = jnp.exp(m - safe)
                o = o * jnp.moveaxis(corr, -1, 1)[..., None] + jnp.einsum("bgrqk,bkgd->bqgrd", p, vt.astype(f))
                return o, m_new, l * corr + p.sum(-1), n + 1

            return jax.lax.cond(_needed(qit, kit), tile, lambda c: c, carry)

        # a while loop, not a scan: the forward is never differentiated (the custom VJP below is its derivative),
        # and JAX's partial evaluation of a scan inside a scanned, differentiated layer would stack every tile's
        # intermediates as if it were
        (o, m, l, n) = _loop(k_block, (acc, stat, jnp.zeros_like(stat), n), (kb, vb, ki, ks))
        return n, (o / jnp.moveaxis(l, -1, 1)[..., None], m + jnp.log(l))

    n, (o, lse) = jax.lax.scan(q_block, vary(jnp.zeros((), jnp.int32)), (qb, qi, qs))
    return o.swapaxes(0, 1).reshape(q.shape).astype(q.dtype), lse, n


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _attention(q, k, v, q_idx, k_idx, q_seg, k_seg, bq, bk):
    return _forward(q, k, v, q_idx, k_idx, q_seg, k_seg, bq, bk)[0]


def _attention_fwd(q, k, v, q_idx, k_idx, q_seg, k_seg, bq, bk):
    o, lse, _ = _forward(q, k, v, q_idx, k_idx, q_seg, k_seg, bq, bk)
    return o, (q, k, v, q_idx, k_idx, q_seg, k_seg, o, lse)


def _attention_bwd(bq, bk, res, do):
    """FlashAttention's backward: each tile's probabilities recomputed from the saved log-sum-exp."""
    q, k, v, q_idx, k_idx, q_seg, k_seg, o, lse = res
    f = at_least_f32(q.dtype)
    scale = 1.0 / math.sqrt(q.shape[-1])
    qb, kb, vb, qi, ki, qs, ks = _tiles(q, k, v, q_idx, k_idx, q_seg, k_seg, bq, bk)
    ob, dob = (_tiles(a, k, v, q_idx, k_idx, None, None, bq, bk)[0] for a in (o, do))
    delta = jnp.einsum("nbqgrd,nbqgrd->nbgrq", ob.astype(f), dob.astype(f))  # rowsum(dO * O)

    def q_block(carry, x):
        qt, dot, lt, dt, qit, qst = x

        def k_block(inner, y):
            kt, vt, kit, kst, j = y

            def tile(inner):
                dq, dk, dv = inner
                p = jnp.exp(_scores(qt, kt, qit, kit, qst, kst, scale, f) - lt[..., None])
                dv = dv.at[j].add(jnp.einsum("bgrqk,bqgrd->bkgd", p, dot.astype(f)))
                dp = jnp.einsum("bqgrd,bkgd->bgrqk", dot.astype(f), vt.astype(f))
                ds = p * (dp - dt[..., None]) * scale
                dq = dq + jnp.einsum("bgrqk,bkgd->bqgrd", ds, kt.astype(f))
                dk = dk.at[j].add(jnp.einsum("bgrqk,bqgrd->bkgd", ds, qt.astype(f)))
                return dq, dk, dv

            return jax.lax.cond(_needed(qit, kit), tile, lambda c: c, inner), None

        dk, dv = carry
        (dq, dk, dv), _ = jax.lax.scan(k_block, (vary(jnp.zeros(qt.shape, f)), dk, dv),
                                       (kb, vb, ki, ks, jnp.arange(kb.shape[0])))
        return (dk, dv), dq

    zeros = vary(jnp.zeros(kb.shape, f))
    (dk, dv), dq = jax.lax.scan(q_block, (zeros, zeros), (qb, dob, lse, delta, qi, qs))
    unblock = lambda a, like: vary_like(a.swapaxes(0, 1).reshape(like.shape).astype(like.dtype), like)  # noqa
    return unblock(dq, q), unblock(dk, k), unblock(dv, v), None, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def attention(q, k, v, q_idx, k_idx, q_seg=None, k_seg=None, block_q: int = 0, block_k: int = 0):
    """Causal (by `q_idx >= k_idx`, within segments when given) blockwise attention; see the module docstring.
    `block_q`, `block_k`: tile sizes dividing tq and tk (0: `block_size`)."""
    bq, bk = block_q or block_size(q.shape[1]), block_k or block_size(k.shape[1])
    return _attention(q, k, v, q_idx, k_idx, q_seg, k_seg, bq, bk)


def tiles_computed(q, k, v, q_idx, k_idx, q_seg=None, k_seg=None, block_q: int = 0, block_k: int = 0):
    """How many `[block_q, block_k]` tiles the forward pass computes (the rest are causally empty): the work
    counted where it runs (`tests/test_context.py` checks the load balance with it)."""
    bq, bk = block_q or block_size(q.shape[1]), block_k or block_size(k.shape[1])
    return _forward(q, k, v, q_idx, k_idx, q_seg, k_seg, bq, bk)[2]
