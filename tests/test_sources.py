"""Sources at scale: Megatron `.bin/.idx` read (written here from the format spec, independently of jaxpar's writer)
and written, JSONL/Parquet against the same text, blends, a resumed preparation, and bad inputs."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

from jaxpar import data
from jaxpar.config import base_config
from jaxpar.data import preprocess as prep
from jaxpar.data.megatron import IndexedDataset
from jaxpar.preprocess import main as preprocess_main


def spec_writer(prefix: Path, docs: list[list[list[int]]], dtype, code: int, version: int = 1) -> None:
    """Megatron's MMIDIDX v1 from its spec: docs are lists of sequences (several per document, as Megatron writes
    with sentence splitting)."""
    seqs = [np.asarray(s, dtype) for d in docs for s in d]
    lengths = np.asarray([s.size for s in seqs], np.int32)
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)]) * np.dtype(dtype).itemsize
    doc_idx = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    with open(f"{prefix}.bin", "wb") as f:
        for s in seqs:
            f.write(s.tobytes())
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", version) + struct.pack("<B", code))
        f.write(struct.pack("<Q", len(seqs)) + struct.pack("<Q", len(doc_idx)))
        f.write(lengths.tobytes() + pointers.astype(np.int64).tobytes() + doc_idx.tobytes())


def config(tmp_path, sources, **kw):
    c = base_config()
    c.data.update(sources=sources, cache_dir=str(tmp_path / "cache"), **kw)
    return c


def stream_of(info, k=0) -> np.ndarray:
    s = info.streams()[k]
    return s.read(0, s.num_tokens)


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """Eight documents of random words (UTF-8, some non-ASCII), as .txt files, JSONL and Parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path_factory.mktemp("texts")
    rng = np.random.default_rng(1)
    words = ["the", "fox", "café", "naïve", "☃", "ROMEO", "jumps", "over"]
    docs = [" ".join(rng.choice(words, int(rng.integers(50, 400)))) + "\n" for _ in range(8)]
    for i, t in enumerate(docs):
        (d / f"doc{i}.txt").write_text(t, encoding="utf-8")
    with open(d / "all.jsonl", "w") as f:
        for t in docs:
            f.write(json.dumps({"id": 1, "body": t}) + "\n")
    pq.write_table(pa.table({"body": docs[:5]}), d / "a.parquet", row_group_size=2)
    pq.write_table(pa.table({"body": docs[5:]}), d / "b.parquet", row_group_size=2)
    return d, docs


# ---------------------------------------------------------------------------------------------- Megatron


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4)])
def test_megatron_written_from_the_spec_reads_back_token_exact(tmp_path, dtype, code):
    rng = np.random.default_rng(0)
    docs = [[rng.integers(0, 250, int(rng.integers(1, 40))).tolist() for _ in range(int(rng.integers(1, 4)))]
            for _ in range(20)]
    docs[5] = [[]]  # an empty document (Megatron allows it)
    spec_writer(tmp_path / "m", docs, dtype, code)
    ds = IndexedDataset(tmp_path / "m")
    assert ds.num_docs == 20 and ds.dtype == np.dtype(dtype)
    for d, seqs in enumerate(docs):
        np.testing.assert_array_equal(ds.document(d), np.concatenate(seqs).astype(dtype))
    info = data.prepare(config(tmp_path, f"megatron:{tmp_path / 'm'}", val_fraction=0.1))
    flat = np.concatenate([np.concatenate(s) for s in docs]).astype(np.int32)
    np.testing.assert_array_equal(stream_of(info), flat)
    val = data.Batches(info, "val", seq_len=4, global_batch=2, packing="documents")  # val = the last 2 documents
    assert info.streams()[0].doc_bounds[18] == val.parts[0].start
    # segments: the document of each token from the spec's own bounds, counted from the window's first
    bounds = np.cumsum([0] + [sum(len(q) for q in d) for d in docs])
    b = data.Batches(info, "train", seq_len=16, global_batch=8, packing="documents")
    for step in range(3):
        rows = b.rows(step)
        for (_, i), tok, seg in zip(b.samples(step), rows["tokens"], rows["segments"]):
            doc = np.searchsorted(bounds, i * 16 + np.arange(17), "right") - 1
            np.testing.assert_array_equal(tok, flat[i * 16:i * 16 + 17])
            np.testing.assert_array_equal(np.unique(seg, return_inverse=True)[1].ravel(),
                                          np.unique(doc, return_inverse=True)[1].ravel())


