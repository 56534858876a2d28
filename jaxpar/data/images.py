"""Images for the vision transformer (`model.arch = "vit"`): sources -> decoded, resized uint8 arrays in the shared
cache (decoded in worker processes); the batches read from it are `jaxpar/data/image_batches.py`.

Sources (`data.sources`, `data.val_source`; one, or a blend "0.3 A 0.7 B" as for text: `parse_sources(images=True)`):

    digits            scikit-learn's bundled 8x8 handwritten digits: 1,797 grey images (v * 255 / 16, rounded),
                      10 classes; nothing downloaded
    imagefolder:DIR   one subfolder per class (class k: the k-th subfolder name, sorted), PNG/JPEG files (any case of
                      the extension, subfolders within a class included, names starting with "." skipped)
    parquet:GLOB      Hugging Face datasets' layout (what `hfds:ORG/NAME` resolves to, `jaxpar/formats/hub.py`): the
                      column `data.image_field` a struct {bytes, path} (or bytes), `data.label_field` an integer;
                      class names from the schema's `huggingface` metadata (ClassLabel names), else "0".."n-1"

`prepare_images(config)` decodes each source once into `<cache>/images/<name>-<key>/`: `images.npy` uint8
`[N, S, S, C]`, `labels.npy` int32 `[N]`, `where.json` (the file, or file and row, of each image) and `meta.json`.
Pillow decodes, converts to RGB (C = 3) or L (C = 1) and resizes to S x S with BILINEAR where the size differs:
what transformers' `ViTImageProcessor` does before rescaling, so the pixels equal its `pixel_values` bit for bit.
`data.workers` processes decode chunks of images straight into the memory-mapped output. The entry is built under a
temporary name and renamed into place whole (a killed build leaves nothing that is trusted); the key hashes the
source's files (path, size, mtime), S, C and the Parquet columns. The val split is `data.val_source` read whole,
else the last `data.val_fraction` of a fixed permutation of each source's images (an image folder lists its images
by class: a plain tail would be one class).

The batches of normalised pixels are `jaxpar/data/image_batches.py` (`ImageBatches`).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import shutil
import time
from pathlib import Path

import numpy as np

from jaxpar.data import image_decode, sources as src
from jaxpar.data.image_decode import DIGITS
from jaxpar.data.common import DataError, check_split, locked, read_json, write_json
from jaxpar.config import cache_root
from jaxpar.data.preprocess import _hash, _say, _unit_id

FORMAT_VERSION = 1
EXTENSIONS = (".png", ".jpg", ".jpeg")
CHUNK = 256  # images per worker job (an image folder's; a Parquet job is one row group)
AUGMENTS = ("crop", "flip")
SPLIT_SEED = 0  # the permutation whose tail is a source's val split: fixed, so the held-out images never change


@dataclasses.dataclass(frozen=True)
class ImageSet:
    """One prepared source: its cache entry `path` (`images.npy` uint8 `[count, S, S, C]`, `labels.npy` int32
    `[count]`), its class names when it names them, and what identifies its content (count, labels, sampled rows)."""
    path: str
    count: int
    classes: tuple | None
    content: str

    @functools.cached_property
    def images(self) -> np.ndarray:
        """uint8 `[count, S, S, C]`, memory-mapped: indexing reads only those images."""
        return np.load(os.path.join(self.path, "images.npy"), mmap_mode="r")

    @functools.cached_property
    def labels(self) -> np.ndarray:
        """int32 `[count]`."""
        return np.load(os.path.join(self.path, "labels.npy"), mmap_mode="r")

    def where(self, i: int) -> str:
        """Where image i came from: its file, or "FILE, row R"."""
        return _where(read_json(os.path.join(self.path, "where.json")), i)


@dataclasses.dataclass(frozen=True, eq=False)
class ImagePart:
    """A split of one source: the images `indices` (int64, sorted) of `images`."""
    images: ImageSet
    indices: np.ndarray

    def __len__(self) -> int:
        return len(self.indices)


@dataclasses.dataclass(frozen=True)
class ImageInfo:
    """Prepared images: per source (weights sum to 1) its `ImageSet`, the class names (the first source's), the image
    shape, the split, and `identity` (what a resume compares: sources, weights, content, shape, split)."""
    sources: tuple  # of (Source, ImageSet)
    classes: tuple
    image_size: int
    channels: int
    identity: str
    val_fraction: float
    val_sources: tuple = ()  # `data.val_source`'s (Source, ImageSet), read whole; () -> each source's held-out tail

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def shape(self) -> tuple:
        """One image: (S, S, C)."""
        return (self.image_size, self.image_size, self.channels)

    @property
    def weights(self) -> list[float]:
        return [s.weight for s, _ in self.sources]

    def parts(self, split: str) -> tuple[tuple, list[ImagePart]]:
        """(the (Source, ImageSet) of `split`, each one's `ImagePart`): val is `data.val_source` whole when given,
        else the last `val_fraction` of a fixed permutation of each source (`split_indices`); train the rest."""
        check_split(split)
        if split == "val" and self.val_sources:
            return self.val_sources, [ImagePart(x, np.arange(x.count, dtype=np.int64)) for _, x in self.val_sources]
        return self.sources, [ImagePart(x, split_indices(x.count, split, self.val_fraction)) for _, x in self.sources]


def split_indices(n: int, split: str, val_fraction: float) -> np.ndarray:
    """The images of `split` among n, sorted: val is the last max(1, round(n * val_fraction)) (none when
    val_fraction = 0) of the permutation `default_rng(SPLIT_SEED).permutation(n)`, train the others."""
    n_val = 0 if val_fraction <= 0 else min(n, max(1, int(round(n * val_fraction))))
    perm = np.random.default_rng(SPLIT_SEED).permutation(n)
    return np.sort(perm[n - n_val:] if check_split(split) == "val" else perm[:n - n_val]).astype(np.int64)


@dataclasses.dataclass
class _Plan:
    """What decoding one source takes: its jobs (each writes images [offset, offset + n) of the output), labels
    (known before decoding), class names (None: unnamed), where each image is, and what identifies its files."""
    count: int
    labels: np.ndarray
    classes: tuple | None
    jobs: list  # of (kind, payload, offset)
    where: dict  # {"files": [...], "rows": [images per file] | None (one each)}
    files: list


def prepare_images(config, *, say=_say) -> ImageInfo:
    """Decode every image source of `config.data.sources` (and `data.val_source`) into the cache (once; under file
    locks) and describe the result. Every process may call it; the trainer runs it on process 0 first
    (`distributed.process_0_first`), then the others find the entries.

    Raises:
      DataError: a bad source, file, image or label (the message names it and the fix); nothing that a later run
        would take as complete is written then.
    """
    d, m = config.data, config.model
    S, C, configured = int(m.image_size), int(m.channels), int(m.num_classes)
    val_fraction = 0.0 if d.val_source else float(d.val_fraction)
    if not 0.0 <= val_fraction < 1.0:
        raise DataError(f"data.val_fraction={val_fraction} must be in [0, 1).")
    specs = src.parse_sources(d.sources, images=True)
    every = specs + (src.parse_sources(d.val_source, images=True) if d.val_source else [])
    fields = (str(d.image_field), str(d.label_field))
    plans = [_plan(s, *fields) for s in every]  # labels and classes checked before anything is decoded
    classes = _classes(every, plans, configured)
    root = cache_root(config)
    sets = [_entry(root, s, p, S, C, fields, int(d.workers), say) for s, p in zip(every, plans)]
    out = tuple(zip(every, sets))
    ident = {"format": FORMAT_VERSION, "shape": [S, S, C], "val_fraction": val_fraction, "split_seed": SPLIT_SEED,
             "sources": [[s.weight, x.content] for s, x in out[:len(specs)]],
             "val_sources": [[s.weight, x.content] for s, x in out[len(specs):]]}
    return ImageInfo(out[:len(specs)], classes, S, C, "images-" + _hash(ident), val_fraction, out[len(specs):])


def _label(s: src.Source) -> str:
    return s.kind if s.kind == "digits" else f"{s.kind}:{s.path}"


def _plan(s: src.Source, image_field: str, label_field: str) -> _Plan:
    _vision("PIL")  # before anything is planned
    if s.kind == "digits":
        sklearn = _vision("sklearn")
        labels = sklearn.datasets.load_digits().target.astype(np.int64)
        return _Plan(len(labels), labels, tuple(str(i) for i in range(10)), [("digits", (0, len(labels)), 0)],
                     {"files": [DIGITS], "rows": [len(labels)]}, ["sklearn", sklearn.__version__])
    if s.kind == "imagefolder":
        return _folder_plan(s)
    return _parquet_plan(s, image_field, label_field)


def _vision(module: str):
    """`module` (PIL, sklearn with its datasets) imported, or a DataError naming the extra that installs it."""
    import importlib

    try:
        if module == "sklearn":
            importlib.import_module("sklearn.datasets")  # then an attribute of sklearn
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"image data needs {'Pillow' if module == 'PIL' else 'scikit-learn'}: pip install "
                        f"'jaxpar[vision]'.") from None


def _folder_plan(s: src.Source) -> _Plan:
    """An image folder's files, sorted by class (the sorted subfolder names) then path."""
    top = os.path.expanduser(s.path)
    if not os.path.isdir(top):
        raise DataError(f"data source imagefolder:{s.path}: {top} is not a directory; give a folder holding one "
                        f"subfolder of images per class (DIR/CLASS/*.png).")
    classes = sorted(e.name for e in os.scandir(top) if e.is_dir() and not e.name.startswith("."))
    if len(classes) < 2:
        raise DataError(f"data source imagefolder:{s.path}: the folder {top} has {len(classes)} class subfolder(s) "
                        f"{classes}; an image folder holds one subfolder per class (at least 2), its images inside "
                        f"(DIR/CLASS/*.png).")
    files, labels = [], []
    for k, c in enumerate(classes):
        for dirpath, dirnames, names in os.walk(os.path.join(top, c)):
            dirnames[:] = sorted(n for n in dirnames if not n.startswith("."))
            found = [os.path.join(dirpath, n) for n in sorted(names)
                     if not n.startswith(".") and os.path.splitext(n)[1].lower() in EXTENSIONS]
            files += found
            labels += [k] * len(found)
    if not files:
        raise DataError(f"data source imagefolder:{s.path} holds no PNG or JPEG images in its class subfolders "
                        f"({', '.join(classes[:4])}{', ...' if len(classes) > 4 else ''}); put them in DIR/CLASS/.")
    jobs = [("files", tuple(files[i:i + CHUNK]), i) for i in range(0, len(files), CHUNK)]
    return _Plan(len(files), np.asarray(labels, np.int64), tuple(classes), jobs, {"files": files, "rows": None},
                 _unit_id(src.Unit("imagefolder", tuple(files))))


def _parquet_plan(s: src.Source, image_field: str, label_field: str) -> _Plan:
    """A Parquet source's row groups (one job each), its labels (read now) and its ClassLabel names."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    files, labels, rows, jobs, classes, offset = s.files(), [], [], [], None, 0
    for f in files:
        try:
            pf = pq.ParquetFile(f)
        except Exception as e:  # pyarrow raises ArrowInvalid and friends
            raise DataError(f"{f} is not a readable Parquet file ({e}).") from e
        names = pf.schema_arrow.names
        for col, key, what in ((image_field, "image_field", "images"), (label_field, "label_field", "labels")):
            if col not in names:
                raise DataError(f"{f} has no column {col!r} (columns: {', '.join(names[:12])}); set "
                                f"--config.data.{key} to the column holding the {what}.")
        col = pf.read(columns=[label_field]).column(0)
        if not pa.types.is_integer(col.type):
            raise DataError(f"{f}: column {label_field!r} holds {col.type}, not integer class indices; set "
                            f"--config.data.label_field to the column holding them.")
        if col.null_count:
            row = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
            raise DataError(f"{f}, row {row}: no label (null in column {label_field!r}); give every image a class.")
        labels.append(col.to_numpy().astype(np.int64))
        classes = classes or _class_names(pf.schema_arrow, label_field)
        rows.append(pf.metadata.num_rows)
        for g in range(pf.metadata.num_row_groups):
            first = sum(pf.metadata.row_group(i).num_rows for i in range(g))
            jobs.append(("parquet", (f, g, first, image_field), offset + first))
        offset += rows[-1]
    if not offset:
        raise DataError(f"data source {_label(s)} has no rows (files: {', '.join(files[:4])}); give a split that "
                        f"holds images.")
    return _Plan(offset, np.concatenate(labels), classes, jobs, {"files": files, "rows": rows},
                 _unit_id(src.Unit("parquet", tuple(files))))


def _class_names(schema, field: str) -> tuple | None:
    """The ClassLabel names that Hugging Face datasets keeps in the schema's `huggingface` metadata, or None."""
    import json

    raw = (schema.metadata or {}).get(b"huggingface")
    try:
        feature = json.loads(raw)["info"]["features"][field] if raw else {}
    except (ValueError, KeyError, TypeError):
        return None
    names = feature.get("names") if isinstance(feature, dict) else None
    return tuple(str(n) for n in names) if isinstance(names, list) and names else None


def _classes(every: list, plans: list, configured: int) -> tuple:
    """The class names: the first source's ("0".."n-1" when no source names them). Refuses sources whose class
    counts disagree and labels outside [0, n) (n: `model.num_classes` when set, else the data's)."""
    named = [(s, p.classes) for s, p in zip(every, plans) if p.classes is not None]
    for s, names in named[1:]:
        if len(names) != len(named[0][1]):
            raise DataError(f"data source {_label(s)} has {len(names)} classes, {_label(named[0][0])} has "
                            f"{len(named[0][1])}: every source of data.sources and data.val_source must have the "
                            f"same classes; blend only sources of one dataset.")
    top = max(int(p.labels.max(initial=-1)) for p in plans) + 1
    n = len(named[0][1]) if named else configured or top
    for p in plans:
        check_labels(p.labels, configured or n, lambda i, p=p: _where(p.where, i), n, configured)
    names = plans[0].classes or (named[0][1] if named else tuple(str(i) for i in range(n)))
    return tuple(names)


def check_labels(labels, bound: int, where, data_classes: int, configured: int = 0) -> None:
    """Refuse a label outside [0, bound): `where(i)` names image i; `data_classes`: the classes the data has,
    `configured`: `model.num_classes` (0: unset). One pass over `labels` (int `[n]`)."""
    labels = np.asarray(labels)
    bad = np.flatnonzero((labels < 0) | (labels >= bound))
    if not bad.size:
        return
    i, v = int(bad[0]), int(labels[bad[0]])
    if v < 0:
        fix = "class indices start at 0; a split without labels (-1) cannot train or evaluate: give a labelled one"
    elif configured and v >= configured:
        fix = f"set --config.model.num_classes={max(data_classes, v + 1)} (or 0: the data's)"
    else:
        fix = f"the source has {data_classes} classes: fix the label, or the source's class names"
    raise DataError(f"{where(i)}: label {v} is outside [0, {bound}) (num_classes={bound}); {fix}.")


def _where(where: dict, i: int) -> str:
    rows = where["rows"]
    if rows is None:
        return where["files"][i]
    ends = np.cumsum(rows)
    f = int(np.searchsorted(ends, i, side="right"))
    return f"{where['files'][f]}, row {i - (int(ends[f]) - rows[f])}"


def _entry(root: Path, s: src.Source, plan: _Plan, S: int, C: int, fields: tuple, workers: int, say) -> ImageSet:
    """The cache entry of one source (decoded now when missing) as an `ImageSet`."""
    key = _hash({"format": FORMAT_VERSION, "kind": s.kind, "shape": [S, S, C], "files": plan.files,
                 "fields": list(fields) if s.kind == "parquet" else None})
    out = root / "images" / f"{s.name}-{key}"
    if not (out / "meta.json").is_file():
        with locked(out.with_name(out.name + ".lock")):
            if not (out / "meta.json").is_file():
                _build(out, s, plan, S, C, workers, say)
    meta = read_json(out / "meta.json")
    return ImageSet(str(out), meta["count"], tuple(meta["classes"]) if meta["classes"] else None, meta["content"])


def _build(out: Path, s: src.Source, plan: _Plan, S: int, C: int, workers: int, say) -> None:
    """Decode `plan` into `out`: built under a temporary name (a killed build's leftovers removed first: we hold the
    lock), meta.json last, then renamed into place whole."""
    for stale in out.parent.glob(f".{out.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)
    if out.exists():  # no meta.json: not an entry
        shutil.rmtree(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        t0 = time.perf_counter()
        np.lib.format.open_memmap(tmp / "images.npy", mode="w+", dtype=np.uint8, shape=(plan.count, S, S, C)).flush()
        jobs = [(kind, payload, str(tmp / "images.npy"), offset, S, C) for kind, payload, offset in plan.jobs]
        image_decode.run(jobs, workers, plan.count, f"prepare images {s.name}", say)
        labels = plan.labels.astype(np.int32)
        np.save(tmp / "labels.npy", labels)
        write_json(tmp / "where.json", plan.where)
        write_json(tmp / "meta.json", {
            "format": FORMAT_VERSION, "source": _label(s), "count": plan.count, "shape": [S, S, C],
            "classes": list(plan.classes) if plan.classes else None, "content": _content(tmp, labels),
            "seconds": round(time.perf_counter() - t0, 3)})
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _content(entry: Path, labels: np.ndarray) -> str:
    """What identifies an entry's content wherever it lies: its shape, all labels and 64 evenly spaced images."""
    images = np.load(entry / "images.npy", mmap_mode="r")
    rows = np.unique(np.linspace(0, len(images) - 1, 64).astype(np.int64))
    h = hashlib.sha256(repr(images.shape).encode() + labels.tobytes())
    h.update(np.ascontiguousarray(images[rows]).tobytes())
    return h.hexdigest()[:16]
