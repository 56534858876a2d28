"""The host side of a paged KV cache: which blocks of the pool each slot's positions live in.

The pool (`cache.empty_pool`) holds `blocks` blocks of `block` positions, every layer's keys and values; a slot's
block table row lists its blocks in position order (an entry equal to `blocks`: none, its writes dropped). Blocks are
reserved as a row's positions grow and given back when it ends, so the memory follows the tokens in use, not
slots x context. The samples of one prompt admitted together share its full blocks (a reference count each); the
block its prompt ends in, and every block after, is each row's own.

With the rows split over devices (data x expert), the pool's blocks are split the same way and a slot takes blocks
only from its shard's part. What does not fit waits: a request is admitted when its prompt's blocks are free with a
block to spare for each running row of its shard, and when a running row cannot get its next block the engine gives
back the latest admitted row's blocks and queues it again (it recomputes the same tokens: a request's draws depend
on its seed, stream and token index only).
"""
from __future__ import annotations

import numpy as np


def blocks_for(positions: int, block: int) -> int:
    return -(-positions // block)


class Blocks:
    """The block tables of `slots` rows of `width` blocks over a pool of `blocks` blocks of `block` positions, split
    into `split` equal parts (one per shard of the rows); `tight`: smaller than every slot's whole context."""

    def __init__(self, blocks: int, block: int, slots: int, width: int, split: int = 1, tight: bool = False):
        self.blocks, self.block, self.split = blocks, block, split
        self.table = np.full((slots, width), blocks, np.int32)
        per = blocks // split
        self.free = [list(range((s + 1) * per - 1, s * per - 1, -1)) for s in range(split)]  # popped from the end
        self.refs = np.zeros(blocks, np.int32)
        self.held = np.zeros(slots, np.int32)  # table entries in use per slot
        self.rows_per_shard = slots // split
        self.peak = 0
        self.tight = tight  # a pool smaller than every slot's whole context (the engine keeps headroom)

    def shard(self, slot: int) -> int:
        return slot // self.rows_per_shard

    def spare(self, slot: int) -> int:
        """Free blocks in `slot`'s shard."""
        return len(self.free[self.shard(slot)])

    def need(self, slot: int, positions: int) -> int:
        """Blocks `slot` lacks to hold `positions` positions."""
        return max(0, blocks_for(positions, self.block) - int(self.held[slot]))

    def grow(self, slot: int, positions: int) -> None:
        """Reserve `slot`'s blocks up to `positions` positions (the caller checked `need` against `spare`)."""
        free = self.free[self.shard(slot)]
        for j in range(int(self.held[slot]), blocks_for(positions, self.block)):
            b = free.pop()
            self.table[slot, j], self.refs[b] = b, 1
        self.held[slot] = max(int(self.held[slot]), blocks_for(positions, self.block))
        self.peak = max(self.peak, self.in_use())

    def share(self, slot: int, owner: int, positions: int) -> None:
        """`slot` reads the full blocks of `owner`'s first `positions` positions (the same prompt), then its own."""
        full = positions // self.block
        self.table[slot, :full] = self.table[owner, :full]
        self.refs[self.table[owner, :full]] += 1
        self.held[slot] = full
        self.grow(slot, positions)

    def release(self, slot: int) -> None:
        """Give `slot`'s blocks back (a shared one once no row reads it)."""
        for b in self.table[slot, :int(self.held[slot])]:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free[self.shard(slot)].append(int(b))
        self.table[slot], self.held[slot] = self.blocks, 0

    def local(self) -> np.ndarray:
        """The tables as the device reads them: `[split, slots / split, width]`, each shard's blocks numbered within
        its part of the pool (none: the part's size)."""
        per = self.blocks // self.split
        shard = (np.arange(self.table.shape[0]) // self.rows_per_shard)[:, None]
        out = np.where(self.table < self.blocks, self.table - shard * per, per).astype(np.int32)
        return out.reshape(self.split, self.rows_per_shard, -1)

    def in_use(self) -> int:
        return self.blocks - sum(map(len, self.free))


def steps_that_fit(pages: Blocks, rows, chunk: int) -> tuple[int, set]:
    """The most decode steps (<= `chunk`) every running row can take in the blocks its shard has free: rows
    (slot, positions filled, positions at its end) -> (steps, the shards short of a block for even one step)."""
    def short(n: int) -> set:
        need = {}
        for s, pos, end in rows:
            need[pages.shard(s)] = need.get(pages.shard(s), 0) + pages.need(s, min(pos + n, end))
        return {sh for sh, k in need.items() if k > len(pages.free[sh])}

    lo, hi = 0, chunk  # the largest n with nothing short
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if not short(mid) else (lo, mid - 1)
    return lo, (short(1) if lo == 0 else set())