def test_jaxpar_writer_round_trips_and_exports_any_text_source(tmp_path, texts):
    d, docs = texts
    out = tmp_path / "export" / "corpus_text_document"
    assert preprocess_main(["--sources", str(d / "all.jsonl"), "--text_field", "body", "--out", str(out),
                      "--cache_dir", str(tmp_path / "cache")]) == 0
    ds = IndexedDataset(out)
    assert ds.num_docs == 8
    for i, t in enumerate(docs):
        assert bytes(ds.document(i).astype(np.uint8)).decode() == t
    # the written pair is itself a source, and reads back as the text it came from
    again = data.prepare(config(tmp_path, str(out)))
    text = data.prepare(config(tmp_path, str(d / "doc*.txt")))
    np.testing.assert_array_equal(stream_of(again), stream_of(text))
    np.testing.assert_array_equal(again.streams()[0].doc_bounds, text.streams()[0].doc_bounds)
    assert preprocess_main(["--sources", str(d / "all.jsonl"), "--text_field", "body", "--out", str(out),
                      "--cache_dir", str(tmp_path / "cache")]) == 2  # never overwrites
    assert IndexedDataset(out).num_docs == 8


def test_jsonl_and_parquet_give_the_text_files_tokens(tmp_path, texts):
    d, docs = texts
    kw = dict(tokenizer="bpe", bpe_vocab_size=300, text_field="body", unit_mb=1)
    txt = data.prepare(config(tmp_path, f"text:{d}/doc*.txt", **kw))
    jsonl = data.prepare(config(tmp_path, f"jsonl:{d}/all.jsonl", **kw))
    parquet = data.prepare(config(tmp_path, f"{d}/*.parquet", **kw))
    for other in (jsonl, parquet):
        np.testing.assert_array_equal(stream_of(other), stream_of(txt))
        np.testing.assert_array_equal(other.streams()[0].doc_bounds, txt.streams()[0].doc_bounds)
    assert txt.streams()[0].num_docs == 8
    tok = data.load_tokenizer(txt.tokenizer_dir)
    assert tok.decode(stream_of(txt).tolist()) == "".join(t + "<|endoftext|>" for t in docs)


def test_two_workers_and_byte_ranges_give_the_same_tokens(tmp_path, texts):
    d, docs = texts
    big = tmp_path / "big.jsonl"
    big.write_bytes((d / "all.jsonl").read_bytes() * 250)  # 2,000 records, 2.4 MB: three 1 MB byte ranges
    whole = data.prepare(config(tmp_path / "a", str(big), text_field="body"))
    two = data.prepare(config(tmp_path / "b", str(big), text_field="body", workers=2, unit_mb=1))
    assert len(whole.sources[0][1]) == 1 and len(two.sources[0][1]) == 3
    np.testing.assert_array_equal(stream_of(whole), stream_of(two))
    np.testing.assert_array_equal(whole.streams()[0].doc_bounds, two.streams()[0].doc_bounds)
    assert two.streams()[0].num_docs == 2000
    sep = data.prepare(config(tmp_path / "c", f"text:{d}/doc*.txt", doc_separator=" ☃ "))
    pieces = [p for t in docs for p in t.split(" ☃ ") if p]
    assert sep.streams()[0].num_docs == len(pieces)
    np.testing.assert_array_equal(stream_of(sep), np.frombuffer("".join(pieces).encode(), np.uint8))


