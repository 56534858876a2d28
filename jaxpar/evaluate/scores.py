"""Scoring token sequences on the training layout: one row per sequence, a weight per target, and for each row the
sums lm-eval asks for, computed where the loss runs (after the layer scan, or on the last pipeline stage) by the
layout's own engine (`Steps.forward`), the params sharded as training keeps them.

`Scores` is the head: per row, (sum of the weighted targets' log-probs, how many weighted targets are not the
greedy (argmax) token, the greedy token at the weighted positions). `score(steps, params, rows, length)` packs rows
`(tokens, first_scored)` into batches of the layout's rows, pads, runs them, and returns per row
(log-prob sum, is_greedy, the greedy next token after the row's last token).

Padding: rows right-padded with token 0 and weight 0 (a causal model's earlier positions never see them); the
sequence padded to a bucket (`bucket`: powers of two, multiples of 16 and of what sequence and context parallelism
split) so that a few shapes compile; batches padded with weightless rows.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar import data
from jaxpar.cluster import exchange
from jaxpar.kernels.cross_entropy import chunk_size, place_rows


def token_scores(fwd, params, x, targets, chunk: int):
    """x `[b, t, embed]` (the last layer's output), targets `[b, t]` -> (each target's log-prob `[b, t]` float32 at
    least, the greedy (argmax, first of ties) token at each position `[b, t]` int32), by chunks of positions (the
    float32 logits of a chunk at a time; `Forward.logits`: padded vocabulary ids never win)."""
    c = chunk_size(x.shape[1], chunk)
    n = x.shape[1] // c

    def one(xs):
        xc, yc = xs
        z = fwd.logits(params, xc)  # [b, c, V]
        hit = jnp.arange(z.shape[-1]) == yc[..., None]
        lp = jnp.where(hit, z, 0.0).sum(-1) - jax.nn.logsumexp(z, axis=-1)
        return lp, jnp.argmax(z, axis=-1).astype(jnp.int32)

    split = lambda a: jnp.moveaxis(a.reshape(a.shape[0], n, c, *a.shape[2:]), 1, 0)  # noqa: E731
    lp, greedy = jax.lax.map(one, (split(x), split(targets)))
    join = lambda a: jnp.moveaxis(a, 0, 1).reshape(targets.shape)  # noqa: E731
    return join(lp), join(greedy)


@dataclasses.dataclass(frozen=True)
class Scores:
    """The evaluation head: its count is `[rows, 3]`, row r's (sum of w x log-prob, sum of w x [target is not the
    greedy token], sum of w x greedy token id), each microbatch writing its rows (`ids`) and zeros elsewhere, so that
    the engine's sum over microbatches and data shards assembles them (as `objective.ReferenceSums`). Its loss is 0.
    With w one-hot at a row's last position, the third column is the greedy next token (exact in float32 below
    2^24 ids)."""
    rows: int
    chunk: int
    reference = False

    def head(self, fwd, params, x, mb):
        lp, greedy = token_scores(fwd, params, x, mb["y"], self.chunk)
        f, w = lp.dtype, mb["w"].astype(lp.dtype)
        on = lambda a: jnp.where(w > 0, a.astype(f) * w, 0.0).sum(1)  # noqa: E731 (padding's values never count)
        sums = jnp.stack([on(lp), on(greedy != mb["y"]), on(greedy)], axis=-1)
        place = (mb["ids"][:, None] == jnp.arange(self.rows)).astype(f)  # a one-hot product, not a scatter
        return jnp.zeros((), f), place_rows(place, sums)


def bucket(n: int, most: int, multiple: int = 16) -> int:
    """The padded length for `n` tokens: the next power of two of at least `multiple`, a multiple of `multiple`,
    and at most `most` rounded up to `multiple` (few shapes, few compiles)."""
    p = -(-max(multiple, 1 << max(n - 1, 0).bit_length()) // multiple) * multiple
    return min(p, -(-most // multiple) * multiple)


def row_multiple(steps) -> int:
    """Rows a batch must be a multiple of: the batch axes' devices times the microbatches."""
    return int(np.prod([steps.mesh.shape[a] for a in _batch_axes(steps)])) * steps.layout.microbatches


def _batch_axes(steps) -> tuple:
    spec = steps.batch_sharding.spec[0]
    return () if spec is None else (spec,) if isinstance(spec, str) else tuple(spec)


def score(steps, params, rows, batch: int):
    """rows: `(tokens, first_scored)`, each a sequence of token ids and the index of its first scored token (>= 1;
    tokens before it are context) -> a float64 array `[len(rows), 3]`: (sum of the scored tokens' log-probs,
    scored tokens that are not the greedy prediction, the greedy token after the last token; this one only when
    `first_scored == len(tokens)`, nothing scored: pass it to ask for the next token). `batch` rows per pass,
    rounded up to `row_multiple(steps)`; the caller orders rows (longest first) and keeps each within the model's
    `max_positions` + 1 tokens."""
    m, lo = row_multiple(steps), steps.layout
    batch = -(-max(batch, 1) // m) * m
    multiple = math.lcm(16, 2 * lo.context * lo.tensor)  # sequence and context parallelism split the positions
    head_dtype = np.float64 if steps.cfg.compute_dtype == "float64" else np.float32
    out = np.zeros((len(rows), 3), np.float64)
    for start in range(0, len(rows), batch):
        chunk = rows[start:start + batch]
        # inputs: a scored row's tokens but its last; a next-token row's all of them
        T = bucket(max(len(t) - (first < len(t)) for t, first in chunk), steps.cfg.max_positions, multiple)
        tokens = np.zeros((batch, T + 1), np.int32)
        mask = np.zeros((batch, T), head_dtype)
        for i, (t, first) in enumerate(chunk):
            tokens[i, :len(t)] = t
            if first < len(t):
                mask[i, first - 1:len(t) - 1] = 1  # target j is token j + 1
            else:  # the next token: the greedy prediction at the last position
                mask[i, len(t) - 1] = 1
        sh = steps.batch_sharding
        lo, hi = data.process_rows(sh, batch)  # (every process holds every request: each feeds its rows)
        b = {"tokens": data.to_global(tokens[lo:hi], sh, batch), "mask": data.to_global(mask[lo:hi], sh, batch)}
        count = steps.forward(params, b, Scores(batch, int(steps.cfg.loss_chunk)))[1]
        res = np.asarray(exchange.fetch(count), np.float64)[:len(chunk)]
        out[start:start + len(chunk)] = res
    return out

