"""How a MoE layer's choices reach their experts and come back (`jaxpar/model/moe.py` routes; this moves rows).
Mesh-free: the collectives are `jaxpar/parallel/logical.py`'s, the identity outside a region manual over their axis.

A layer's choices are rows in priority order: `order` `[b, k·t]`, the expert of each (choice j, token i), all first
choices of a sequence before its second ones, each in token order (GShard's priority).

- `queue_positions`: each choice's place in its expert's queue over the whole sequence, also when the sequence is
  split over `context` (this device's tokens are two chunks of it, `jaxpar/parallel/context.py`): the counts of every
  chunk are all-gathered (a `[2·context, k, E]` table per sequence) and summed before the device's own, so the
  same choices fall beyond a capacity on every layout, without gathering any activation.
- `buffers`: each expert gets fixed slots, `min(capacity, t)` per sequence on this device (t: its tokens of the
  sequence); the buffers `[b, E, C, embed]` go to the experts' devices by an all-to-all over `expert` and the local
  experts run as one batched matmul. Dropless it computes E·t slots for k·t choices: E / k times the active work.
- `ragged`: the rows sorted by expert (a stable sort; dropped choices last) run as grouped matmuls over the experts'
  row counts (`jax.lax.ragged_dot`): the active work. Under expert parallelism each device first sends its
  per-(device, expert) counts (a tiny all-to-all), then its rows in one padded all-to-all (the contiguous run of rows
  for each destination, padded to R rows: R = all its rows, the worst case, or ceil(`expert_buffer_factor` x rows /
  expert devices), the overflow dropped and counted); the receiver sorts what arrived by local expert, runs the
  grouped matmuls, and everything goes back the same way. Every permutation is a gather whose gradient is the
  gather by the inverse permutation (`move`), never a scatter-add.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.model.base import ragged_swiglu
from jaxpar.parallel.logical import (context_rank, context_split, exchange_experts, exchange_ragged, expert_rank,
                                    expert_split, gather_context)

SCOPE = "experts"  # the routed experts' matmuls, as named in the HLO (`analysis.hlo_flops.stablehlo_flops` reads it)


def priority_order(idx):
    """Chosen experts `[b, t, k]` -> `[b, k·t]`: all first choices, then all second choices, ... (token order)."""
    b, t, k = idx.shape
    return idx.transpose(0, 2, 1).reshape(b, k * t)


def queue_positions(order, experts: int, k: int):
    """-> (each choice's place in its expert's queue over the whole sequence `[b, k·t]` int32, the sequence's choices
    per expert `[b, E]` int32 counted over every `context` device, and those of this device's tokens)."""
    b, kt = order.shape
    onehot = (order[..., None] == jnp.arange(experts)).astype(jnp.int32)  # [b, kt, E]
    cp = context_split()
    if cp == 1:
        return jnp.sum((jnp.cumsum(onehot, 1) - 1) * onehot, -1), onehot.sum(1), onehot.sum(1)
    n = kt // k // 2  # tokens per chunk; this device holds chunks r and 2·cp - 1 - r
    oh = onehot.reshape(b, k, 2, n, experts)
    within = jnp.cumsum(oh, 3) - oh  # choices of the same (choice rank, expert) earlier in the chunk
    every = gather_context(oh.sum(3)[None], axis=0)  # [cp, b, k, 2, E]: each device's two chunks
    dev = np.array([c if c < cp else 2 * cp - 1 - c for c in range(2 * cp)])
    slot = np.array([0 if c < cp else 1 for c in range(2 * cp)])
    chunks = every[dev, :, :, slot].transpose(1, 2, 0, 3)  # [b, k, 2cp, E] in sequence order
    per_rank = chunks.sum(2)  # [b, k, E]
    before_rank = jnp.cumsum(per_rank, 1) - per_rank  # earlier choice ranks, whole sequence
    before_chunk = jnp.cumsum(chunks, 2) - chunks  # same choice rank, earlier chunks
    r = context_rank()
    mine = jnp.take(before_chunk, jnp.stack([r, 2 * cp - 1 - r]), axis=2)  # [b, k, 2, E]
    pos = within + before_rank[:, :, None, None, :] + mine[:, :, :, None, :]
    return jnp.sum(pos * oh, -1).reshape(b, kt), per_rank.sum(1), onehot.sum(1)


def _gather_rows(x, index):
    """x `[b, n, d]`, index `[b, m]` in [0, n] (n: a zero row) -> `[b, m, d]`."""
    padded = jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1)
    return jnp.take_along_axis(padded, index[..., None], axis=1)


