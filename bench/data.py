"""Data preparation and loading speed, and the encoding's memory, on a generated corpus (prints JSON).

    python bench/data.py [--bpe_mb 256] [--byte_mb 2048] [--out bench/results]

1. A text corpus of random words (64 MB files, documents = paragraphs split at blank lines) is prepared with a BPE
   tokenizer (32768 ids, trained once on the first 16 MB, outside the timings) and with the byte tokenizer, each with 1 and 2 workers, every run in
   its own process: tokens/s, and the peak RSS of the largest process (the encoding's memory). The reference is
   `tokenizers`' own `encode_batch` on the same documents in 1 MB batches, in a process with RAYON_NUM_THREADS set
   to the same count (encode time only: no reading, no writing).
2. The peak RSS is shown for two corpus sizes (the byte corpus, and its first quarter): it does not grow with size.
3. Loader rows/s on 1 process for gpt_small's batch (512 x 1024) from the prepared byte corpus (4 GB of uint16 ids),
   10 batches per packing read cold (the page cache dropped first, where root may) and again warm, against the rows/s an
   H100 consumes training gpt_small at 50 % MFU (FLOPs per token from `model.flops_per_token`; 989 TFLOP/s bf16).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import write_results  # noqa: E402

FILE_MB = 64
H100_BF16 = 989e12  # dense bf16 FLOP/s, NVIDIA H100 SXM datasheet

_PREPARE = """
import json, resource, sys, time
from jaxpar import data
from jaxpar.config import base_config
c = base_config()
c.data.update(json.loads(sys.argv[1]))
t0 = time.perf_counter()
info = data.prepare(c, say=lambda m: None)
dt = time.perf_counter() - t0
rss = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
import os
entry = os.path.dirname(os.path.dirname(info.sources[0][1][0]))
tokens = json.load(open(os.path.join(entry, "meta.json")))["tokens"]
print(json.dumps({"seconds": dt, "tokens": tokens, "peak_rss_mb": rss / 1024}))
"""

_REFERENCE = """
import json, sys, time
from jaxpar.data import load_tokenizer, sources
tok = load_tokenizer(sys.argv[1]).to_hf()
files, limit = json.loads(sys.argv[2]), int(sys.argv[3])
batches, batch, n = [], [], 0
for f in files:
    for text, _ in sources.documents(sources.Unit("text", (f,)), "", b"\\n\\n"):
        batch.append(text); n += len(text)
        if n >= 1 << 20:
            batches.append(batch); batch, n = [], 0
batches.append(batch)
t0, tokens = time.perf_counter(), 0
for b in batches[:limit]:
    tokens += sum(len(e.ids) for e in tok.encode_batch(b, add_special_tokens=False))