def test_killed_preparation_is_never_taken_as_complete_and_resumes(tmp_path, texts, monkeypatch):
    d, _ = texts
    c = config(tmp_path, f"{d}/all.jsonl", text_field="body", unit_mb=1)
    src = tmp_path / "many.jsonl"
    src.write_bytes((d / "all.jsonl").read_bytes() * 400)  # 4.8 MB: five units of 1 MB
    c.data.sources = str(src)
    real, done = prep.encode_unit, []

    def dies_on_third(job):
        if len(done) == 2:
            raise KeyboardInterrupt  # as a kill would, midway
        done.append(job)
        return real(job)

    monkeypatch.setattr(prep, "encode_unit", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        data.prepare(c)
    (entry,) = [p for p in (tmp_path / "cache" / "tokens").iterdir() if p.is_dir()]
    assert not (entry / "meta.json").exists() and len(list(entry.glob("shards/*.idx"))) == 2
    (entry / "shards" / "000002.bin.tmp-999").write_bytes(b"half")  # a killed writer's leftover
    monkeypatch.setattr(prep, "encode_unit", real)
    said = []
    info = prep.prepare(c, say=said.append)
    assert said[0].startswith("prepare many: 2 of ") and "already built, resuming" in said[0]
    fresh = prep.prepare(config(tmp_path / "fresh", str(src), text_field="body", unit_mb=1), say=lambda m: None)
    np.testing.assert_array_equal(stream_of(info), stream_of(fresh))
    assert not list(entry.glob("shards/*.tmp-*"))


# ---------------------------------------------------------------------------------------------- blends


def test_blend_draws_each_source_at_its_weight_and_any_batch_split_agrees(tmp_path, texts):
    d, _ = texts
    info = data.prepare(config(tmp_path, f"0.3 {d}/all.jsonl 0.7 text:{d}/doc*.txt", text_field="body"))
    assert [round(w, 6) for w in info.weights] == [0.3, 0.7]
    b = data.Batches(info, "train", seq_len=8, global_batch=100, seed=5)
    first = np.concatenate([b.samples(s) for s in range(100)])  # 10,000 samples
    assert (first[:, 0] == 0).sum() == 3000 and (first[:, 0] == 1).sum() == 7000  # exactly, as Megatron's blend
    for n in (100, 1000, 5000):  # every prefix close to the weights
        assert abs((first[:n, 0] == 0).mean() - 0.3) <= 0.02
    assert b.tokens_by_source(100) == {"tokens/all": 3000 * 8, "tokens/doc": 7000 * 8}
    same = data.prepare(config(tmp_path, f"0.5 {d}/all.jsonl 0.5 {d}/all.jsonl", text_field="body"))
    assert data.Batches(same, "train", 8, 10).names == ["all0", "all1"]
    # the same positions whatever the batch size: a pure function of the position
    small = data.Batches(info, "train", seq_len=8, global_batch=7, seed=5)
    np.testing.assert_array_equal(np.concatenate([small.samples(s) for s in range(20)]), first[:140])
    rows = b.rows(3)["tokens"]
    np.testing.assert_array_equal(np.concatenate([b.rows(3, 0, 50)["tokens"], b.rows(3, 50, 100)["tokens"]]), rows)


def test_packing_segments_follow_the_documents(tmp_path, texts):
    d, docs = texts
    info = data.prepare(config(tmp_path, f"text:{d}/doc*.txt", val_fraction=0.0))
    b = data.Batches(info, "train", seq_len=64, global_batch=16, packing="documents")
    bounds = info.streams()[0].doc_bounds
    for (_, i), tok, seg in zip(b.samples(0), b.rows(0)["tokens"], b.rows(0)["segments"]):
        pos = i * 64 + np.arange(65)
        doc = np.searchsorted(bounds, pos, "right") - 1
        np.testing.assert_array_equal(seg, doc - doc[0])
        np.testing.assert_array_equal(tok, stream_of(info)[pos])


# ---------------------------------------------------------------------------------------------- bad input


def test_bad_megatron_files_name_the_file_and_the_fix(tmp_path):
    docs = [[[1, 2, 3]], [[4, 5]], [[6]]]
    spec_writer(tmp_path / "ok", docs, np.uint16, 8)
    raw_bin, raw_idx = (tmp_path / "ok.bin").read_bytes(), (tmp_path / "ok.idx").read_bytes()
    cases = {
        "truncated": (raw_bin[:-2], raw_idx, r"truncated\.bin has 10 bytes but .*6 tokens x 2 bytes = 12.*truncated"),
        "longer": (raw_bin + b"\0\0", raw_idx, r"longer\.bin has 14 bytes.*too long"),
        "version": (raw_bin, raw_idx[:9] + struct.pack("<Q", 2) + raw_idx[17:], r"version\.idx has index version 2; jaxpar reads version 1"),
        "cut_idx": (raw_bin, raw_idx[:-8], r"cut_idx\.idx has \d+ bytes but its header counts 3 sequences"),
        "foreign": (raw_bin, b"TNTIDX\0\0" + raw_idx[8:], r"not a Megatron index"),
    }
    for name, (b, i, msg) in cases.items():
        (tmp_path / f"{name}.bin").write_bytes(b)
        (tmp_path / f"{name}.idx").write_bytes(i)
        before = ((tmp_path / f"{name}.bin").read_bytes(), (tmp_path / f"{name}.idx").read_bytes())
        with pytest.raises(data.DataError, match=msg):
            data.Batches(data.prepare(config(tmp_path, f"megatron:{tmp_path / name}")), "train", 2, 2)
        assert ((tmp_path / f"{name}.bin").read_bytes(), (tmp_path / f"{name}.idx").read_bytes()) == before
    with pytest.raises(data.DataError, match=r"nothere\.idx is missing"):
        IndexedDataset(tmp_path / "nothere")


def test_bad_text_sources_and_blends(tmp_path, texts):
    d, _ = texts
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": "fine"}\nnot json\n')
    (tmp_path / "nofield.jsonl").write_text('{"text": "fine"}\n{"content": "x"}\n')
    cases = [
        (str(tmp_path / "bad.jsonl"), r"bad\.jsonl, line 3: not JSON.*Fix or remove that line"),
        (str(tmp_path / "nofield.jsonl"), r"nofield\.jsonl, line 2: no string field 'text' \(has \['content'\]\).*"
                                          r"text_field"),
        (f"0.5 {d}/all.jsonl 0 {d}/all.jsonl", r"weight 0; every weight must be a finite number > 0"),
        (f"-1 {d}/all.jsonl 2 {d}/all.jsonl", r"weight -1"),
        (f"0.5 {d}/all.jsonl 0.5", r"a blend is pairs 'WEIGHT SOURCE"),
        (f"{d}/nothing*.txt", r"matches no files"),
        (f"webdataset:{d}", r"unknown source kind 'webdataset'"),
        (f"parquet:{d}/a.parquet", r"a\.parquet has no column 'text' \(columns: \['body'\]\).*text_field"),
    ]
    for spec, msg in cases:
        with pytest.raises(data.DataError, match=msg):
            data.prepare(config(tmp_path, spec))
        assert not list((tmp_path / "cache").rglob("meta.json"))  # nothing that reads as complete
        assert not [p for p in (tmp_path / "cache").glob("tokens/*") if p.is_dir()]  # nor an empty entry
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(20)))
    info = data.prepare(config(tmp_path, f"0.5 {d}/doc*.txt 0.5 {tiny}"))
    with pytest.raises(data.DataError, match=r"data source jsonl:.*tiny\.jsonl: its train split has \d+ tokens .*"
                                             r"fewer than one sequence of model.seq_len \+ 1 = 1025"):
        data.Batches(info, "train", 1024, 8)


