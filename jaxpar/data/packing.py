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
from jaxpar.data.tokens import REJECTED, Split


def pairs_per_row(seq_len: int) -> int:
    """The length of a row's pair axis: more preference pairs than a row of `seq_len` inputs can hold."""
    return seq_len // 2 + 1


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

    def __init__(self, split: Split, length: int, truncate: str, name: str, pairs: bool = False):
        stream = split.stream
        bounds = stream.doc_bounds
        first, last = np.searchsorted(bounds, [split.start, split.stop])
        starts, ends = bounds[first:last], bounds[first + 1:last + 1]
        sizes = ends - starts
        self.pairs = _check_pairs(stream, starts, ends, pairs, name)
        self.cuts = {}  # pairs mode: document -> (chosen kept, rejected's start, rejected kept) for the cut ones
        long = sizes > length
        self.truncated = int(long.sum()) if truncate == "right" else 0
        self.skipped = int(long.sum()) if truncate == "skip" else 0
        keep = ~long if truncate == "skip" else np.ones(sizes.size, bool)
        self.stream, self.length, self.name = stream, int(length), name
        self.starts, self.sizes = starts[keep], np.minimum(sizes[keep], length)
        if self.pairs:
            self._cut_pairs(np.flatnonzero(self.sizes < (ends - starts)[keep]), (ends - starts)[keep])
        if self.sizes.size == 0:
            raise DataError(f"source {name}: no sequence is left in its split after data.truncate={truncate!r} "
                            f"({int(long.sum())} of {sizes.size} are longer than model.seq_len + 1 = {length}); "
                            f"raise model.seq_len or use data.truncate='right'.")
        self.bins = best_fit_decreasing(self.sizes, self.length)
        self.reference = None  # DPO's precomputed reference sums, float64 [documents, 2] (`train/reference.py`)
        self.num_samples = len(self.bins)
        self.num_tokens = int(self.sizes.sum())

    def rows(self, indices) -> dict:
        """Rows `indices` (int `[n]`): {"tokens", "segments", "mask"} int32 `[n, length]`, and with a precomputed
        reference {"ref"} float64 `[n, pairs_per_row(length - 1), 2]` (pair k of a row: its k-th document)."""
        n = len(indices)
        tokens = np.zeros((n, self.length), np.int32)
        segments = np.full((n, self.length), -1, np.int32)
        mask = np.zeros((n, self.length), np.int32)
        ref = None if self.reference is None else np.zeros((n, pairs_per_row(self.length - 1), 2))
        for r, b in enumerate(np.asarray(indices, np.int64).tolist()):
            at = 0
            for seg, d in enumerate(self.bins[b]):
                for k, (start, size) in enumerate(self._pieces(d)):
                    tokens[r, at:at + size] = self.stream.read(start, start + size)
                    mask[r, at:at + size] = self.stream.read(start, start + size, masks=True) & 1
                    segments[r, at:at + size] = 2 * seg + k if self.pairs else seg
                    at += size
                if ref is not None:
                    ref[r, seg] = self.reference[d]
        return {"tokens": tokens, "segments": segments, "mask": mask} | ({} if ref is None else {"ref": ref})

    # ---- preference pairs: a pair is one document (chosen, then rejected), two segments in its row ----------------
    def _pieces(self, d: int) -> list[tuple[int, int]]:
        """(start, size) in the stream of document d's sequences: itself, or a pair's chosen and rejected."""
        start, size = int(self.starts[d]), int(self.sizes[d])
        if not self.pairs:
            return [(start, size)]
        if d in self.cuts:
            c, r0, r = self.cuts[d]
            return [(start, c), (start + r0, r)]
        split = int(np.argmax(self.stream.read(start, start + size, masks=True) & REJECTED))
        return [(start, split), (start + split, size - split)]

    def _cut_pairs(self, long, full_sizes) -> None:
        """data.truncate=right on a pair longer than a row: the chosen and the rejected sequence each cut at the
        right, the longer first, until the two fit (each keeps at least half the row when it is that long).

        Raises:
          DataError: a cut pair left with no response token in its chosen or its rejected sequence."""
        empty = []
        for d in long.tolist():
            start = int(self.starts[d])
            m = self.stream.read(start, start + int(full_sizes[d]), masks=True)
            split = int(np.argmax(m & REJECTED))
            c, r = split, m.size - split
            c_keep = min(c, max(self.length // 2, self.length - r))
            r_keep = min(r, self.length - c_keep)
            self.cuts[d] = (c_keep, split, r_keep)
            if not ((m[:c_keep] & 1).any() and (m[split:split + r_keep] & 1).any()):
                empty.append(d)
        if empty:
            raise DataError(f"source {self.name}: {len(empty)} preference pairs have no response token left in "
                            f"their chosen or rejected sequence after cutting them to model.seq_len + 1 = "
                            f"{self.length} tokens; raise model.seq_len or set data.truncate='skip' (leaves them out).")


def _check_pairs(stream, starts, ends, pairs: bool, name: str) -> bool:
    """Whether the source's documents are preference pairs, checked against what the objective needs (`pairs`) on
    its first document."""
    first = stream.masks is not None and len(starts) and \
        bool((stream.read(int(starts[0]), int(ends[0]), masks=True) & REJECTED).any())
    if pairs and not first:
        raise DataError(f"source {name} holds no preference pairs (records with `prompt`, `chosen` and `rejected`), "
                        f"which train.objective='dpo' trains on; point data.sources at such records, or train with "
                        f"train.objective='lm'.")
    if first and not pairs:
        raise DataError(f"source {name} holds preference pairs (`chosen`, `rejected`); train on them with "
                        f"--config.train.objective=dpo.")
    return pairs
