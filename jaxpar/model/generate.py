"""Autoregressive sampling with a KV cache (temperature, top-k), on the params dict of `jaxpar.model`.

Shapes: prompt `[batch, prompt_len]` int32; cache per layer `[batch, prompt_len + new_tokens, kv_heads, head_dim]`
(compute dtype); output `[batch, prompt_len + new_tokens]` int32. The total length is bounded by the model's
`max_positions` (gpt2's position table; llama's context).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.model import Forward, KVCache  # noqa: F401  (KVCache: re-exported for callers)


def sample_logits(key, logits, temperature: float, top_k: int):
    """Sample ids `[batch]` from float32 logits `[batch, vocab]`; temperature 0 is greedy; top_k 0 keeps all."""
    if temperature <= 0:
        return jnp.argmax(logits, -1).astype(jnp.int32)
    logits = logits / temperature
    if top_k:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, -1).astype(jnp.int32)


def generate(fwd: Forward, params, prompt, new_tokens: int, key, temperature: float = 0.8, top_k: int = 40,
             stop_ids: tuple = ()):
    """Prefill the prompt, then sample up to `new_tokens` one at a time from the cache; with `stop_ids` (a chat's
    end-of-turn and end-of-sequence ids) each sequence stops at the first of them and the loop ends once every
    sequence has (the rest of a stopped row is filled with `stop_ids[0]`). Jit-compatible.

    Raises:
      ValueError: prompt_len + new_tokens > max_positions.
    """
    cfg = fwd.cfg
    b, p = prompt.shape
    if p + new_tokens > cfg.max_positions or p < 1:
        raise ValueError(f"prompt of {p} tokens + {new_tokens} new > the model's max_positions={cfg.max_positions}; "
                         f"shorten the prompt or ask for fewer tokens.")
    logits, caches = fwd.decode(params, prompt, fwd.init_cache(b, p + new_tokens))
    keys = jax.random.split(key, new_tokens)
    stop = jnp.asarray(stop_ids or (-1,), jnp.int32)

    def step(carry):
        i, logits, caches, toks, done = carry
        tok = jnp.where(done, stop[0], sample_logits(keys[i], logits, temperature, top_k))
        logits, caches = fwd.decode(params, tok[:, None], caches)
        return i + 1, logits, caches, toks.at[:, i].set(tok), done | jnp.isin(tok, stop)

    def more(carry):
        return (carry[0] < new_tokens) & ~jnp.all(carry[4])

    start = (jnp.int32(0), logits, caches, jnp.full((b, new_tokens), stop[0], jnp.int32), jnp.zeros((b,), bool))
    toks = jax.lax.while_loop(more, step, start)[3]
    return jnp.concatenate([prompt, toks], axis=1)
