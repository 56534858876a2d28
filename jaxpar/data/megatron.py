"""Megatron's indexed dataset (`PREFIX.bin` + `PREFIX.idx`, "MMIDIDX" version 1), read memory-mapped and written.

The layout (Megatron-LM `megatron/core/datasets/indexed_dataset.py`, re-expressed from the format, not its code):

    .idx: b"MMIDIDX\\x00\\x00" | version <Q = 1 | dtype code <B | sequence count S <Q | document count D + 1 <Q |
          sequence lengths int32 [S] | sequence byte offsets into .bin int64 [S] | document indices int64 [D + 1]
    .bin: the token ids of every sequence back to back, in the dtype of the code

Document d is sequences `[doc_idx[d], doc_idx[d + 1])`; `doc_idx[0] = 0`, `doc_idx[-1] = S`. jaxpar writes one
sequence per document (as Megatron's `preprocess_data.py` does without sentence splitting) and reads any grouping.
"""
from __future__ import annotations

import array
import functools
import mmap
import os
import struct
from pathlib import Path

import numpy as np

from jaxpar.data.common import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
CODES = {np.dtype(v): k for k, v in DTYPES.items()}
_HEADER = len(MAGIC) + 8 + 1 + 8 + 8


def best_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else int32 (Megatron's choice for large vocabularies)."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.int32)


class IndexedDataset:
    """A Megatron `.bin/.idx` pair, memory-mapped. `doc_bounds` int64 `[documents + 1]`: token offsets into `tokens`
    (`tokens[doc_bounds[d]:doc_bounds[d + 1]]` is document d).

    Raises (on open):
      DataError: a missing file, a foreign or unknown-version `.idx`, a non-integer dtype, an `.idx` whose size or
        counts disagree with itself, sequences that are not back to back, or a `.bin` shorter or longer than the
        `.idx` says (truncated / another dataset's).
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = str(prefix)
        idx, bin_ = f"{self.prefix}.idx", f"{self.prefix}.bin"
        for p in (idx, bin_):
            if not os.path.isfile(p):
                raise DataError(f"Megatron dataset file {p} is missing; give the prefix shared by PREFIX.bin and "
                                f"PREFIX.idx (without the suffix).")
        code, lengths, pointers, doc_idx = _read_index(idx)
        self.dtype = np.dtype(DTYPES[code]).newbyteorder("<")
        self._lengths, self._pointers, self._doc_idx = lengths, pointers, doc_idx
        n_tokens = _check_back_to_back(idx, lengths, pointers, self.dtype.itemsize)
        size = os.path.getsize(bin_)
        item = self.dtype.itemsize
        if size != n_tokens * item:
            what = "truncated (a copy or a write that did not finish?)" if size < n_tokens * item else "too long"
            raise DataError(f"{bin_} has {size} bytes but {idx} describes {n_tokens} tokens x {item} bytes = "
                            f"{n_tokens * item}: the .bin is {what}, or the two files are from different datasets. "
                            f"Copy the pair again, or rebuild it.")
        self.tokens = np.memmap(bin_, dtype=self.dtype, mode="r", shape=(n_tokens,)) if n_tokens else \
            np.zeros(0, self.dtype)
        if n_tokens and hasattr(mmap, "MADV_RANDOM"):  # windows are read at random: no 128 KB readahead per fault
            self.tokens._mmap.madvise(mmap.MADV_RANDOM)
        self.num_tokens = n_tokens
        self.num_docs = len(doc_idx) - 1

    def doc_start(self, d: int) -> int:
        """Token offset of document d's start (d = num_docs: the end), read from the memory-mapped index."""
        s = int(self._doc_idx[d])
        return self.num_tokens if s >= len(self._pointers) else int(self._pointers[s]) // self.dtype.itemsize

    @functools.cached_property
    def doc_bounds(self) -> np.ndarray:
        """int64 `[documents + 1]` token offsets (built on first use: 8 bytes per document in memory)."""
        starts = np.append(np.asarray(self._pointers) // self.dtype.itemsize, self.num_tokens)
        return starts[np.asarray(self._doc_idx)]

    def document(self, d: int) -> np.ndarray:
        return np.asarray(self.tokens[self.doc_start(d):self.doc_start(d + 1)])


def _check_back_to_back(idx: str, lengths, pointers, item: int, chunk: int = 1 << 22) -> int:
    """The number of tokens; raises DataError unless each sequence starts right after the one before (checked in
    chunks, so a huge index is never held whole)."""
    end = 0
    for a in range(0, len(lengths), chunk):
        n = np.asarray(lengths[a:a + chunk], np.int64)
        want = end + np.concatenate([[0], np.cumsum(n[:-1])]) * item
        got = np.asarray(pointers[a:a + chunk])
        if not np.array_equal(got, want):
            bad = a + int(np.argmax(got != want))
            raise DataError(f"{idx}: sequence {bad} starts at byte {int(pointers[bad])}, not {int(want[bad - a])} "
                            f"right after the one before it; jaxpar reads only back-to-back sequences (Megatron's "
                            f"builder writes them so). Rewrite it with `python -m jaxpar.preprocess`.")
        end = int(want[-1] + n[-1] * item)
    return end // item


def counts(prefix) -> tuple[int, int]:
    """(documents, tokens) of a dataset from its `.idx` header and `.bin` size alone (no validation)."""
    with open(f"{prefix}.idx", "rb") as f:
        head = f.read(_HEADER)
    _, code, _, n_doc = struct.unpack("<QBQQ", head[len(MAGIC):])
    return n_doc - 1, os.path.getsize(f"{prefix}.bin") // np.dtype(DTYPES[code]).itemsize


def _read_index(idx: str):
    """(dtype code, lengths int32 [S], pointers int64 [S], document indices int64 [D + 1]) of an `.idx` file."""
    size = os.path.getsize(idx)
    with open(idx, "rb") as f:
        head = f.read(_HEADER)
    if len(head) < _HEADER or head[:len(MAGIC)] != MAGIC:
        raise DataError(f"{idx} is not a Megatron index (it does not start with {MAGIC!r}); give the prefix of a "
                        f"dataset written by Megatron's preprocess_data.py or `python -m jaxpar.preprocess`.")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", head[len(MAGIC):])
    if version != VERSION:
        raise DataError(f"{idx} has index version {version}; jaxpar reads version {VERSION} (Megatron's MMIDIDX). "
                        f"Convert it with the Megatron version that wrote it, or rebuild it.")
    if code not in DTYPES or np.dtype(DTYPES[code]).kind not in "iu":
        raise DataError(f"{idx} has dtype code {code}; token ids need an integer code "
                        f"({', '.join(f'{k}={np.dtype(v).name}' for k, v in DTYPES.items() if k not in (6, 7))}).")
    want = _HEADER + n_seq * (4 + 8) + n_doc * 8
    if size < want or n_doc < 1:
        raise DataError(f"{idx} has {size} bytes but its header counts {n_seq} sequences and {n_doc} document "
                        f"indices ({want} bytes): the index is truncated or corrupt. Copy it again or rebuild it.")
    lengths = np.memmap(idx, np.dtype("<i4"), "r", _HEADER, (n_seq,)) if n_seq else np.zeros(0, np.int32)
    pointers = np.memmap(idx, np.dtype("<i8"), "r", _HEADER + 4 * n_seq, (n_seq,)) if n_seq else np.zeros(0, np.int64)
    doc_idx = np.memmap(idx, np.dtype("<i8"), "r", _HEADER + 12 * n_seq, (n_doc,))
    if doc_idx[0] != 0 or doc_idx[-1] != n_seq or _any_chunk(doc_idx, lambda c: np.any(np.diff(c) < 0)) or \
            _any_chunk(lengths, lambda c: np.any(c < 0)):
        raise DataError(f"{idx}: the document index must rise from 0 to the {n_seq} sequences (got "
                        f"{doc_idx[:3].tolist()}..{doc_idx[-1]}) and lengths be >= 0: the index is corrupt.")
    return code, lengths, pointers, doc_idx


def _any_chunk(a, test, chunk: int = 1 << 22) -> bool:
    """test(block) over overlapping blocks of a (memory-mapped) array; True if any block passes."""
    return any(test(np.asarray(a[i:i + chunk + 1])) for i in range(0, max(len(a) - 1, 1), chunk))


class Writer:
    """Stream documents into `PREFIX.bin/.idx` (one sequence per document). Both are written under temporary names
    and renamed into place by `close()` (the `.idx` last), so a killed write never leaves a pair that reads as
    complete. Use as a context manager; an exception inside removes the temporary files."""

    def __init__(self, prefix: str | os.PathLike, dtype):
        self.prefix, self.dtype = str(prefix), np.dtype(dtype).newbyteorder("<")
        if self.dtype.newbyteorder("=") not in CODES:
            raise ValueError(f"dtype {self.dtype} has no Megatron code.")
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._tmp = f".tmp-{os.getpid()}"
        self._bin = open(f"{self.prefix}.bin{self._tmp}", "wb")
        self.lengths = array.array("q")  # tokens per document: 8 bytes each, not a Python int
        self._open = 0  # tokens of the document being written

    def write(self, ids) -> None:
        """Append ids `[n]` to the current document."""
        a = np.asarray(ids)
        self._bin.write(a.astype(self.dtype, copy=False).tobytes())
        self._open += int(a.size)

    def end_document(self) -> None:
        self.lengths.append(self._open)
        self._open = 0

    def end_documents(self, lengths) -> None:
        """End the ids written since the last document as documents of these lengths (summing to them)."""
        lengths = np.asarray(lengths, np.int64)
        if int(lengths.sum()) != self._open:
            raise ValueError(f"document lengths sum to {int(lengths.sum())}, but {self._open} ids were written.")
        self.lengths.extend(lengths.tolist())
        self._open = 0

    def add(self, ids) -> None:
        """Append one whole document: ids `[n]`."""
        self.write(ids)
        self.end_document()

    def close(self) -> None:
        if self._open:
            self.end_document()
        self._bin.close()
        lengths = np.frombuffer(self.lengths, np.int64) if self.lengths else np.zeros(0, np.int64)
        if lengths.size and lengths.max() >= 2**31:
            raise DataError(f"a document of {int(lengths.max())} tokens exceeds Megatron's int32 sequence length; "
                            f"split it (data.doc_separator).")
        pointers = np.concatenate([[0], np.cumsum(lengths[:-1])]) * self.dtype.itemsize if lengths.size else lengths
        with open(f"{self.prefix}.idx{self._tmp}", "wb") as f:
            f.write(MAGIC + struct.pack("<QBQQ", VERSION, CODES[self.dtype.newbyteorder("=")], lengths.size,
                                        lengths.size + 1))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(np.arange(lengths.size + 1, dtype="<i8").tobytes())
        os.replace(f"{self.prefix}.bin{self._tmp}", f"{self.prefix}.bin")
        os.replace(f"{self.prefix}.idx{self._tmp}", f"{self.prefix}.idx")

    def abort(self) -> None:
        self._bin.close()
        for p in (f"{self.prefix}.bin{self._tmp}", f"{self.prefix}.idx{self._tmp}"):
            if os.path.exists(p):
                os.remove(p)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.abort() if exc_type is not None else self.close()
        return False


def concatenate(prefixes, out: str | os.PathLike, block: int = 1 << 24) -> None:
    """Write the documents of the datasets `prefixes`, in order, as one dataset `out` (streamed in blocks)."""
    parts = [IndexedDataset(p) for p in prefixes]
    dtype = parts[0].dtype if parts else np.dtype(np.uint16)
    with Writer(out, dtype) as w:
        for ds in parts:
            for i in range(0, ds.num_tokens, block):
                w.write(ds.tokens[i:i + block])
            w.end_documents(np.diff(ds.doc_bounds))