@pytest.mark.slow
def test_blend_with_packing_resumes_exactly_under_another_data_parallel_size(corpus, tmp_path):
    import shutil

    import jax

    from helpers import LOSS_F64_RTOL, run_config
    from jaxpar import trainer
    from helpers import losses

    blend = f"0.3 text:{corpus}/[abc].txt 0.7 text:{corpus}/[def].txt"
    # float64 (helpers.F64_TOL): step 4's loss follows an optimizer step taken on another layout
    over = {"data.packing": "documents", "train.steps": 4, "mesh.data": 2, "train.microbatches": 2,
            "train.param_dtype": "float64", "train.compute_dtype": "float64"}
    c = run_config(corpus, tmp_path, **over)
    c.data.sources, c.checkpoint.every_steps = blend, 2
    with jax.enable_x64(True):
        trainer.run(c, str(tmp_path / "whole"), devices=jax.devices()[:2])
        shutil.copytree(tmp_path / "whole" / "checkpoints" / "2", tmp_path / "resumed" / "checkpoints" / "2")
        c.mesh.data = 8
        trainer.run(c, str(tmp_path / "resumed"))
    whole, resumed = losses(tmp_path / "whole"), losses(tmp_path / "resumed")
    assert sorted(resumed) == [3, 4]
    for s in (3, 4):
        assert abs(resumed[s] - whole[s]) <= LOSS_F64_RTOL * abs(whole[s]), (s, whole, resumed)
    with open(tmp_path / "resumed" / "metrics.jsonl") as f:
        last = [json.loads(line) for line in f][-1]
    drawn = last["tokens/abc"] + last["tokens/def"]
    assert drawn == 4 * 16 * 16 and abs(last["tokens/abc"] / drawn - 0.3) <= 0.05  # 64 samples: 19 and 45


def test_a_named_validation_source_is_read_whole_and_the_sources_train_whole(texts, tmp_path):
    """data.val_source: the validation split is that source, every document of it; the training sources keep all of
    theirs (data.val_fraction is ignored); the data's identity (what a resume compares) names it."""
    d, docs = texts
    info = data.prepare(config(tmp_path, f"text:{d}/doc[0-5].txt", val_source=f"text:{d}/doc[67].txt",
                               val_fraction=0.5))
    train, val = (data.Batches(info, split, seq_len=8, global_batch=2) for split in ("train", "val"))
    whole = data.prepare(config(tmp_path, f"text:{d}/doc[0-5].txt", val_fraction=0.0))
    assert [p.num_tokens for p in train.parts] == [whole.streams()[0].num_tokens]
    alone = data.prepare(config(tmp_path, f"text:{d}/doc[67].txt"))
    assert [(p.start, p.num_tokens) for p in val.parts] == [(0, alone.streams()[0].num_tokens)]
    np.testing.assert_array_equal(val.rows(0)["tokens"][0], stream_of(alone)[:9])
    assert info.identity not in (whole.identity, data.prepare(config(tmp_path, f"text:{d}/doc[0-5].txt",
                                                                     val_source=f"text:{d}/doc7.txt")).identity)
