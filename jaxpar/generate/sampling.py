"""Choosing the next token: greedy, or sampling with temperature, top-k, top-p (nucleus) and min-p, per row.

Every row carries its own settings (`Sampling`, arrays `[batch]`) and its own key, `row_keys`:
fold_in(fold_in(key(seed), stream), token index), so a request's tokens depend on its seed, its stream (the n-th sample of a prompt) and its own
history only, never on the other rows of the batch or on the layout.

The filters run in the order Hugging Face's `generate` applies them (its logits processors: temperature, top-k, top-p,
min-p): temperature, then top-k (the k most likely), top-p (the smallest set of the most likely tokens whose
probability reaches p), min-p (tokens at least min_p times the most likely one's probability, Nguyen et al. 2024),
each on the distribution the previous ones left. A row with no filter draws from the softmax of its logits directly
(no sort of the vocabulary: 151,936 logits per token for Qwen3); a row with one sorts them once. A draw inverts
the distribution's CDF at one uniform number per row (`draw`), not a Gumbel variate per vocabulary entry. (vLLM's sampler applies min-p before top-k and top-p, so with
min-p and another filter together the two can keep different sets.)

A token's log-prob is reported under the distribution it was drawn from (temperature and filters applied); a greedy
row's is the model's at temperature 1 (what vLLM and transformers report for greedy decoding), the same number as the
model log-prob beside it.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class Sampling(NamedTuple):
    """Per-row settings, each `[batch]`: temperature (0 = greedy), top_k (0 = all), top_p (1 = all), min_p (0 = all)."""
    temperature: jax.Array  # float32
    top_k: jax.Array  # int32
    top_p: jax.Array  # float32
    min_p: jax.Array  # float32


def row_keys(seeds, streams, index):
    """Each row's key for its token number `index`: seeds, streams, index `[batch]` int32 -> keys `[batch]`."""
    one = lambda s, st, i: jax.random.fold_in(jax.random.fold_in(jax.random.key(s), st), i)  # noqa: E731
    return jax.vmap(one)(seeds, streams, index)


def _filtered(z, s: Sampling):
    """Sorted logits `z` `[b, V]` (descending, temperature applied) -> the same with the filtered ones at -inf."""
    rank = jnp.arange(z.shape[-1])[None]
    keep = rank < jnp.where(s.top_k > 0, s.top_k, z.shape[-1])[:, None]
    z = jnp.where(keep, z, -jnp.inf)
    p = jax.nn.softmax(z, -1)
    z = jnp.where((jnp.cumsum(p, -1) - p < s.top_p[:, None]) | (rank == 0), z, -jnp.inf)
    p = jax.nn.softmax(z, -1)
    return jnp.where(p >= s.min_p[:, None] * p[:, :1], z, -jnp.inf)


def filters_on(s: Sampling, vocab: int):
    """Which rows filter (`[b]` bool): top-k below the vocabulary, top-p below 1 or min-p above 0. A row that does
    not draws from the whole softmax, unsorted; one that does sorts its logits once."""
    return ((s.top_k > 0) & (s.top_k < vocab)) | (s.top_p < 1) | (s.min_p > 0)


BLOCK = 512  # vocabulary entries per block of `draw`'s two-level search


