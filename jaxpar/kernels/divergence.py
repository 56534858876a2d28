"""The generalized Jensen-Shannon divergence between a student's and a teacher's next-token distributions, from both
models' final hidden states and LM heads, never holding either model's whole float32 `[batch, seq, vocab]` logits
(distillation's loss; TRL's `DistillationTrainer`, Agarwal et al. 2024).

With p_s and p_t the student's and the teacher's softmax at temperature T and m = (1 - beta) p_s + beta p_t, a
position's divergence is KL(p_t || p_s) at beta 0 (forward KL), KL(p_s || p_t) at beta 1 (reverse KL), and
beta KL(p_t || m) + (1 - beta) KL(p_s || m) between (TRL's definition, no T^2 factor). The heads run over chunks of
`chunk` positions, one `[batch, chunk, vocab]` float32 block of each model's logits at a time; the backward
recomputes each chunk (`jax.checkpoint`). The teacher is frozen: no gradient reaches its hidden states or head.
Padded vocabulary ids (>= vocab_real) have zero probability under both. Vocab-parallel: the logits carry the
logical `vocab` axis, and the softmax's sums reduce over it.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxpar.kernels.cross_entropy import _by_chunks, _masked_logits, chunk_size


def _per_token(zs, zt, real, beta: float):
    """Log-probabilities' divergence per position: zs, zt `[b, c, V]` (at temperature), `real` `[V]` bool ->
    (divergence `[b, c]`, the student's entropy `[b, c]`)."""
    safe = lambda lp: jnp.where(real, lp, 0.0)  # noqa: E731  (padded ids: log 0 = -inf kept out of the sums and
    ls, lt = safe(jax.nn.log_softmax(zs, axis=-1)), safe(jax.nn.log_softmax(zt, axis=-1))  # of their gradients)
    ps, pt = jnp.where(real, jnp.exp(ls), 0.0), jnp.where(real, jnp.exp(lt), 0.0)
    if beta == 0.0:
        div = pt * (lt - ls)
    elif beta == 1.0:
        div = ps * (ls - lt)
    else:
        lm = jnp.logaddexp(ls + math.log(1 - beta), lt + math.log(beta))
        div = beta * pt * (lt - lm) + (1 - beta) * ps * (ls - lm)
    return div.sum(-1), jax.lax.stop_gradient(-(ps * ls).sum(-1))


def generalized_jsd(hs, ws, ht, wt, mask, beta: float, temperature: float, vocab_real: int, chunk: int):
    """The summed divergence over the positions `mask` weighs and the student's summed entropy there (nats, at the
    temperature, not differentiated): hs `[batch, seq, d_s]`, ws `[d_s, vocab]` the student's final hidden states
    and head, ht `[batch, seq, d_t]`, wt `[d_t, vocab]` the teacher's (any widths; one vocabulary), mask `[batch,
    seq]` -> (divergence sum, entropy sum), at least float32. `beta` in [0, 1], `temperature` > 0, `chunk`:
    positions per chunk (`cross_entropy.chunk_size`)."""
    if not 0.0 <= beta <= 1.0 or temperature <= 0:
        raise ValueError(f"beta={beta} must lie in [0, 1] and temperature={temperature} be > 0")
    ht, wt = jax.lax.stop_gradient(ht), jax.lax.stop_gradient(wt)

    @jax.checkpoint
    def one(sc, tc):
        zs, ids = _masked_logits(sc, ws, vocab_real)
        zt, _ = _masked_logits(tc, wt, vocab_real)
        div, ent = _per_token(zs / temperature, zt.astype(zs.dtype) / temperature, ids < vocab_real, beta)
        return jnp.stack([div, ent], -1)

    out = _by_chunks(one, hs, ht, chunk_size(hs.shape[1], chunk))  # [batch, seq, 2]
    m = mask.astype(out.dtype)
    return (out[..., 0] * m).sum(), (out[..., 1] * m).sum()
