"""Autoregressive sampling with a KV cache (temperature, top-k), on the params dict of `jaxpar.model`.

Shapes: prompt `[batch, prompt_len]` int32; cache per layer `[batch, seq_len, heads, head_dim]` (compute dtype);
output `[batch, prompt_len + new_tokens]` int32. The total length is bounded by the model's `seq_len` (learned
position embeddings).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.model import Forward


class KVCache(NamedTuple):
    """Keys and values of one layer for positions [0, pos); `attend` appends and attends causally."""
    k: jax.Array  # [batch, max_len, heads, head_dim]
    v: jax.Array
    pos: jax.Array  # int32 scalar: number of positions filled

    def attend(self, q, k, v):
        """q, k, v `[batch, t, heads, head_dim]` for positions pos..pos+t -> (attention output, updated cache)."""
        t, S = q.shape[1], self.k.shape[1]
        ck = jax.lax.dynamic_update_slice_in_dim(self.k, k.astype(self.k.dtype), self.pos, 1)
        cv = jax.lax.dynamic_update_slice_in_dim(self.v, v.astype(self.v.dtype), self.pos, 1)
        qpos = self.pos + jnp.arange(t)[:, None]
        mask = (jnp.arange(S)[None, :] <= qpos)[None, None]  # [1, 1, t, S]: causal over filled positions
        dt = q.dtype
        f32 = lambda a: a.astype(jnp.float32)
        a = jax.nn.dot_product_attention(f32(q), f32(ck), f32(cv), mask=mask).astype(dt)
        return a, KVCache(ck, cv, self.pos + t)


def _forward_cached(fwd: Forward, params, tokens, caches: KVCache):
    """tokens `[batch, t]` at positions caches.pos.. -> (last-position logits `[batch, vocab]`, new caches)."""
    cfg = fwd.cfg
    x = fwd.embed(params, tokens, pos0=caches.pos[0])

    def one(x, inp):
        p, c = inp
        y, c = nnx.merge(fwd.block_def, p)(x, cfg, None, c)
        return y, c

    x, caches = jax.lax.scan(one, x, (params["blocks"], caches))
    return fwd.logits(params, x[:, -1:])[:, 0], caches


def sample_logits(key, logits, temperature: float, top_k: int):
    """Sample ids `[batch]` from float32 logits `[batch, vocab]`; temperature 0 is greedy; top_k 0 keeps all."""
    if temperature <= 0:
        return jnp.argmax(logits, -1).astype(jnp.int32)
    logits = logits / temperature
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, -1).astype(jnp.int32)


def generate(fwd: Forward, params, prompt, new_tokens: int, key, temperature: float = 0.8, top_k: int = 40):
    """Prefill the prompt, then sample `new_tokens` one at a time from the cache. Jit-compatible.

    Raises:
      ValueError: prompt_len + new_tokens > seq_len.
    """
    cfg = fwd.cfg
    b, p = prompt.shape
    if p + new_tokens > cfg.seq_len or p < 1:
        raise ValueError(f"prompt of {p} tokens + {new_tokens} new > model.seq_len={cfg.seq_len}; "
                         f"shorten the prompt or ask for fewer tokens.")
    shape = (cfg.layers, b, cfg.seq_len, cfg.heads, cfg.head_dim)
    caches = KVCache(jnp.zeros(shape, fwd.cdt), jnp.zeros(shape, fwd.cdt), jnp.zeros((cfg.layers,), jnp.int32))
    logits, caches = _forward_cached(fwd, params, prompt, caches)

    def step(carry, k):
        logits, caches = carry
        tok = sample_logits(k, logits, temperature, top_k)
        logits, caches = _forward_cached(fwd, params, tok[:, None], caches)
        return (logits, caches), tok

    _, toks = jax.lax.scan(step, (logits, caches), jax.random.split(key, new_tokens))
    return jnp.concatenate([prompt, toks.T], axis=1)

