"""Next-token cross-entropy from the final hidden states, never holding the whole float32 `[batch, seq, vocab]`.

`cross_entropy(h, w, targets, mask, vocab_real, chunk)`: the LM head `h @ w` and the loss run over chunks of `chunk`
positions of the sequence, one `[batch, chunk, vocab]` float32 block of logits at a time. Its backward is its own
(`jax.custom_vjp`): the loss is a sum, so its gradient is the cotangent times d(loss)/d(h, w), and those are computed
in the same pass as the loss (softmax − one-hot, Liger-Kernel's fused linear cross-entropy, Hsu et al. 2024): the
head costs three matmuls (logits, dh, dw) and no stored logits. dh is in the compute dtype (so under tensor parallel
the LM head's backward all-reduce moves compute-dtype bytes, as the other row-parallel reductions do); dw and the
loss in float32 (float64 for float64 runs). Padded vocabulary ids (>= vocab_real) get -inf logits: zero probability,
zero gradient. Vocab-parallel: `z` and `w` carry the logical `vocab` axis; the log-sum-exp and the target logit
reduce over it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxpar.dtypes import at_least_f32
from jaxpar.parallel.logical import constrain


def _masked_logits(h, w, vocab_real: int):
    """One chunk's logits: h `[b, c, d]`, w `[d, V]` -> (z `[b, c, V]` at least float32 with the padded ids
    (>= vocab_real) at -inf, the vocabulary's ids `[V]`)."""
    z = jnp.einsum("btd,dv->btv", h, w.astype(h.dtype), preferred_element_type=at_least_f32(h.dtype))
    z = constrain(z, ("batch", "seq", "vocab"))
    ids = jnp.arange(z.shape[-1])
    if vocab_real < z.shape[-1]:
        z = jnp.where(ids < vocab_real, z, -jnp.inf)
    return z, ids


def _chunk(h, w, y, m, vocab_real: int, grads: bool):
    """One chunk: h `[b, c, d]`, w `[d, V]`, y `[b, c]` int32, m `[b, c]` -> loss sum, and with `grads` (dh
    `[b, c, d]` compute dtype, dw `[d, V]` float32) of that sum."""
    f = at_least_f32(h.dtype)
    z, ids = _masked_logits(h, w, vocab_real)
    lse = jax.nn.logsumexp(z, axis=-1)
    hit = ids == y[..., None]  # the target's logit by a compare: partitions over a vocab-sharded z, no gather
    loss = ((lse - jnp.where(hit, z, 0.0).sum(-1)) * m).sum()
    if not grads:
        return loss
    dz = ((jnp.exp(z - lse[..., None]) - hit) * m[..., None].astype(f)).astype(h.dtype)
    dz = constrain(dz, ("batch", "seq", "vocab"))
    dh = jnp.einsum("btv,dv->btd", dz, w.astype(h.dtype), preferred_element_type=h.dtype)
    dw = jnp.einsum("btd,btv->dv", h, dz, preferred_element_type=f)
    return loss, dh, constrain(dw, ("embed", "vocab"))


