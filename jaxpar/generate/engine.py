"""The generation engine: batched decoding with the training code, on the training mesh.

Public API (what `python -m jaxpar.generate`, `sample.py`, evaluation and RL call):

    engine = Engine(fwd, params)                                  # one device, or wherever `params` are
    engine = Engine.on_steps(steps, params, config)               # the training layout of `compiled.steps_for`
    completions = engine.generate([Request(prompt=[ids...], max_new_tokens=64, temperature=0.7, seed=1), ...])
    completions[0].tokens, .logprobs, .model_logprobs, .finish_reason, .experts, .text
    engine.score([[ids...], ...])                                 # log p(token | before) of given sequences

A request is a prompt of token ids with its own sampling settings (`sampling.py`: greedy, temperature, top-k, top-p,
min-p), seed and stream (its key for token i is fold_in(fold_in(key(seed), stream), i), so its output depends on
neither its batch nor the layout), stops (token ids: the chat template's end of turn; strings, with a tokenizer) and
`max_new_tokens` (at most the model's context + 1 - the prompt's length: the last token is sampled from the logits of
the context's last position and needs no position of its own, so prompt + completion fill a training row of
`max_positions` + 1 tokens). The engine holds `slots` rows; prompts are prefilled into free slots as rows finish (continuous
batching; `refill=False` waits for the whole batch), then every slot decodes in one compiled loop of at most `chunk`
tokens, which returns once every row is done or, while requests wait for a slot, once a row finishes.

A completion holds its tokens (a stop id included), each token's log-prob under the sampling distribution (a greedy
row's: the model's, as vLLM and transformers report it) and under the model at temperature 1 (the training forward's, `score`), why it ended (`stop` | `length`),
for a mixture of experts the experts that chose each token (`[tokens, layers, k]`: the routing of the position whose
logits sampled it, -1 in dense layers) and, asked for (`Engine(prompt_experts=True)`), those of the prompt's
positions before its last (`prompt_experts`: with `experts`, the routing of every position a forward pass over
prompt + completion runs, what GRPO's training pass replays), and its text (with a tokenizer; cut before a stop
string, without a stop id).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np

from jaxpar import model as gpt
from jaxpar.config import step_rules
from jaxpar.config_keys import DEFAULT_RULES
from jaxpar.cluster import exchange
from jaxpar.generate import cache as kv, paged
from jaxpar.generate.decode import Decoder, bucket
from jaxpar.generate.requests import Completion, Request, Row, cache_length, check  # noqa: F401 (the API)
from jaxpar.generate.sampling import Sampling


class Engine:
    """See the module docstring. `mesh`, `rules`, `zero3`, `layer_order`: the training layout the params are in
    (None: one device); `slots`: rows decoded together; `chunk`: tokens per compiled decode call at most; `prompt_experts`:
    a mixture of experts' completions also carry their prompt positions' experts (fetched from each prefill: GRPO's
    routing replay asks for them, nothing else pays for them); `share_prefill`: the requests admitted together that
    share a prompt prefill it once (False: a prefill row each; the outputs are the same); `prefill_chunk`: prompts
    longer than this prefill that many positions at a time (`decode.Decoder`); `kv_block` > 0: the KV cache is paged in
    blocks of that many positions (`paged.py`), `kv_memory` bytes of them on each device (default: as many as the
    dense cache of every slot's whole context), else (0) each slot holds a dense row of the whole context;
    `gather_zero3`: ZeRO-3 params gathered whole once here (`cache.decode_params`), else each layer at every step."""

    def __init__(self, fwd: gpt.Forward, params, *, mesh=None, rules=DEFAULT_RULES, zero3: bool = False,
                 layer_order=None, tokenizer=None, slots: int = 8, chunk: int = 128, refill: bool = True,
                 prompt_experts: bool = False, share_prefill: bool = True, prefill_chunk: int = 512,
                 kv_block: int = 16, kv_memory: int | None = None, gather_zero3: bool = True):
        self.fwd, self.cfg, self.tokenizer = fwd, fwd.cfg, tokenizer
        self.prompt_experts = prompt_experts and fwd.cfg.experts > 0
        self.mesh, self.slots, self.chunk, self.refill = mesh, slots, chunk, refill
        self.share_prefill = share_prefill
        self._turns = None  # `generate`'s `turns`
        self.stats = {"prefill_calls": 0, "decode_calls": 0, "prefill_tokens": 0}  # of the last `generate`
        if prefill_chunk < 16 or prefill_chunk & (prefill_chunk - 1):
            raise ValueError(f"prefill_chunk={prefill_chunk}: give a power of two >= 16.")
        if kv_block < 0 or (kv_memory is not None and kv_block == 0):
            raise ValueError(f"kv_block={kv_block}, kv_memory={kv_memory}: a paged cache needs kv_block >= 1.")
        self.kv_block, self.kv_memory, self.rules = kv_block, kv_memory, rules
        self.decoder = Decoder(fwd, mesh, rules, zero3 and not gather_zero3, prefill_chunk, kv_block)
        self.params = params if mesh is None else kv.decode_params(params, fwd.cfg, rules, mesh, zero3, layer_order,
                                                                   gather_zero3)

    @classmethod
    def on_steps(cls, steps, params, config, **kw) -> "Engine":
        """An engine on `steps`' mesh (`compiled.steps_for`) over `params` in its state shardings and layer order,
        with the run's own `model.attention` (a step whose rows share prefixes trains with XLA's under `auto`,
        `train.step.model_config`; decoding takes what `auto` takes)."""
        fwd = steps.fwd
        if fwd.cfg.attention != str(config.model.attention):
            fwd = gpt.Forward(dataclasses.replace(fwd.cfg, attention=str(config.model.attention)))
        return cls(fwd, params, mesh=steps.mesh, rules=step_rules(config),
                   zero3=steps.layout.zero_stage == 3, layer_order=steps.layer_order, **kw)

    @classmethod
    def of_source(cls, src, **kw) -> "Engine":
        """An engine over a loaded SRC (`source.load`): on its steps' mesh when it has them, else on one device."""
        if src.steps is not None:
            return cls.on_steps(src.steps, src.params, src.config, tokenizer=src.tokenizer, **kw)
        return cls(src.fwd, src.params, tokenizer=src.tokenizer, **kw)

    # ---- generation --------------------------------------------------------------------------------------------

    def generate(self, requests: Sequence[Request], progress: Callable[[int], None] | None = None,
                 turns: Callable[[int, list], Sequence[int] | None] | None = None) -> list:
        """Completions of `requests`, in their order. `progress(n)` hears of every n new tokens. `turns(i, tokens)`
        is asked when request i's row stops on a stop id (a turn's end: a tool call); the ids it gives (a tool's
        result, the next turn's header) continue the row in its slot, prefilled after its tokens (`Decoder.extend`:
        no token recomputed, none re-encoded), and the row samples on. They count in its `max_new_tokens`: ids that
        would pass it end the row without them, as TRL rolls a tool's result back; a completion then carries
        `tool_mask` (0 on given ids, whose log-probs are 0)."""
        self._turns = turns
        context = self.cfg.max_positions
        for i, r in enumerate(requests):
            check(r, f"request {i}", context, self.tokenizer)
        if not requests:
            return []
        news = [min(r.max_new_tokens, context + 1 - len(r.prompt)) for r in requests]  # (module docstring)
        length = cache_length(max(len(r.prompt) + n for r, n in zip(requests, news)), context)
        mode = "greedy" if all(r.temperature == 0 for r in requests) else "filtered" if any(
            r.temperature > 0 and (0 < r.top_k < self.cfg.vocab_size or r.top_p < 1 or r.min_p > 0)
            for r in requests) else "plain"  # (`sampling.filters_on`: what the compiled step must hold)
        stops = max(1, max(len(r.stop_ids) for r in requests))
        B = self.slots
        self._split_kv(max(len(r.prompt) + n - 1 for r, n in zip(requests, news)))
        pages = self._pages(requests, news, length)
        carry = self.decoder.empty(B, length, pages.blocks if pages else 0)
        rows = {"seed": np.zeros(B, np.int32), "stream": np.zeros(B, np.int32), "index": np.zeros(B, np.int32),
                "max_new": np.ones(B, np.int32), "done": np.ones(B, bool),
                "stop_ids": np.full((B, stops), -1, np.int32)}
        knobs = {"temperature": np.zeros(B, np.float32), "top_k": np.zeros(B, np.int32),
                 "top_p": np.ones(B, np.float32), "min_p": np.zeros(B, np.float32)}
        self.stats = {"prefill_calls": 0, "decode_calls": 0, "prefill_tokens": 0}  # of the last `generate`
        if pages is not None:
            self.stats.update(kv_blocks=pages.blocks, kv_peak_blocks=0, preempted=0)
        slot: list[Row | None] = [None] * B
        queue, out = collections.deque(range(len(requests))), [None] * len(requests)
        admitted = 0
        while queue or any(slot):
            free = [s for s in range(B) if slot[s] is None]
            if queue and free and (self.refill or len(free) == B):
                placed = self._place(queue, free, requests, pages, slot)
                for i, s in placed:
                    slot[s], admitted = Row(i, requests[i], news[i], admitted), admitted + 1
                    self._arm(rows, knobs, s, requests[i], news[i])
                if placed:
                    carry, routed = self._admit(carry, [requests[i].prompt for i, _ in placed],
                                                [s for _, s in placed], length, pages)
                    for j, (_, s) in enumerate(placed if routed is not None else ()):
                        slot[s].prompt_experts = routed[j, :len(slot[s].req.prompt) - 1].copy()
                    self.stats["prefill_calls"] += 1
            rows["limit"] = np.asarray(self.chunk if pages is None else self._reserve(pages, slot, queue, rows))
            if pages is not None:
                rows["table"] = pages.local()
            if not any(slot):
                continue
            self.stats["decode_calls"] += 1
            rows["wait"] = np.asarray(bool(queue) and self.refill)  # (a finished row then ends the call: refill)
            carry, got = self.decoder.decode(self.params, carry, {k: jnp.asarray(v) for k, v in rows.items()},
                                             Sampling(**{k: jnp.asarray(v) for k, v in knobs.items()}),
                                             self.chunk, mode)
            made = self._collect(exchange.fetch(got), slot, rows, out, pages)
            carry = self._continue(carry, slot, rows, queue, pages)
            if progress is not None:
                progress(made)
        if pages is not None:
            self.stats["kv_peak_blocks"] = pages.peak
        return out

    # ---- the paged cache's blocks ------------------------------------------------------------------------------

    def _split_kv(self, positions: int) -> None:
        """The decoder of this call's layout: each row's KV split over `context` when a row of `positions` positions
        does not fit its device's part of the pool with the rows split over context (`cache.kv_over_context`)."""
        sizes = dict(self.mesh.shape) if self.mesh is not None else {}
        split = kv.kv_over_context(self.cfg, self.kv_block, self.kv_memory, self.slots, positions, sizes, self.rules)
        if split and self.kv_block % sizes["context"]:
            raise ValueError(f"kv_block={self.kv_block} with mesh.context={sizes['context']}: a row of {positions} "
                             f"positions splits its KV blocks' positions over the context devices; give a multiple "
                             f"of {sizes['context']}.")
        if split != self.decoder.kv_context:
            d = self.decoder
            self.decoder = Decoder(self.fwd, self.mesh, self.rules, d.zero3, d.prefill_chunk, d.block, split)

    def _pages(self, requests, news, length: int):
        """The block tables of a paged cache for this call (None: dense): `kv_memory` bytes of blocks, split as the
        rows are; a request whose prompt + completion cannot fit one shard's part is one line."""
        if not self.kv_block:
            return None
        block, B = self.kv_block, self.slots
        sizes = dict(self.mesh.shape) if self.mesh is not None else {}
        blocks, split = kv.pool_blocks(self.cfg, block, self.kv_memory, B, length, sizes, self.decoder.rules)
        width, one = paged.blocks_for(length, block), kv.pool_bytes(self.cfg, split, block, sizes,
                                                                   self.decoder.rules)["per_device"]
        for i, (r, n) in enumerate(zip(requests, news)):
            need = paged.blocks_for(len(r.prompt) + n - 1, block)
            if need > blocks // split:
                raise ValueError(
                    f"request {i}: a prompt of {len(r.prompt)} + {n} new tokens needs {need} KV blocks of {block} "
                    f"positions; a pool of {self.kv_memory:,} bytes a device holds {blocks // split} (give it at "
                    f"least {need * one:,} bytes: --kv_cache_gib / grpo.kv_cache_gib {need * one / 2 ** 30:.3g}).")
        return paged.Blocks(blocks, block, B, width, split, tight=blocks < B * width)

    def _place(self, queue, free, requests, pages, slot) -> list:
        """Take requests off `queue` into `free` slots, in order: [(request, slot)]; paged, while their prompts'
        blocks fit (a prompt sampled again in the same shard shares the first one's full blocks)."""
        if pages is None:
            return [(queue.popleft(), s) for s in free[:len(queue)]]
        placed, owner = [], {}
        running = collections.Counter(pages.shard(s) for s, r in enumerate(slot) if r is not None)
        for s in free:
            if not queue:
                break
            p = requests[queue[0]].prompt
            key, sh = (tuple(p), pages.shard(s)), pages.shard(s)
            mine = key in owner and self.share_prefill
            need = paged.blocks_for(len(p), pages.block) - (len(p) // pages.block if mine else 0)
            if pages.spare(s) < need + (running[sh] if pages.tight else 0):
                break
            pages.share(s, owner[key], len(p)) if mine else pages.grow(s, len(p))
            owner.setdefault(key, s)
            running[sh] += 1
            placed.append((queue.popleft(), s))
        return placed

    def _reserve(self, pages, slot, queue, rows) -> int:
        """Reserve the blocks of the steps the next decode call takes -> those steps; a shard short of a block for
        even one step gives back its latest admitted row (queued again: it recomputes the same tokens)."""
        while any(slot):
            running = [(s, len(r.req.prompt) + len(r.tokens), len(r.req.prompt) + r.max_new - 1)
                       for s, r in enumerate(slot) if r is not None]  # (the last token's own keys are never read)
            steps, short = paged.steps_that_fit(pages, running, self.chunk)
            if steps:
                for s, pos, end in running:
                    pages.grow(s, min(pos + steps, end))
                return steps
            victim = max((r.admitted, s) for s, r in enumerate(slot) if r is not None and pages.shard(s) in short)[1]
            self._give_back(victim, slot, rows, queue, pages)
        return 0

    def _give_back(self, s: int, slot, rows, queue, pages) -> None:
        """Preempt slot `s`: its blocks back to the pool, its request first in the queue (recomputed from its prompt:
        the same tokens)."""
        queue.appendleft(slot[s].i)
        pages.release(s)
        slot[s], rows["done"][s] = None, True
        self.stats["preempted"] += 1

    @staticmethod
    def _arm(rows, knobs, s: int, r: Request, max_new: int) -> None:
        rows["seed"][s], rows["stream"][s], rows["index"][s] = r.seed, r.stream, 0
        rows["max_new"][s], rows["done"][s] = max_new, False
        rows["stop_ids"][s] = -1
        rows["stop_ids"][s, :len(r.stop_ids)] = list(r.stop_ids)
        knobs["temperature"][s], knobs["top_k"][s] = r.temperature, r.top_k
        knobs["top_p"][s], knobs["min_p"][s] = r.top_p, r.min_p

    def _admit(self, carry, prompts, slots, length: int, pages=None):
        """Prefill `prompts` into `slots`, each distinct prompt once (the G samples of a GRPO group, `--n` samples of a
        record: one prefill, its cache rows copied into each slot), the distinct ones a group padded to a power of two
        rows and positions. -> (carry, the experts of each prompt's positions `[len(prompts), t, layers, k]` on the
        host with `prompt_experts`, else None)."""
        first, uniq = {}, []  # {prompt (or request, unshared): its prefill row}, those rows' prompts
        for j, p in enumerate(prompts):
            if first.setdefault(tuple(p) if self.share_prefill else j, len(uniq)) == len(uniq):
                uniq.append(list(p))
        src = np.asarray([first[tuple(p) if self.share_prefill else j] for j, p in enumerate(prompts)], np.int32)
        split = self.decoder.row_split()  # (rows that the batch's shards divide: as the slots, when they can)
        n = -(-bucket(len(uniq), 1) // split) * split if self.slots % split == 0 else bucket(len(uniq), 1)
        n = min(n, max(self.slots, len(uniq)))
        t = min(bucket(max(len(p) for p in uniq)), length)
        tokens = np.zeros((n, t), np.int32)
        lengths = np.ones(n, np.int32)
        for j, p in enumerate(uniq):
            tokens[j, :len(p)], lengths[j] = p, len(p)
        m = min(bucket(len(prompts), 1), max(self.slots, len(prompts)))
        where = np.full(m, self.slots, np.int32)  # past the batch: dropped
        where[:len(slots)] = slots
        take = np.zeros(m, np.int32)
        take[:len(src)] = src
        last, cache, experts, every = self.decoder.prefill(self.params, jnp.asarray(tokens), jnp.asarray(lengths),
                                                           length if pages is None else t)
        self.stats["prefill_tokens"] += sum(map(len, uniq))
        routed = np.asarray(exchange.fetch(every))[src] if self.prompt_experts else None
        table = None if pages is None else jnp.asarray(pages.table)  # (the pool's numbers: one scatter a group)
        return self.decoder.insert(carry, (cache, last, experts), jnp.asarray(where), jnp.asarray(take),
                                   table), routed

    def _collect(self, got, slot, rows, out, pages=None) -> int:
        """Take a decode call's tokens into the rows; finish rows (stop id, stop string, length). -> tokens taken."""
        toks, lps, lpm, experts, before = got
        made = 0
        for s, row in enumerate(slot):
            if row is None:
                continue
            for j in range(toks.shape[0]):
                if before[j, s] or row.finish:
                    break
                tok = int(toks[j, s])
                row.take(tok, float(lps[j, s]), float(lpm[j, s]), experts[j, s])
                made += 1
                if tok in row.req.stop_ids or self._stop_string(row):
                    row.finish = "stop"
                elif len(row.tokens) >= row.max_new:
                    row.finish = "length"
            if row.finish == "stop" and self._turns is not None and row.tokens[-1] in row.req.stop_ids:
                self._turn(row)
            rows["index"][s] = len(row.tokens)
            if row.finish:
                out[row.i] = self._completion(row)
                slot[s], rows["done"][s] = None, True
                if pages is not None:
                    pages.release(s)
        return made

    def _stop_string(self, row: Row) -> bool:
        if not row.req.stop:
            return False
        text = self.tokenizer.decode(row.tokens[max(row.turn_end, len(row.tokens) - 32):])  # (within the last tokens
        # since the last turn's ids)
        return any(s in text for s in row.req.stop)

    def _completion(self, row: Row) -> Completion:
        experts = np.stack(row.experts) if self.cfg.experts else None
        text = None
        if self.tokenizer is not None:
            ids = row.tokens[:-1] if row.tokens[-1] in row.req.stop_ids else row.tokens
            text = self.tokenizer.decode(ids)
            cut = [text.find(s) for s in row.req.stop if s in text]
            text = text[:min(cut)] if cut else text
        return Completion(row.tokens, row.lps, row.lpm, row.finish, experts, text, row.prompt_experts,
                          row.sampled if self._turns is not None else None)

    # ---- turns: a row continued with given ids -----------------------------------------------------------------

    def _turn(self, row: Row) -> None:
        """Ask `turns` for the ids that continue `row` (stopped on a stop id); with room for them, keep it running
        with them pending (`row.pending`). Room as TRL counts it: the completion with them within its budget, and
        prompt + completion with them short of the model's context (`max_model_len`)."""
        got = self._turns(row.i, list(row.tokens))
        ids = [] if got is None else [int(i) for i in got]
        room = min(row.max_new - len(row.tokens), self.cfg.max_positions - 1 - len(row.req.prompt) - len(row.tokens))
        if not ids or len(ids) > room:
            return  # (no turn, or no room: the row ends as it is, TRL's rollback)
        row.give(ids)
        row.finish, row.pending = ("length" if len(row.tokens) == row.max_new else None), ids

    def _continue(self, carry, slot, rows, queue, pages):
        """Prefill the pending ids of the rows `_turn` continued into their slots (one `Decoder.extend` call); a
        paged row short of blocks for them is given back and queued again (it recomputes from its prompt, and
        `turns` is asked again for its turns: tools with side effects run twice; a pool the round fits avoids it)."""
        todo = [s for s, r in enumerate(slot) if r is not None and r.pending]
        for s in todo:
            end = len(slot[s].req.prompt) + len(slot[s].tokens)
            if pages is not None and pages.spare(s) < pages.need(s, end):
                self._give_back(s, slot, rows, queue, pages)
            elif pages is not None:
                pages.grow(s, end)
        todo = [s for s in todo if slot[s] is not None]
        if not todo:
            return carry
        ids = np.zeros((self.slots, bucket(max(len(slot[s].pending) for s in todo))), np.int32)
        lengths, starts = np.zeros(self.slots, np.int32), np.zeros(self.slots, np.int32)
        for s in todo:
            ids[s, :len(slot[s].pending)], lengths[s] = slot[s].pending, len(slot[s].pending)
            starts[s] = len(slot[s].req.prompt) + len(slot[s].tokens) - lengths[s]
            self.stats["prefill_tokens"] += len(slot[s].pending)
            slot[s].pending = None
        return self.decoder.extend(self.params, carry, jnp.asarray(ids), jnp.asarray(starts), jnp.asarray(lengths),
                                   None if pages is None else jnp.asarray(pages.local()))

    # ---- scoring -----------------------------------------------------------------------------------------------

    def score(self, sequences: Sequence[Sequence[int]]) -> list:
        """The training forward's log p(token_i | tokens before it) for i >= 1 of each sequence: float32 arrays of
        len - 1 (`Forward.token_logps` on the same params and layout)."""
        out = []
        for at in range(0, len(sequences), self.slots):
            group = sequences[at:at + self.slots]
            t = bucket(max(len(s) for s in group))
            tokens = np.zeros((self.slots, t), np.int32)
            for j, s in enumerate(group):
                tokens[j, :len(s)] = s
            lp = np.asarray(exchange.fetch(self.decoder.score(self.params, jnp.asarray(tokens))))
            out += [lp[j, :len(s) - 1] for j, s in enumerate(group)]
        return out
