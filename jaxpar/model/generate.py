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


def generate(fwd: Forward, params, prompt, new_tokens: int, key, temperature: float = 0.8, top_k: int = 40):
    """Prefill the prompt, then sample `new_tokens` one at a time from the cache. Jit-compatible.

    Raises:
      ValueError: prompt_len + new_tokens > max_positions.
    """
    cfg = fwd.cfg
    b, p = prompt.shape
    if p + new_tokens > cfg.max_positions or p < 1:
        raise ValueError(f"prompt of {p} tokens + {new_tokens} new > the model's max_positions={cfg.max_positions}; "
                         f"shorten the prompt or ask for fewer tokens.")
    logits, caches = fwd.decode(params, prompt, fwd.init_cache(b, p + new_tokens))

    def step(carry, k):
        logits, caches = carry
        tok = sample_logits(k, logits, temperature, top_k)
        logits, caches = fwd.decode(params, tok[:, None], caches)
        return (logits, caches), tok

    _, toks = jax.lax.scan(step, (logits, caches), jax.random.split(key, new_tokens))
    return jnp.concatenate([prompt, toks.T], axis=1)

