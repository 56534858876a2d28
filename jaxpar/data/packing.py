"""Whole sequences packed into rows (`data.packing = "bfd"`): conversations are never cut between rows.

The documents of a source's split go into rows of `length` = `model.seq_len + 1` tokens best-fit decreasing (longest
first, each into the fullest row that still has room; a new row when none has; ties by document order), the rule
TRL's `packing_strategy="bfd"` and Megatron's sequence packing use. A document longer than a row is cut to the row
(`data.truncate = "right"`) or left out (`"skip"`), and counted. A row holds `tokens`, `segments` (the document of
each token, 0, 1, ... in the row, -1 for padding) and `mask` (the loss mask of each token: the records' own, all
ones for text; 0 for padding); attention stays within a segment, positions restart at each, and a segment's first
token is never predicted from the one before (the step's rule for segments). Deterministic: the same rows on every
process, layout and start.
"""
from __future__ import annotations

import numpy as np

from jaxpar.data.common import DataError
from jaxpar.data.tokens import Split


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Item indices per bin: items longest first (stable), each into the bin with the least room that fits it.

    A tree over the free room (0..capacity) finds the best bin in O(log capacity) per item."""
    size = 1
    while size < capacity + 1:
        size *= 2
    count = np.zeros(2 * size, np.int64)  # how many bins have each amount of free room, summed up the tree
    by_room: list[list[int]] = [[] for _ in range(capacity + 1)]
    bins: list[list[int]] = []

    def add(room: int, delta: int) -> None:
        i = room + size
        while i:
            count[i] += delta
            i //= 2

    def smallest_at_least(n: int) -> int | None:
        """The least room >= n that some bin has (None: no bin fits n)."""
        lo, hi = n, capacity
        stack = [(1, 0, size - 1)]
        while stack:  # the leftmost non-empty leaf in [lo, hi]
            i, a, b = stack.pop()
            if b < lo or a > hi or count[i] == 0:
                continue
            if a == b:
                return a
            mid = (a + b) // 2
            stack += [(2 * i + 1, mid + 1, b), (2 * i, a, mid)]
        return None

    for item in np.argsort(-np.asarray(lengths), kind="stable"):
        n = int(lengths[item])
        room = smallest_at_least(n)
        if room is None:
            bins.append([])
            b, room = len(bins) - 1, capacity
        else:
            b = by_room[room].pop()
            add(room, -1)
        bins[b].append(int(item))
        by_room[room - n].append(b)
        add(room - n, +1)
    return bins


class Packed:
    """The rows of one source's split, packed (see the module docstring): `num_samples` rows, `rows(indices)`."""

    def __init__(self, split: Split, length: int, truncate: str, name: str):
        stream = split.stream
        bounds = stream.doc_bounds
        first, last = np.searchsorted(bounds, [split.start, split.stop])
        starts, ends = bounds[first:last], bounds[first + 1:last + 1]
        sizes = ends - starts
        long = sizes > length
        self.truncated = int(long.sum()) if truncate == "right" else 0
        self.skipped = int(long.sum()) if truncate == "skip" else 0
        keep = ~long if truncate == "skip" else np.ones(sizes.size, bool)
        self.stream, self.length, self.name = stream, int(length), name
        self.starts, self.sizes = starts[keep], np.minimum(sizes[keep], length)
        if self.sizes.size == 0:
            raise DataError(f"source {name}: no sequence is left in its split after data.truncate={truncate!r} "
                            f"({int(long.sum())} of {sizes.size} are longer than model.seq_len + 1 = {length}); "
                            f"raise model.seq_len or use data.truncate='right'.")
        self.bins = best_fit_decreasing(self.sizes, self.length)
        self.num_samples = len(self.bins)
        self.num_tokens = int(self.sizes.sum())

    def rows(self, indices) -> dict:
        """Rows `indices` (int `[n]`): {"tokens", "segments", "mask"} int32 `[n, length]`."""
        n = len(indices)
        tokens = np.zeros((n, self.length), np.int32)
        segments = np.full((n, self.length), -1, np.int32)
        mask = np.zeros((n, self.length), np.int32)
        for r, b in enumerate(np.asarray(indices, np.int64).tolist()):
            at = 0
            for seg, d in enumerate(self.bins[b]):
                start, size = int(self.starts[d]), int(self.sizes[d])
                tokens[r, at:at + size] = self.stream.read(start, start + size)
                mask[r, at:at + size] = self.stream.read(start, start + size, masks=True)
                segments[r, at:at + size] = seg
                at += size
        return {"tokens": tokens, "segments": segments, "mask": mask}