def draw(keys, z):
    """One token per row from softmax(z) (z `[b, V]` unnormalised logits, -inf = never), by inverting its CDF at one
    uniform number per row (`keys` `[b]`): the block of `BLOCK` entries whose cumulative mass passes it, then the
    entry within that block. A row costs one pass over its exponentiated logits and one uniform number, where a
    Gumbel-max draw (`jax.random.categorical`) makes V random numbers a row (151,936 for Qwen3)."""
    b, V = z.shape
    nb = -(-V // BLOCK)
    z = jnp.pad(z, ((0, 0), (0, nb * BLOCK - V)), constant_values=-jnp.inf)
    p = jnp.exp(z - jnp.max(z, -1, keepdims=True)).reshape(b, nb, BLOCK)
    mass = p.sum(-1)
    below = jnp.cumsum(mass, -1)
    u = jax.vmap(jax.random.uniform)(keys) * below[:, -1]
    j = jnp.minimum(jnp.sum(below <= u[:, None], -1), jnp.argmax(jnp.where(mass > 0, jnp.arange(nb), -1), -1))
    inside = jnp.take_along_axis(p, j[:, None, None], 1)[:, 0]  # [b, BLOCK]
    rest = u - (jnp.take_along_axis(below, j[:, None], 1)[:, 0] - jnp.take_along_axis(mass, j[:, None], 1)[:, 0])
    last = jnp.argmax(jnp.where(inside > 0, jnp.arange(BLOCK), -1), -1)  # (rounding never lands on a zero)
    i = jnp.minimum(jnp.sum(jnp.cumsum(inside, -1) <= rest[:, None], -1), last)
    return (j * BLOCK + i).astype(jnp.int32)


def sample(logits, keys, s: Sampling, greedy_only: bool = False, any_filter: bool = True):
    """logits `[b, V]` (padded ids at -inf), keys `[b]` -> (tokens `[b]` int32, each token's log-prob under the
    sampling distribution (a greedy row: the model's) and under the model at temperature 1, float32 `[b]`).

    `greedy_only` (static): every row is greedy, so nothing is drawn. `any_filter` (static): some row filters
    (`filters_on`), so the sorted path is computed for those rows; without it nothing is sorted. Which path a row
    takes is its own settings' choice, so its tokens never depend on the other rows."""
    logits = logits.astype(jnp.float32)
    at = lambda z, t: jnp.take_along_axis(z, t[:, None], -1)[:, 0]  # noqa: E731 (one value a row)
    norm = jax.nn.logsumexp(logits, -1)  # (a reduction: no [rows, vocab] log-softmax is written)
    if greedy_only:
        tok = jnp.argmax(logits, -1).astype(jnp.int32)
        lp = at(logits, tok) - norm
        return tok, lp, lp
    greedy = s.temperature <= 0
    z = logits / jnp.where(greedy, 1.0, s.temperature)[:, None]
    # no filter: a draw from softmax(z) itself (`categorical` takes unnormalised logits)
    tok = jnp.where(greedy, jnp.argmax(z, -1), draw(keys, z)).astype(jnp.int32)
    lp = at(z, tok) - jax.nn.logsumexp(z, -1)
    if any_filter:
        order = jnp.argsort(-z, axis=-1, stable=True)  # the most likely first; ties by the lower id, as argmax
        kept = jax.nn.log_softmax(_filtered(jnp.take_along_axis(z, order, -1), s), -1)
        pick = draw(keys, kept)
        on = filters_on(s, z.shape[-1]) & ~greedy
        tok = jnp.where(on, at(order, pick).astype(jnp.int32), tok)
        lp = jnp.where(on, at(kept, pick), lp)
    lp_model = at(logits, tok) - norm
    return tok, jnp.where(greedy, lp_model, lp), lp_model


def vocab_blocks(w, parts: int = 1, rows: int = 64, block_bytes: int = 4 << 20):
    """The unembedding w `[embed, vocab]` as `[n, parts, vocab / (parts n), embed]`: the vocabulary in `parts` (its
    split over devices) x n blocks, block j of every part together (one copy a decode call; for tied embeddings a
    reshape of `wte`). n is the fewest of 1, 2, 4, .., 64 that divides the vocabulary and keeps a block's logits of
    `rows` rows within `block_bytes` (in cache while reduced: on the 2-core CPU host, 64 rows x 151,936 entries ran
    the head in 35 ms as 16 blocks, 45 ms as 8, 40 ms as 64), else the most that divides it."""
    E, V = w.shape
    fits = [k for k in (1, 2, 4, 8, 16, 32, 64) if V % (parts * k) == 0]
    n = next((k for k in fits if rows * (V // (parts * k)) * w.dtype.itemsize <= block_bytes), fits[-1])
    return jnp.moveaxis(w.T.reshape(parts, n, V // (parts * n), E), 1, 0)


def greedy_head(h, wb, dt, vocab_real: int):
    """The greedy token `[b]` int32 and its log-prob of the logits of h `[b, embed]` under the unembedding in blocks
    `wb` (`vocab_blocks`), in `dt`, ids from `vocab_real` on excluded, without writing the logits: a block's logits
    give their max, first arg-max and exp-sum while they are in cache (the logsumexp by running rescaling). Ties go
    to the lower id, as `argmax`'s: the least id holding the max, a min over ids as float32 where they are exact
    (below 2^24; a float min reduces in one pass on a CPU, an int32 one in two: 25 against 34 ms a step)."""
    n, parts, blk, E = wb.shape
    i32 = lambda k: jnp.arange(k, dtype=jnp.int32)  # noqa: E731 - (int32 also in x64 mode)
    ids = (i32(parts)[:, None] * (n * blk) + i32(blk)).reshape(-1)  # block 0's ids, part by part
    as_id = jnp.float32 if n * parts * blk <= 1 << 24 else jnp.int32

    def one(carry, inp):
        m, idx, s = carry
        wj, j = inp
        z = jnp.einsum("bd,kd->bk", h, wj, preferred_element_type=dt)  # (2-D: a 3-D product ran 2x slower on CPU)
        at = ids + j * blk
        if vocab_real < n * parts * blk:  # (padded ids: masked; no pass over the block otherwise)
            z = jnp.where(at < vocab_real, z, -jnp.inf)
        top = z.max(1)
        first = jnp.min(jnp.where(z == top[:, None], at.astype(as_id), n * parts * blk), 1).astype(jnp.int32)
        new = jnp.maximum(m, top)
        s = s * jnp.exp(m - new) + jnp.exp(z - new[:, None]).sum(1)
        return (new, jnp.where((top > m) | ((top == m) & (first < idx)), first, idx), s), None

    b = h.shape[0]
    init = (jnp.full(b, -jnp.inf, dt), jnp.zeros(b, jnp.int32), jnp.zeros(b, dt))
    (_, tok, s), _ = jax.lax.scan(one, init, (wb.reshape(n, parts * blk, E), i32(n)))
    return tok, (-jnp.log(s)).astype(jnp.float32)  # the max's log-prob: max - (max + log s)
