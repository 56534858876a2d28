"""Decoding a ViT's images in worker processes (`jaxpar/data/images.py` plans the jobs): each job's images read
(scikit-learn's digits, image files, Parquet cells), converted and resized as transformers' `ViTImageProcessor` does
(`fit`), written straight into the memory-mapped `images.npy`."""
from __future__ import annotations

import io
import os
import time

import numpy as np

from jaxpar.data.common import DataError

DIGITS = "sklearn.datasets.load_digits()"


def run(jobs: list, workers: int, count: int, label: str, say) -> None:
    """`decode_job` over `jobs` (in-process when workers == 1, else a spawned pool), printing progress."""
    t0, last, done = time.perf_counter(), 0.0, 0
    if workers > 1 and len(jobs) > 1:
        import multiprocessing

        pool = multiprocessing.get_context("spawn").Pool(min(workers, len(jobs)))
        results = pool.imap_unordered(decode_job, jobs)
    else:
        pool, results = None, map(decode_job, jobs)
    try:
        for n, r in enumerate(results, 1):
            done += r
            dt = time.perf_counter() - t0
            if dt - last >= 2.0 or n == len(jobs):
                last, rate = dt, done / max(dt, 1e-9)
                say(f"{label}: {done:,}/{count:,} images, {rate:,.0f} images/s, ETA {(count - done) / rate:.0f} s")
    finally:
        if pool is not None:
            pool.terminate()


def decode_job(job) -> int:
    """Decode one job's images into rows [offset, ...) of the memory-mapped `images.npy`; returns how many. Runs in
    a worker."""
    kind, payload, path, offset, S, C = job
    out = np.load(path, mmap_mode="r+")
    n = 0
    for image, where in _inputs(kind, payload):
        out[offset + n] = fit(image, where, S, C)
        n += 1
    out.flush()
    return n


def _inputs(kind: str, payload):
    """(what `PIL.Image.open` reads, or an image; where it is) of a job's images, in order."""
    if kind == "digits":
        from PIL import Image
        from sklearn.datasets import load_digits

        start, stop = payload
        grey = np.rint(load_digits().images[start:stop] * 255 / 16).astype(np.uint8)
        for i, g in enumerate(grey, start):
            yield Image.fromarray(g, "L"), f"{DIGITS}, row {i}"
    elif kind == "files":
        for f in payload:
            yield f, f
    else:
        import pyarrow.parquet as pq

        path, group, row, field = payload
        for batch in pq.ParquetFile(path).iter_batches(batch_size=64, row_groups=[group], columns=[field]):
            for v in batch.column(0).to_pylist():
                yield _image_bytes(v, f"{path}, row {row}", field), f"{path}, row {row}"
                row += 1


def _image_bytes(v, where: str, field: str):
    """A Parquet cell (Hugging Face's {bytes, path} struct, or bytes) -> what `PIL.Image.open` reads."""
    raw = v.get("bytes") if isinstance(v, dict) else v
    if isinstance(raw, (bytes, bytearray)):
        return io.BytesIO(raw)
    if isinstance(v, dict) and v.get("path") and os.path.isfile(v["path"]):
        return v["path"]
    raise DataError(f"{where}: column {field!r} holds no image bytes ({type(raw).__name__}); give a dataset with "
                    f"its images embedded (datasets' push_to_hub / to_parquet embed them).")


def fit(image, where: str, size: int, channels: int) -> np.ndarray:
    """Decode `image` (a path, a file object, or a PIL image), convert it to RGB (3 channels) or L (1) and resize it
    to size x size with BILINEAR when its size differs, as transformers' ViTImageProcessor does: uint8
    `[size, size, channels]`.

    Raises:
      DataError: an unreadable or corrupt image (named by `where`)."""
    from PIL import Image

    try:
        if isinstance(image, Image.Image):
            im = image.convert("RGB" if channels == 3 else "L")
        else:
            with Image.open(image) as opened:
                im = opened.convert("RGB" if channels == 3 else "L")
    except Exception as e:  # Pillow raises OSError, ValueError, DecompressionBombError, SyntaxError, ...
        raise DataError(f"{where}: not a readable image ({type(e).__name__}: {e}); replace or remove it.") from None
    if im.size != (size, size):
        im = im.resize((size, size), Image.BILINEAR)
    return np.asarray(im, np.uint8).reshape(size, size, channels)