def buffers(experts_mlp, h, order, keep, experts: int, capacity: int):
    """The experts' outputs of every choice `[b, k, t, d]` (zeros where dropped), through fixed-size buffers."""
    b, t, d = h.shape
    k = order.shape[1] // t
    slots = min(capacity, t)  # a token never picks an expert twice: t slots per expert are always enough
    dest, token = slots_of(order, keep, experts, slots, t)
    buf = _gather_rows(h, token).reshape(b, experts, slots, d)
    buf = jax.ad_checkpoint.checkpoint_name(exchange_experts(buf, split_axis=1, concat_axis=0), "moe_dispatch")
    with jax.named_scope(SCOPE):
        y = experts_mlp(buf)
    y = exchange_experts(y, split_axis=0, concat_axis=1).reshape(b, experts * slots, d)
    return _gather_rows(y, dest).reshape(b, k, t, d)


def slots_of(order, keep, experts: int, slots: int, t: int):
    """-> (each choice's buffer slot `[b, k·t]` in [0, E·C], E·C meaning dropped; each slot's token `[b, E·C]`, t for
    an empty slot): the kept choices of each expert fill its C slots in priority order."""
    b, kt = order.shape
    kept = ((order[..., None] == jnp.arange(experts)) & keep[..., None]).astype(jnp.int32)
    place = jnp.sum((jnp.cumsum(kept, 1) - 1) * kept, -1)
    dest = jnp.where(keep, order * slots + place, experts * slots)
    rows = jnp.arange(b)[:, None]
    token = jnp.full((b, experts * slots + 1), t, jnp.int32).at[rows, dest].set(jnp.arange(kt, dtype=jnp.int32) % t)
    return dest, token[:, :-1]


@jax.custom_vjp
def move(x, index, valid, back, back_valid):
    """Rows `x[index]` where `valid` (else zeros): an injective move of rows (a permutation, or rows into a padded
    buffer); `back`/`back_valid` is its inverse (where each row of `x` went), so the gradient is a gather too."""
    return _take(x, index, valid)


def _take(x, index, valid):
    rows = jnp.take(x, jnp.clip(index, 0, x.shape[0] - 1), axis=0)
    return jnp.where(valid[:, None], rows, jnp.zeros((), x.dtype))


def _move_fwd(x, index, valid, back, back_valid):
    return _take(x, index, valid), (back, back_valid)


def _move_bwd(res, g):
    back, back_valid = res
    return _take(g, back, back_valid), None, None, None, None


move.defvjp(_move_fwd, _move_bwd)


def _permute(x, perm, inv):
    every = jnp.ones(perm.shape, bool)
    return move(x, perm, every, inv, every)


def _sort(key):
    """A stable sort of `key` -> (the permutation, its inverse)."""
    perm = jnp.argsort(key, stable=True).astype(jnp.int32)
    inv = jnp.zeros_like(perm).at[perm].set(jnp.arange(perm.shape[0], dtype=jnp.int32))
    return perm, inv


def ragged(experts_mlp, h, order, keep, experts: int, buffer_factor: float = 0.0, kernel: str = "xla"):
    """(The experts' outputs of every choice `[b, k, t, d]`, zeros where dropped; the choices dropped by the expert
    parallel send buffer): the rows sorted by expert and grouped matmuls (`kernel`: `model.grouped_matmul`)."""
    b, t, d = h.shape
    k = order.shape[1] // t
    x = jnp.broadcast_to(h[:, None], (b, k, t, d)).reshape(b * k * t, d)  # row (b, j, i): choice j of token i
    key = jnp.where(keep, order, experts).reshape(-1)  # dropped choices sort last, beyond every group
    perm, inv = _sort(key)
    groups = jnp.sum((key[:, None] == jnp.arange(experts)).astype(jnp.int32), 0)
    xs = jax.ad_checkpoint.checkpoint_name(_permute(x, perm, inv), "moe_dispatch")
    if expert_split() == 1:
        with jax.named_scope(SCOPE):
            ys, lost = ragged_swiglu(experts_mlp, xs, groups, kernel), jnp.zeros((), jnp.int32)
        ys = jnp.where((jnp.arange(ys.shape[0]) < groups.sum())[:, None], ys, jnp.zeros((), ys.dtype))  # dropped
    else:
        ys, lost = _expert_parallel(experts_mlp, xs, groups, buffer_factor, kernel)
    return _permute(ys, inv, perm).reshape(b, k, t, d), lost


def send_rows(rows: int, ep: int, factor: float) -> int:
    """R: the rows a device sends to each expert device (the padded all-to-all's block)."""
    return rows if factor == 0 else max(1, min(rows, math.ceil(factor * rows / ep)))