def _chunks(a, n: int):
    """`[b, t, ...]` -> `[n, b, t / n, ...]` (chunk i = positions i·t/n ..)."""
    return jnp.moveaxis(a.reshape(a.shape[0], n, a.shape[1] // n, *a.shape[2:]), 1, 0)


def _run(h, w, y, m, vocab_real: int, chunk: int, grads: bool):
    n = h.shape[1] // chunk
    if n == 1:
        return _chunk(h, w, y, m, vocab_real, grads)
    hs, ys, ms = _chunks(h, n), _chunks(y, n), _chunks(m, n)
    first = _chunk(hs[0], w, ys[0], ms[0], vocab_real, grads)  # the carry starts from chunk 0: its types

    def body(acc, xs):
        out = _chunk(*xs[:1], w, *xs[1:], vocab_real, grads)
        if not grads:
            return acc + out, None
        return (acc[0] + out[0], acc[1] + out[2]), out[1]

    if not grads:
        return jax.lax.scan(body, first, (hs[1:], ys[1:], ms[1:]))[0]
    (loss, dw), dhs = jax.lax.scan(body, (first[0], first[2]), (hs[1:], ys[1:], ms[1:]))
    dh = jnp.concatenate([first[1][None], dhs], 0)
    return loss, jnp.moveaxis(dh, 0, 1).reshape(h.shape), dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _loss(h, w, y, m, vocab_real, chunk):
    return _run(h, w, y, m, vocab_real, chunk, False)


def _loss_fwd(h, w, y, m, vocab_real, chunk):
    loss, dh, dw = _run(h, w, y, m, vocab_real, chunk, True)
    return loss, (dh, dw, jnp.zeros((0,), w.dtype))


def _loss_bwd(vocab_real, chunk, res, g):
    dh, dw, w_tag = res  # w_tag: an empty array of w's dtype
    return (dh.astype(g.dtype) * g).astype(dh.dtype), (dw * g).astype(w_tag.dtype), None, None


_loss.defvjp(_loss_fwd, _loss_bwd)


def chunk_size(seq: int, chunk: int) -> int:
    """Positions per chunk: the largest divisor of `seq` not above `chunk` (>= seq: one chunk)."""
    return max(d for d in range(1, min(max(chunk, 1), seq) + 1) if seq % d == 0)


def cross_entropy(h, w, targets, mask, vocab_real: int, chunk: int):
    """Summed next-token cross-entropy (nats) and the number of tokens: h `[batch, seq, embed]` (compute dtype),
    w `[embed, vocab]` (any dtype; used in h's), targets `[batch, seq]` int32, mask `[batch, seq]` float32 (loss
    weights) -> (loss_sum, token_count) float32 scalars. `chunk`: positions per chunk (`chunk_size`)."""
    c = chunk_size(h.shape[1], chunk)
    return _loss(h, w, targets, mask.astype(at_least_f32(h.dtype)), vocab_real, c), mask.sum()


def token_log_probs(h, w, targets, vocab_real: int, chunk: int):
    """Each position's log-probability of its target: h `[batch, seq, embed]`, w `[embed, vocab]`, targets
    `[batch, seq]` int32 -> `[batch, seq]` (at least float32), by chunks of `chunk` positions. Plain autodiff: the
    backward recomputes each chunk's logits (`jax.checkpoint`), so the float32 logits are never whole either (what
    a sequence-level objective, DPO, differentiates through)."""
    c = chunk_size(h.shape[1], chunk)

    @jax.checkpoint
    def one(hc, yc):
        z, ids = _masked_logits(hc, w, vocab_real)
        return jnp.where(ids == yc[..., None], z, 0.0).sum(-1) - jax.nn.logsumexp(z, axis=-1)

    return _by_chunks(one, h, targets, c)


def token_entropy(h, w, vocab_real: int, chunk: int):
    """Each position's entropy (nats) of the predicted distribution, not differentiated (GRPO's metric): h
    `[batch, seq, embed]`, w `[embed, vocab]` -> `[batch, seq]` (at least float32), by chunks of `chunk` positions."""
    def one(hc, _):
        z, _ = _masked_logits(jax.lax.stop_gradient(hc), jax.lax.stop_gradient(w), vocab_real)
        logp = jax.nn.log_softmax(z, axis=-1)
        return -jnp.where(jnp.isfinite(logp), jnp.exp(logp) * logp, 0.0).sum(-1)

    return _by_chunks(one, h, h[..., 0], chunk_size(h.shape[1], chunk))


def _by_chunks(one, h, y, c: int):
    """`one(h chunk, y chunk) -> [batch, c, ...]` over the sequence's chunks of `c` positions (y `[batch, seq,
    ...]`) -> `[batch, seq, ...]`."""
    n = h.shape[1] // c
    if n == 1:
        return one(h, y)
    out = jax.lax.map(lambda a: one(*a), (_chunks(h, n), _chunks(y, n)))  # [n, batch, c, ...]
    return jnp.moveaxis(out, 0, 1).reshape(y.shape[:2] + out.shape[3:])


def place_rows(place, values):
    """`place` `[rows, global rows]` one-hot (float), `values` `[rows, ...]` -> `[global rows, ...]`: each row's values
    at its global row, zeros elsewhere (a sum over the rows: over microbatches and data shards it assembles every
    row; XLA partitions a scatter here into collectives that deadlocked XLA:CPU). At `Precision.HIGHEST`, so the
    values pass exactly (one term per output) on every matmul unit: a GPU's default TF32 would keep 10 of float32's
    23 mantissa bits of each log-prob."""
    return jnp.tensordot(place, values, axes=((0,), (0,)), precision=jax.lax.Precision.HIGHEST)
