"""A tokenized source as one stream: Megatron `.bin/.idx` shards in order, memory-mapped, with document bounds, and
its train/val split by documents."""
from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np

from jaxpar.data.common import DataError, check_split
from jaxpar.data.megatron import IndexedDataset

_MAX_CHUNK = 1 << 24  # elements per step of the chunked max over a token file
MASK = "-mask"  # PREFIX-mask.bin/.idx beside a shard: one uint8 loss-mask value per token, the same documents
REJECTED = 2  # a preference pair's document is its chosen sequence, then its rejected one: this mask bit marks the latter


class TokenStream:
    """The documents of `prefixes` back to back. `doc_bounds` int64 `[documents + 1]`: token offsets of each
    document's start in the stream (the last = the stream's length). `masks`: each shard's loss mask (records of
    conversations), or None."""

    def __init__(self, prefixes, name: str):
        self.name, self.prefixes = name, [str(p) for p in prefixes]
        self.parts = [IndexedDataset(p) for p in self.prefixes]
        has = [os.path.isfile(p + MASK + ".idx") for p in self.prefixes]
        self.masks = [IndexedDataset(p + MASK) for p in self.prefixes] if all(has) and has else None
        sizes = np.asarray([p.num_tokens for p in self.parts], np.int64)
        self.part_start = np.concatenate([[0], np.cumsum(sizes)])
        self.part_docs = np.concatenate([[0], np.cumsum([p.num_docs for p in self.parts])])
        self.num_tokens = int(self.part_start[-1])
        self.num_docs = int(self.part_docs[-1])
        self._checked: set = set()  # vocab sizes check_ids has passed

    @functools.cached_property
    def doc_bounds(self) -> np.ndarray:
        """int64 `[documents + 1]` (built on first use, for packing: 8 bytes per document in memory, as
        Megatron's document index)."""
        return np.concatenate([[0]] + [p.doc_bounds[1:] + s for p, s in zip(self.parts, self.part_start)])

    def doc_start(self, d: int) -> int:
        """Token offset of document d (d = num_docs: the end), without building `doc_bounds`."""
        if d >= self.num_docs:
            return self.num_tokens
        i = int(np.searchsorted(self.part_docs, d, "right")) - 1
        return int(self.part_start[i]) + self.parts[i].doc_start(d - int(self.part_docs[i]))

    def read(self, start: int, stop: int, masks: bool = False) -> np.ndarray:
        """Tokens [start, stop) of the stream (across shards): int32 `[stop - start]` (`masks`: their loss mask;
        ones when the stream has none)."""
        if masks and self.masks is None:
            return np.ones(stop - start, np.int32)
        parts = self.masks if masks else self.parts
        i = int(np.searchsorted(self.part_start, start, "right")) - 1
        out = []
        while start < stop:
            a = start - self.part_start[i]
            b = min(stop, self.part_start[i + 1]) - self.part_start[i]
            out.append(np.asarray(parts[i].tokens[a:b], np.int32))
            start, i = self.part_start[i] + b, i + 1
        return out[0] if len(out) == 1 else np.concatenate(out)

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Tokens [s, s + length) for each s of `starts` (int64 `[n]`): int32 `[n, length]`; one gather per shard."""
        starts = np.asarray(starts, np.int64)
        out = np.empty((starts.size, length), np.int32)
        part = np.searchsorted(self.part_start, starts, "right") - 1
        offsets = np.arange(length, dtype=np.int64)
        for i in np.unique(part):
            rows = np.nonzero(part == i)[0]
            lo = starts[rows] - self.part_start[i]
            inside = lo + length <= self.parts[i].num_tokens
            out[rows[inside]] = self.parts[i].tokens[lo[inside, None] + offsets]
            for r in rows[~inside]:  # a window across a shard boundary
                out[r] = self.read(int(starts[r]), int(starts[r]) + length)
        return out

    def segments(self, starts: np.ndarray, length: int) -> np.ndarray:
        """For each window [s, s + length): the document of each token, counted from the window's first: int32
        `[n, length]` (a cumulative count of the document starts inside the window)."""
        starts = np.asarray(starts, np.int64)
        first = np.searchsorted(self.doc_bounds, starts, "right") - 1
        count = np.searchsorted(self.doc_bounds, starts + length - 1, "right") - 1 - first  # starts inside
        row = np.repeat(np.arange(starts.size), count)
        k = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)  # 0.. within each row
        marks = np.zeros((starts.size, length), np.int32)
        np.add.at(marks, (row, self.doc_bounds[np.repeat(first + 1, count) + k] - starts[row]), 1)
        return np.cumsum(marks, axis=1, dtype=np.int32)

    def check_ids(self, vocab_size: int, limit: int = 4 * _MAX_CHUNK) -> None:
        """Raises DataError naming the shard if one of the first `limit` ids of a shard is >= vocab_size (or < 0).
        (The loader checks every batch it reads as well: a full scan of a terabyte would delay every start.) Once per
        stream and vocab size: train and val share the stream."""
        if vocab_size in self._checked:
            return
        for p in self.parts:
            for i in range(0, min(p.num_tokens, limit), _MAX_CHUNK):
                block = np.asarray(p.tokens[i:i + _MAX_CHUNK])
                lo, hi = int(block.min()), int(block.max())
                if hi >= vocab_size or lo < 0:
                    raise DataError(f"{p.prefix}.bin holds id {hi if hi >= vocab_size else lo} but the vocabulary "
                                    f"has {vocab_size} ids: it was tokenized with another tokenizer. Give that "
                                    f"tokenizer (data.tokenizer), or model.vocab_size > {hi}.")
        self._checked.add(vocab_size)


@dataclasses.dataclass(frozen=True)
class Split:
    """Tokens [start, stop) of `stream`: the train or val part of one source."""
    stream: TokenStream
    start: int
    stop: int

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start


def split(stream: TokenStream, which: str, val_fraction: float, by: str = "documents") -> Split:
    """The train (first) or val (last) part of `stream`.

    by="documents": the last max(1, round(documents x val_fraction)) documents are val (none when val_fraction = 0).
    by="tokens": the last round(tokens x val_fraction) tokens (runs from before documents existed)."""
    check_split(which)
    if by == "tokens":
        cut = stream.num_tokens - int(round(stream.num_tokens * val_fraction))
    else:
        n = stream.num_docs
        n_val = 0 if val_fraction <= 0 else min(n, max(1, int(round(n * val_fraction))))
        cut = stream.doc_start(n - n_val)
    return Split(stream, 0, cut) if which == "train" else Split(stream, cut, stream.num_tokens)
