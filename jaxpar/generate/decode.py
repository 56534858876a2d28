"""The compiled pieces of generation, pure functions of arrays (the host loop is `engine.py`): prefill a group of
ragged prompts into fresh cache rows, insert them into their slots, decode every slot a few tokens at a time, and
score given token sequences with the training forward.

Ragged prompts are right-padded: row r's tokens sit at positions 0..len_r-1, the pad after them is written to the
cache but lies past the row's position count, so it is masked and later overwritten; every row keeps its own position
(`KVCache.pos` `[layers, batch]`), hence its own RoPE angles / GPT-2 position rows: a row computes what it would alone.
"""
from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from jaxpar import model as gpt
from jaxpar.generate import cache as kv
from jaxpar.generate.sampling import Sampling, greedy_head, row_keys, sample, vocab_blocks
from jaxpar.model.layers import KVCache
from jaxpar.parallel.logical import activation_rules, mesh_axes, spec


class Decoder:
    """The jitted programs of one model on one mesh (None: wherever the params are, no sharding constraints).

    `rules`: the training rules (`config.step_rules`); the decode layout's are `cache.decode_rules` of them. `zero3`:
    the params are ZeRO-3 sharded, gathered here one layer at a time. `prefill_chunk` (a power of two): a prompt group
    longer than this prefills that many positions at a time (its attention scores c x the cache's length, not the
    whole prompt's square). `block` > 0: the running batch's cache is a paged pool of blocks of that many positions
    (`paged.py`), its block table an argument of each call; 0: a dense row of the whole context per slot.
    `kv_context`: each row's KV positions split over `context` (`cache.decode_rules`), else the rows."""

    def __init__(self, fwd: gpt.Forward, mesh=None, rules=(), zero3: bool = False, prefill_chunk: int = 512,
                 block: int = 0, kv_context: bool = False):
        self.fwd, self.cfg, self.mesh, self.prefill_chunk = fwd, fwd.cfg, mesh, int(prefill_chunk)
        self.zero3, self.block, self.kv_context = zero3, int(block), bool(kv_context)
        self.rules = kv.decode_rules(rules, self.kv_context)
        self.prepare = None
        if mesh is not None and zero3:
            specs = kv.layer_specs(self.cfg, rules, mesh)
            self.prepare = lambda p: jax.tree.map(
                lambda a, s: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, s)), p, specs)
        self.key = (self.cfg, mesh, self.rules, zero3, self.prefill_chunk, self.block, self.kv_context)

    # equal decoders (the same model, mesh, rules) share their compiled programs: `self` is a static argument
    def __hash__(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, Decoder) and self.key == other.key

    def empty(self, batch: int, length: int, blocks: int = 0):
        """The running batch's carry with every slot empty: (cache, the last layer's activations `[batch, embed]`
        whose head gives the next token, experts); paged: a pool of `blocks` blocks."""
        return _jit_empty(self, batch, length, blocks)

    def _empty(self, batch: int, length: int, blocks: int):
        cfg = self.cfg
        k = cfg.experts_per_token if cfg.experts else 0
        cache = (kv.empty_pool(cfg, blocks, self.block, batch, self.pool_sharding(blocks)) if self.block else
                 kv.empty(cfg, batch, length, self.cache_sharding(batch, length)))
        return cache, jnp.zeros((batch, cfg.embed), self.fwd.cdt), jnp.zeros((batch, cfg.layers, k), jnp.int32)

    def prefill(self, params, tokens, lengths, length: int):
        return _jit_prefill(self, params, tokens, lengths, length)

    def insert(self, carry, rows, slots, src, table=None):
        return _jit_insert(self, carry, rows, slots, src, table)

    def decode(self, params, carry, rows, sampling, steps: int, mode: str):
        return _jit_decode(self, params, carry, rows, sampling, steps, mode)

    def score(self, params, tokens):
        return _jit_score(self, params, tokens)

    def extend(self, params, carry, ids, starts, lengths, table=None):
        return _jit_extend(self, params, carry, ids, starts, lengths, table)

    def _scope(self):
        return activation_rules(self.rules, self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def row_split(self) -> int:
        """How many shards the batch's rows split into (data x expert on the training layouts; 1 on one device)."""
        if self.mesh is None:
            return 1
        batch = spec(kv.CACHE_NAMES, self.rules)[1]
        return math.prod(dict(self.mesh.shape)[a] for a in mesh_axes(batch))

    def cache_sharding(self, batch: int, length: int):
        if self.mesh is None:
            return None
        return NamedSharding(self.mesh, kv.cache_spec(self.cfg, self.rules, dict(self.mesh.shape), batch, length))

    def pool_sharding(self, blocks: int):
        if self.mesh is None:
            return None
        return NamedSharding(self.mesh, kv.pool_spec(self.cfg, self.rules, dict(self.mesh.shape), blocks, self.block))

    def _run(self, params, tokens, cache: KVCache, table=None):
        """tokens `[b, t]` at each row's next positions -> (last-layer activations `[b, t, embed]`, cache, the experts
        each token used `[layers, b, t, k]` (k = 0 for a dense model)); `table`: a paged cache's block table."""
        cfg, fwd = self.cfg, self.fwd
        t = tokens.shape[1]
        x = fwd.embed(params, tokens, positions=cache.pos[0][:, None] + jnp.arange(t))

        def one(carry, inp):  # the stacked cache goes through: each layer writes its new positions in place
            x, k, v = carry
            p, i = inp
            p = p if self.prepare is None else self.prepare(p)
            y, c, st = nnx.merge(fwd.block_def, p)(x, cfg, None, KVCache(k, v, cache.pos[0], i, table), layer=i)
            return (y, c.k, c.v), st["experts"] if cfg.experts else jnp.zeros((x.shape[0], t, 0), jnp.int32)

        (x, k, v), experts = jax.lax.scan(one, (x, cache.k, cache.v),
                                          (gpt.split_params(params)[1], jnp.arange(cfg.layers)))
        return x, KVCache(k, v, cache.pos + t), experts

    def _prefill(self, params, tokens, lengths, length: int):
        """Prompts `[n, t]` (right-padded), their lengths `[n]` -> (each prompt's last activations `[n, embed]`, a cache
        of n rows of `length` positions holding them, the experts of each prompt's last token `[n, layers, k]`, the
        experts of every position `[n, t, layers, k]`)."""
        n, t = tokens.shape
        c = min(t, self.prefill_chunk, t & -t)  # (the largest power of two that divides t, at most the chunk)
        with self._scope():
            cache = kv.empty(self.cfg, n, length, self.cache_sharding(n, length))
            if c == t:
                x, cache, experts = self._run(params, tokens, cache)
            else:  # chunk by chunk, each attending over the cache so far: scores of c x length, not t x length
                def chunk(cache, piece):
                    x, cache, experts = self._run(params, piece, cache)
                    return cache, (x, experts)

                cache, (xs, es) = jax.lax.scan(chunk, cache, jnp.swapaxes(tokens.reshape(n, t // c, c), 0, 1))
                x = jnp.swapaxes(xs, 0, 1).reshape(n, t, xs.shape[-1])  # [chunks, n, c, E] -> [n, t, E]
                experts = jnp.moveaxis(es, 0, 2).reshape(es.shape[1], n, t, es.shape[-1])  # -> [layers, n, t, k]
            last = x[jnp.arange(n), lengths - 1]
        cache = cache._replace(pos=jnp.broadcast_to(lengths, cache.pos.shape).astype(jnp.int32))
        every = jnp.transpose(experts, (1, 2, 0, 3))
        return last, cache, every[jnp.arange(n), lengths - 1], every

    def _insert(self, carry, rows, slots, src, table=None):
        """Put prefilled rows (cache, activations, experts: `_prefill`'s) into slots `[n]` of the running batch's
        `carry` (cache, activations, experts): slot `slots[j]` gets prefilled row `src[j]` (a prompt prefilled once
        for all the slots that sample it); a slot index past the batch drops its entry (a prefill group's padding).
        Paged: each position goes to its slot's block in `table` `[slots, width]` (the pool's numbers: a full block
        two slots share gets the same values twice; positions without a block are dropped)."""
        put = lambda a, b, axis: a.at[(slice(None),) * axis + (slots,)].set(  # noqa: E731
            jnp.take(b, src, axis=axis), mode="drop")
        cache, last, experts = carry
        new_cache, new_last, new_experts = rows
        if table is None:
            k, v = put(cache.k, new_cache.k, 1), put(cache.v, new_cache.v, 1)
        else:
            p, blocks = jnp.arange(new_cache.k.shape[2]), cache.k.shape[2]
            tab = table.at[slots].get(mode="fill", fill_value=blocks)  # [n, width]
            where = jnp.take_along_axis(tab, jnp.broadcast_to(p // self.block, (tab.shape[0], p.size)), axis=1,
                                        mode="fill", fill_value=blocks)
            page = lambda a, b: a.at[:, :, where, p % self.block].set(  # noqa: E731  [layers, n, len, kv_heads, hd]
                jnp.moveaxis(jnp.take(b, src, axis=1), 3, 0), mode="drop")  # -> the pool's [kv_heads, layers, ..]
            k, v = page(cache.k, new_cache.k), page(cache.v, new_cache.v)
        cache = KVCache(k, v, put(cache.pos, new_cache.pos, 1))
        return self._pin(cache), put(last, new_last, 0), put(experts, new_experts, 0)

    def _extend(self, params, carry, ids, starts, lengths, table=None):
        """Rows continued with given ids (a tool's result; `ids` `[b, t]` right-padded, `lengths` `[b]`, 0 for a row
        not continued) from positions `starts` `[b]` on (after the row's tokens: a decode call runs a row that ended
        on for the call's remaining steps, so its cache's count is past them), a prefill into the running cache (no
        position recomputed): each continued row's cache holds them and its carried activations and experts are its
        last id's; the other rows write nothing (their positions put past the cache: every write dropped) and keep
        theirs."""
        cache, last, experts = carry
        b, on = ids.shape[0], lengths > 0
        pos = cache.pos  # [layers, b]
        past = jnp.where(on[None], starts[None], jnp.iinfo(jnp.int32).max // 2)
        with self._scope():
            x, new, routed = self._run(params, ids, cache._replace(pos=past), table)
        at = jnp.maximum(lengths - 1, 0)
        last = jnp.where(on[:, None], x[jnp.arange(b), at].astype(last.dtype), last)
        routed = jnp.swapaxes(routed, 0, 1)[jnp.arange(b), :, at]  # [b, layers, k]
        experts = jnp.where(on[:, None, None], routed, experts)
        return self._pin(KVCache(new.k, new.v, jnp.where(on[None], starts + lengths, pos))), last, experts

    def _decode(self, params, carry, rows: dict, sampling: Sampling, steps: int, mode: str):
        """Up to `steps` tokens for every slot, in one compiled loop that stops once every row is done or, when
        requests wait for a slot (`rows["wait"]`), once a row finishes. `carry` = (cache, the last activations
        `[b, embed]` whose head gives each row's next token, the experts behind them `[b, layers, k]`); `rows`: {seed,
        stream, index (tokens made so far), max_new, done, stop_ids `[b, m]` (-1 = none)}, each `[b]` int32/bool,
        `wait` (a bool), `limit` (steps this call may take: a paged cache's reserved blocks) and, paged, `table`
        (`paged.Blocks.local`). -> (carry,
        per step `[steps, b]`: token, its log-prob under the sampling distribution and under the model, the experts
        that chose it `[steps, b, layers, k]`, and whether the row was already done before it (a token to drop; every
        step the loop did not reach is)). `mode` (static): `greedy` (every row), `plain` (no row filters: nothing
        sorted) or `filtered` (`sampling.sample`)."""
        fwd, b, greedy = self.fwd, rows["done"].shape[0], mode == "greedy"
        bufs = (jnp.zeros((steps, b), jnp.int32), jnp.zeros((steps, b), jnp.float32),
                jnp.zeros((steps, b), jnp.float32), jnp.zeros((steps,) + carry[2].shape, jnp.int32),
                jnp.ones((steps, b), bool))

        def step(state):  # every token from the carried activations' head, one way for greedy (whatever the call)
            i, (cache, last, experts), index, done, bufs = state
            if greedy:
                tok, lp_sampled = self._greedy(params, last, wb)
                lp_model = lp_sampled
            else:
                keys = row_keys(rows["seed"], rows["stream"], index)
                logits = fwd.logits(params, last[:, None])[:, 0]
                tok, lp_sampled, lp_model = sample(logits, keys, sampling, False, mode == "filtered")
            ends = jnp.any(tok[:, None] == rows["stop_ids"], -1) | (index + 1 >= rows["max_new"])
            x, cache, new_experts = self._run(params, tok[:, None], cache, rows.get("table"))
            bufs = tuple(buf.at[i].set(v) for buf, v in zip(bufs, (tok, lp_sampled, lp_model, experts, done)))
            carry = (cache, x[:, 0].astype(last.dtype), jnp.swapaxes(new_experts[:, :, 0], 0, 1))
            return i + 1, carry, index + (~done).astype(jnp.int32), done | ends, bufs

        def going(state):
            i, _, _, done, _ = state
            return (i < rows["limit"]) & ~jnp.all(done) & ~(rows["wait"] & jnp.any(done & ~rows["done"]))

        with self._scope():
            wb = self._vocab_blocks(params, -(-b // self.row_split())) if greedy else None  # (once a call)
            _, carry, _, _, out = jax.lax.while_loop(going, step, (0, carry, rows["index"], rows["done"], bufs))
        return (self._pin(carry[0]), *carry[1:]), out

    def _vocab_blocks(self, params, rows: int):
        """The unembedding in vocabulary blocks (`sampling.vocab_blocks`) for a device's `rows` rows, over its
        split on this mesh."""
        w = self.fwd.unembedding(params)[0]
        vocab = spec(("vocab",), self.rules)[0]
        parts = 1 if self.mesh is None else math.prod(dict(self.mesh.shape)[a] for a in mesh_axes(vocab))
        return vocab_blocks(w, parts if w.shape[1] % parts == 0 else 1, rows)

    def _greedy(self, params, x, wb):
        """x `[b, embed]` -> (the greedy next token, its log-prob) by `sampling.greedy_head`."""
        return greedy_head(self.fwd.final_norm(params, x), wb, self.fwd.unembedding(params)[1], self.cfg.vocab_real)

    def _pin(self, cache: KVCache) -> KVCache:
        """`cache` constrained to its sharding (rows over data x expert, KV heads over tensor)."""
        sharding = (self.pool_sharding(cache.k.shape[2]) if self.block else
                    self.cache_sharding(cache.k.shape[1], cache.k.shape[2]))
        if sharding is None:
            return cache
        return cache._replace(k=jax.lax.with_sharding_constraint(cache.k, sharding),
                              v=jax.lax.with_sharding_constraint(cache.v, sharding))

    def _score(self, params, tokens):
        """The training forward's log-probability of each next token: tokens `[b, t]` -> `[b, t - 1]` float32
        (`Forward.token_logps`; right padding changes nothing before it)."""
        fwd = self.fwd
        with self._scope():
            x = fwd.embed(params, tokens)
            x = fwd.layers(gpt.split_params(params)[1], x, prepare=self.prepare)
            return fwd.token_logps(params, x[:, :-1], tokens[:, 1:])


_jit_empty = jax.jit(Decoder._empty, static_argnums=(0, 1, 2, 3))
_jit_prefill = jax.jit(Decoder._prefill, static_argnums=(0, 4))
_jit_insert = jax.jit(Decoder._insert, static_argnums=(0,), donate_argnums=(1,))
_jit_decode = jax.jit(Decoder._decode, static_argnums=(0, 5, 6), donate_argnums=(2,))
_jit_score = jax.jit(Decoder._score, static_argnums=(0,))
_jit_extend = jax.jit(Decoder._extend, static_argnums=(0,), donate_argnums=(2,))


@functools.cache
def bucket(n: int, least: int = 16) -> int:
    """The padded size of a prompt group's length or row count: the next power of two, at least `least` (few
    compilations)."""
    return max(least, 1 << max(0, n - 1).bit_length())