class Route(NamedTuple):
    """Where a device's sorted rows go under expert parallelism, per expert device j: its run starts at `start[j]`
    and holds `total[j]` rows, of which the first `sent[j]` are sent (at most `rows` = R); `got[j]` rows come from
    device j."""
    start: jax.Array
    total: jax.Array
    sent: jax.Array
    got: jax.Array
    rows: int


def _expert_parallel(experts_mlp, xs, groups, factor: float, kernel: str = "xla", trip: str | None = None):
    """Sorted rows `xs` `[n, d]` of this device, `groups` `[E]` (global experts) -> (their outputs `[n, d]`, rows
    dropped by the send buffer): sent to the devices holding their experts and back, by `jax.lax.ragged_all_to_all`
    on GPUs (the rows alone) and a padded all-to-all elsewhere (`trip`: `ragged` | `padded`; None: by the platform
    the program is lowered for). Either way source s's rows arrive at s·R of a `[ep·R, d]` buffer."""
    ep = expert_split()
    per = groups.reshape(ep, -1)  # rows per (destination, its local expert)
    R = send_rows(xs.shape[0], ep, factor)
    sent_per = jnp.clip(R - (jnp.cumsum(per, 1) - per), 0, per)  # the first R rows of each destination's run
    got_per = exchange_experts(sent_per, split_axis=0, concat_axis=0)  # [source, local expert]
    total = per.sum(1)
    route = Route(jnp.cumsum(total) - total, total, sent_per.sum(1), got_per.sum(1), R)

    def experts(got):
        """What arrived `[ep·R, d]` -> the local experts' outputs, in the same places."""
        ends = jnp.cumsum(got_per, 1)
        expert_of = jnp.sum(jnp.arange(R)[None, :, None] >= ends[:, None, :], -1).reshape(-1)  # `local`: padding
        perm, inv = _sort(expert_of)
        zs = jax.ad_checkpoint.checkpoint_name(_permute(got, perm, inv), "moe_dispatch")
        with jax.named_scope(SCOPE):
            zs = ragged_swiglu(experts_mlp, zs, got_per.sum(0), kernel)
        return _permute(zs, inv, perm)

    trips = {name: functools.partial(f, route=route, experts=experts)
             for name, f in (("ragged", _ragged_trip), ("padded", _padded_trip))}
    ys = trips[trip](xs) if trip else jax.lax.platform_dependent(xs, cuda=trips["ragged"], default=trips["padded"])
    return ys, jnp.sum(total - route.sent)


def _padded_trip(xs, route: Route, experts):
    """Each destination's run padded to R rows: one all-to-all of `[ep, R, d]` there, one back."""
    (n, d), ep, R = xs.shape, route.start.shape[0], route.rows
    i, j = jnp.arange(R), jnp.arange(n)
    src = (route.start[:, None] + i[None, :]).reshape(-1)
    src_ok = (i[None, :] < route.sent[:, None]).reshape(-1)
    dst = jnp.clip(jnp.sum(j[:, None] >= (route.start + route.total)[None, :], -1), 0, ep - 1)  # each row's device
    at = j - route.start[dst]
    slot, slot_ok = dst * R + at, (at < route.sent[dst]) & (j < route.total.sum())
    send = move(xs, src, src_ok, slot, slot_ok).reshape(ep, R, d)
    got = exchange_experts(send, split_axis=0, concat_axis=0).reshape(ep * R, d)  # [source, R] rows
    back = exchange_experts(experts(got).reshape(ep, R, d), split_axis=0, concat_axis=0).reshape(ep * R, d)
    return move(back, slot, slot_ok, src, src_ok)


def _ragged_trip(xs, route: Route, experts):
    """The rows alone (`jax.lax.ragged_all_to_all`): source s's land at s·R on the expert device, and come back to
    their own sorted places (each source's offsets, exchanged first); rows not sent come back as zeros."""
    d, ep, R = xs.shape[1], route.start.shape[0], route.rows
    mine = jnp.full((ep,), expert_rank() * R, jnp.int32)
    got = exchange_ragged(xs, jnp.zeros((ep * R, d), xs.dtype), route.start, route.sent, mine, route.got)
    theirs = exchange_experts(route.start, split_axis=0, concat_axis=0)  # where source s keeps the rows it sent me
    blocks = jnp.arange(ep, dtype=jnp.int32) * R
    return exchange_ragged(experts(got), jnp.zeros_like(xs), blocks, route.got, theirs, route.sent)
