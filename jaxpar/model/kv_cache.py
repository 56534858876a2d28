"""The KV cache of generation: each row's keys and values of its positions so far, dense (a row of the whole
context per slot) or paged (a pool of blocks and a block table, `jaxpar/generate/paged.py`'s host side), and the
attention of new queries over it (`KVCache.attend`: XLA in float32, or a decode step's paged kernel,
`jaxpar/kernels/paged.py`). Knows no mesh."""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxpar.dtypes import at_least_f32
from jaxpar.kernels import paged


class KVCache(NamedTuple):
    """Keys and values of one layer, each row for its own positions [0, pos[row]) (post-RoPE for llama), `kv_heads`
    of them: rows of different lengths share one cache (ragged prompts, rows refilled one at a time). Stacked over
    layers (a leading `[layers]` axis on every field) between decode steps. Inside a decode step's layer loop the
    stack itself may go through (`layer` set: k, v `[layers, batch, max_len, ...]`, pos `[batch]`), so that a step
    writes only its new positions into it, in place, and no layer's cache is copied out and back. Paged (`table`
    set, always stacked): k, v are a pool `[kv_heads, layers, blocks, block, head_dim]` (`kernels/paged.py`'s page
    layout) in equal parts, and position p of row r of part q lives in block `table[q, r, p // block]` of part q at
    `p % block`; an entry past the part (unreserved) drops writes and reads zeros."""
    k: jax.Array  # [batch, max_len, kv_heads, head_dim], compute dtype
    v: jax.Array
    pos: jax.Array  # [batch] int32: positions filled in each row
    layer: jax.Array | None = None  # the layer whose part of the stacked k, v this is
    table: jax.Array | None = None  # [parts, batch / parts, blocks per row] int32: a paged cache's block tables

    def append(self, k, v):
        """k, v `[batch, t, kv_heads, head_dim]` for each row's positions pos..pos+t -> (all keys, all values, the
        causal mask `[batch, 1, t, max_len]` over each row's filled positions, updated cache: pos + t; a stacked
        one keeps its pos, which its layer loop advances once). A row's positions past its pos + t are stale (a
        shorter row of a padded prefill) and masked until overwritten."""
        t = k.shape[1]
        at = self.pos[:, None] + jnp.arange(t)[None, :]
        where = None  # the position each key holds (None: its index)
        if self.table is not None:
            cache = self.write_blocks(k, v)
            keys, values, where = cache.read_blocks()
        elif self.layer is None:
            put = jax.vmap(lambda c, new, p: jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), p, 0))
            ck, cv = put(self.k, k, self.pos), put(self.v, v, self.pos)
            keys, values, cache = ck, cv, KVCache(ck, cv, self.pos + t)
        else:  # only the new positions written, into the stack
            rows = jnp.arange(k.shape[0])[:, None]
            ck = self.k.at[self.layer, rows, at].set(k.astype(self.k.dtype), mode="drop")
            cv = self.v.at[self.layer, rows, at].set(v.astype(self.v.dtype), mode="drop")
            keys, values, cache = ck[self.layer], cv[self.layer], self._replace(k=ck, v=cv)
        where = jnp.arange(keys.shape[1]) if where is None else where
        mask = where[None, None, :] <= at[:, :, None]
        return keys, values, mask[:, None], cache

    def _parts(self, pool):
        """A pool in its `parts = table.shape[0]` parts: `[kv_heads, layers, parts, blocks a part, block, hd]` (row
        part p reads and writes only part p, by local block numbers: a split of both over the same devices keeps
        every write and read on its device)."""
        parts = self.table.shape[0]
        return pool.reshape(*pool.shape[:2], parts, pool.shape[2] // parts, *pool.shape[3:])

    def write_blocks(self, k, v) -> KVCache:
        """A paged pool with k, v `[batch, t, kv_heads, hd]` written at each row's positions pos..pos+t of this
        layer, in their rows' blocks."""
        parts, block = self.table.shape[0], self.k.shape[3]
        split = lambda a: a.reshape(parts, a.shape[0] // parts, *a.shape[1:])  # noqa: E731  rows -> parts x rows
        at = split(self.pos[:, None] + jnp.arange(k.shape[1])[None, :])
        where = jnp.take_along_axis(self.table, at // block, axis=2, mode="fill", fill_value=self.k.shape[2] // parts)

        def one(pool, where, at, new):  # one part's pool [kv_heads, layers, blocks, block, hd], new [rows, t, ...]
            new = jnp.moveaxis(new, 2, 0).astype(pool.dtype)
            return pool.at[:, self.layer, where, at % block].set(new, mode="drop")

        put = lambda c, new: jax.vmap(one, in_axes=(2, 0, 0, 0), out_axes=2)(  # noqa: E731
            self._parts(c), where, at, split(new)).reshape(c.shape)
        return self._replace(k=put(self.k, k), v=put(self.v, v))

    def read_blocks(self, step: bool = False):
        """This layer's keys and values of every row's blocks, `[batch, block x blocks per row, kv_heads, hd]` each
        (transient), in block-major order: key j = o x width + w holds position w x block + o (`[block x width]`
        int32, the third result), so that a split of each block's positions (over context) stays the split of the
        keys and the attention reduces across it in place. `step` (a decode step's layout, `step_attention`): keys
        `[batch, kv_heads, hd, keys]`, values `[batch, kv_heads, keys, hd]`, the same order of keys."""
        def read(c, order):  # gathered [parts, kv_heads, rows, width, block, hd] -> [rows of parts, `order`]
            r = jax.vmap(lambda pool, table: pool.at[:, self.layer, table].get(mode="fill", fill_value=0),
                         in_axes=(2, 0))(self._parts(c), self.table)
            r = jnp.transpose(r, (0, 2) + tuple(order))
            keys = order.index(4)  # where the block's offsets go, then the blocks: the keys, block-major
            return r.reshape(-1, *r.shape[2:2 + keys], block * width, *r.shape[4 + keys:])

        width, block = self.table.shape[2], self.k.shape[3]
        where = (jnp.arange(width)[None, :] * block + jnp.arange(block)[:, None]).reshape(-1)
        if step:
            return read(self.k, (1, 5, 4, 3)), read(self.v, (1, 4, 3, 5)), where
        return read(self.k, (4, 3, 1, 5)), read(self.v, (4, 3, 1, 5)), where

    def attend(self, q, k, v, implementation: str = "xla"):
        """Queries q `[b, t, heads, hd]` with their new keys and values k, v `[b, t, kv_heads, hd]` at each row's
        next positions -> (attention over each row's filled positions `[b, t, heads, hd]`, the cache with them
        written). A paged decode step (t = 1) goes through the paged kernel where `paged.choose` takes it."""
        if self.table is not None and q.shape[1] == 1 and paged.choose(
                implementation, dtype=q.dtype, head_dim=q.shape[3], block=self.k.shape[3], heads=q.shape[2],
                kv_heads=k.shape[2], parts=self.table.shape[0]) == "pallas":
            cache = self.write_blocks(k, v)
            return paged.attention(q, cache.k, cache.v, cache.table, cache.layer, cache.pos + 1), cache
        if self.table is not None and q.shape[1] == 1:
            cache = self.write_blocks(k, v)
            keys, values, where = cache.read_blocks(step=True)
            return step_attention(q, keys, values, where[None, :] <= self.pos[:, None]), cache
        keys, values, mask, cache = self.append(k, v)
        return cached_attention(q, keys, values, mask), cache


def step_attention(q, k, v, mask):
    """A decode step's attention (one query a row) over a paged cache's keys k `[b, kv_heads, hd, S]` and values v
    `[b, kv_heads, S, hd]` (`KVCache.read_blocks(step=True)`) under `mask` `[b, S]`, in float32 (float64 in float64
    runs): products and sums over hd and S that are not the minor axis, so a CPU vectorises them along the keys and
    hd (1.7x faster than the `[b, S, kv_heads, hd]` order's reduction over its minor hd on 64 rows x 192 keys)."""
    b, _, h, d = q.shape
    g, f = k.shape[1], at_least_f32(q.dtype)
    qg = q.reshape(b, g, h // g, d).astype(f)
    s = (qg[..., None] * k.astype(f)[:, :, None]).sum(3) / math.sqrt(d)  # [b, g, r, S]
    p = jax.nn.softmax(jnp.where(mask[:, None, None], s, -jnp.inf), axis=-1)
    o = (p[..., None] * v.astype(f)[:, :, None]).sum(3)  # [b, g, r, hd]
    return o.reshape(b, 1, h, d).astype(q.dtype)


def cached_attention(q, k, v, mask):
    """Attention of q `[b, t, heads, hd]` over a cache's k, v `[b, S, kv_heads, hd]` under `mask` `[b, 1, t, S]`, in
    float32 (float64 in float64 runs), each query head reading its KV head in place (no repeated copy of the
    cache): the decode step's, where the cache is the traffic."""
    b, t, h, d = q.shape
    g, f = k.shape[2], at_least_f32(q.dtype)
    qg = q.reshape(b, t, g, h // g, d).astype(f)
    if t == 1:  # a decode step: products and sums XLA fuses (as a batched dot, b x g tiny matmuls run one by one on
        # a CPU: 2.2x slower decode of 64 rows in `bench/decode_peer.py`'s model)
        s = (qg[:, 0, None] * k.astype(f)[:, :, :, None]).sum(-1) / math.sqrt(d)  # [b, S, g, r]
        s = jnp.moveaxis(s, 1, -1)[:, :, :, None]  # [b, g, r, 1, S]
        p = jax.nn.softmax(jnp.where(mask[:, :, None], s, -jnp.inf), axis=-1)
        o = (jnp.moveaxis(p[:, :, :, 0], -1, 1)[..., None] * v.astype(f)[:, :, :, None]).sum(1)  # [b, g, r, d]
        return o.reshape(b, 1, h, d).astype(q.dtype)
    s = jnp.einsum("btgrd,bsgd->bgrts", qg, k.astype(f)) / math.sqrt(d)
    p = jax.nn.softmax(jnp.where(mask[:, :, None], s, -jnp.inf), axis=-1)
    return jnp.einsum("bgrts,bsgd->btgrd", p, v.astype(f)).reshape(b, t, h, d).astype(q.dtype)