print(json.dumps({"seconds": time.perf_counter() - t0, "tokens": tokens}))
"""


def make_corpus(directory: str, mb: int, seed: int = 0) -> list:
    """`mb` MB of random words in 64 MB files; paragraphs of 2-12 lines end with a blank line."""
    rng = np.random.default_rng(seed)
    vocab = np.array(["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), int(rng.integers(2, 10))))
                      for _ in range(5000)])
    os.makedirs(directory, exist_ok=True)
    block = []
    for _ in range(4000):  # ~1 MB of text, reused with shifts so files differ
        lines = [" ".join(rng.choice(vocab, int(rng.integers(5, 15)))) for _ in range(int(rng.integers(2, 12)))]
        block.append("\n".join(lines) + "\n\n")
    paras = np.array(block, dtype=object)
    files = []
    for i in range(-(-mb // FILE_MB)):
        path = os.path.join(directory, f"part{i:04d}.txt")
        files.append(path)
        if os.path.exists(path):
            continue
        with open(path, "w") as f:
            written, k = 0, 0
            while written < min(FILE_MB, mb - i * FILE_MB) << 20:
                chunk = "".join(np.roll(paras, 97 * k + i))
                f.write(chunk)
                written, k = written + len(chunk), k + 1
    return files


def train_tokenizer(first_file: str, out: str, sample_mb: int = 16, vocab: int = 32768) -> str:
    """Byte-level BPE (jaxpar's trainer) on the first `sample_mb` MB of the corpus, once, outside the timings."""
    from jaxpar.data import BPETokenizer

    if not os.path.isfile(os.path.join(out, "tokenizer.json")):
        with open(first_file, encoding="utf-8") as f:
            sample = f.read(sample_mb << 20).split("\n\n")
        BPETokenizer.train(sample, vocab).save(out)
    return out


def prepare_run(files: list, cache: str, **data_kw) -> dict:
    settings = {"sources": "text:" + os.path.join(os.path.dirname(files[0]), "part*.txt"), "doc_separator": "\\n\\n",
                "cache_dir": cache, "val_fraction": 0.0, **data_kw}
    out = subprocess.run([sys.executable, "-c", _PREPARE, json.dumps(settings)], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["tokens_per_s"] = r["tokens"] / r["seconds"]
    r["mb_per_s"] = sum(os.path.getsize(f) for f in files) / 1e6 / r["seconds"]
    return r


def reference_run(tok_dir: str, files: list, threads: int) -> dict:
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, "-c", _REFERENCE, tok_dir, json.dumps(files), "100000"], env=env,
                         capture_output=True, text=True, cwd=ROOT, check=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["tokens_per_s"] = r["tokens"] / r["seconds"]
    return r


def loader_rate(cache: str, files: list, steps: int = 10) -> dict:
    """Rows/s of `Batches.rows` for 512 x 1024 on this process, against what an H100 consumes."""
    from jaxpar import data
    from jaxpar.config import base_config
    from jaxpar.model import flops_per_token
    from jaxpar.train.step import model_config

    c = base_config()
    c.data.update(sources="text:" + os.path.join(os.path.dirname(files[0]), "part*.txt"), doc_separator="\\n\\n",
                  cache_dir=cache, val_fraction=0.0)
    info = data.prepare(c, say=lambda m: None)
    rows, cold = {}, _drop_page_cache()
    for packing in ("concat", "documents"):
        b = data.Batches(info, "train", 1024, 512, seed=0, packing=packing)
        for trial in ("cold" if cold else "first", "warm"):  # warm: the same batches again, from the page cache
            _drop_page_cache() if trial == "cold" else None
            t0 = time.perf_counter()
            for s in range(steps):
                b.rows(s)
            rows[f"{packing}_{trial}"] = 512 * steps / (time.perf_counter() - t0)
    sys.path.insert(0, os.path.join(ROOT, "configs"))
    import gpt_small

    g = gpt_small.get_config()
    cfg = model_config(g, int(g.data.bpe_vocab_size), 1)
    step_flops = flops_per_token(cfg) * 512 * 1024
    steps_per_s = 0.5 * H100_BF16 / step_flops
    need = 512 * steps_per_s
    return {"rows_per_s": rows, "gpt_small_flops_per_step": step_flops, "h100_steps_per_s_at_50pct_mfu": steps_per_s,
            "h100_rows_per_s": need, "margin": {k: v / need for k, v in rows.items()}}


def _drop_page_cache() -> bool:
    """Empty the kernel's page cache (needs root), so reads come from the disk; False if not allowed."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bpe_mb", type=int, default=256)
    p.add_argument("--byte_mb", type=int, default=2048)
    p.add_argument("--workdir", default="")
    p.add_argument("--out", default="")
    p.add_argument("--parts", default="bpe,byte", help="bpe,byte,loader: which to (re)measure (byte includes the "
                                                      "loader); the others are kept from OUT/data.json if it exists")
    a = p.parse_args()
    work = a.workdir or tempfile.mkdtemp(prefix="jaxpar-bench-data-")
    parts = a.parts.split(",")
    old = os.path.join(a.out, "data.json")
    result = json.load(open(old))[0] if a.out and os.path.exists(old) and parts != ["bpe", "byte"] else {}
    if "bpe" in parts:
        result["bpe"] = measure_bpe(work, a.bpe_mb)
    if "byte" in parts:
        result["byte"], _ = measure_byte(work, a.byte_mb)
    if "byte" in parts or "loader" in parts:
        byte_files = make_corpus(os.path.join(work, "byte"), a.byte_mb, seed=1)  # made already: only listed
        result["loader"] = loader_rate(os.path.join(work, "cache_byte_w2"), byte_files)
    print(json.dumps(result, indent=1))
    lines = ["| corpus | workers | tokens/s | MB/s | reference tokens/s | ratio | peak RSS MB |", "|---|---|---|---|---|---|---|"]
    for kind in ("bpe", "byte"):
        for w in (1, 2):
            r = result[kind][f"workers_{w}"]
            lines.append(f"| {kind} {result[kind]['corpus_mb']} MB | {w} | {r['tokens_per_s']:,.0f} | "
                         f"{r['mb_per_s']:.1f} | {r.get('reference_tokens_per_s', float('nan')):,.0f} | "
                         f"{r.get('ratio', float('nan')):.2f} | {r['peak_rss_mb']:.0f} |")
    write_results(a.out, "data", [result], "\n".join(lines))


def measure_bpe(work: str, mb: int) -> dict:
    out = {"corpus_mb": mb}
    bpe_files = make_corpus(os.path.join(work, "bpe"), mb)
    tok_dir = train_tokenizer(bpe_files[0], os.path.join(work, "tokenizer"))
    for w in (1, 2):
        cache = os.path.join(work, f"cache_bpe_w{w}")
        kw = {"tokenizer": os.path.join(tok_dir, "tokenizer.json"), "workers": w}
        if w == 1:  # one worker runs in the calling process: hold tokenizers' own pool to one thread as well
            os.environ["RAYON_NUM_THREADS"] = "1"
        r = prepare_run(bpe_files, cache, **kw)
        os.environ.pop("RAYON_NUM_THREADS", None)
        ref = reference_run(tok_dir, bpe_files, w)
        r.update(reference_tokens_per_s=ref["tokens_per_s"], ratio=r["tokens_per_s"] / ref["tokens_per_s"],
                 reference_tokens=ref["tokens"])
        out[f"workers_{w}"] = r
    return out


def measure_byte(work: str, mb: int) -> tuple:
    out = {"corpus_mb": mb}
    byte_files = make_corpus(os.path.join(work, "byte"), mb, seed=1)
    quarter = byte_files[:max(1, len(byte_files) // 4)]
    qdir = os.path.join(work, "byte_quarter")
    os.makedirs(qdir, exist_ok=True)
    for f in quarter:
        dst = os.path.join(qdir, os.path.basename(f))
        if not os.path.exists(dst):
            os.link(f, dst)
    for w in (1, 2):
        r = prepare_run(byte_files, os.path.join(work, f"cache_byte_w{w}"), tokenizer="byte", workers=w)
        q = prepare_run([os.path.join(qdir, os.path.basename(f)) for f in quarter],
                        os.path.join(work, f"cache_byteq_w{w}"), tokenizer="byte", workers=w)
        r["quarter_corpus"] = {"mb": len(quarter) * FILE_MB, "peak_rss_mb": q["peak_rss_mb"],
                               "tokens_per_s": q["tokens_per_s"]}
        out[f"workers_{w}"] = r
    return out, byte_files


if __name__ == "__main__":
    main()
