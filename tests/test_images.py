"""Image data for the ViT (`jaxpar/data/images.py`): scikit-learn's digits, an image folder and Hugging Face's
Parquet layout decode to the same arrays; pixels equal transformers' ViTImageProcessor bit for bit; batches are a
pure function of (step, row), resume, blend and augment deterministically; the val split counts each held-out image
once; every bad input is one DataError naming it. No network: small images generated with Pillow."""
from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from jaxpar.config import base_config
from jaxpar.data import DataError, ImageBatches, image_batch_shapes, image_decode as dec, images as img, prepare_images

CLASSES = ["cat", "dog", "eel"]
SIZES = [(10, 14), (17, 9), (12, 12), (30, 21)]  # (width, height): most differ from S = 12, one is S already
S = 12
MEAN, STD = "0.485,0.456,0.406", "0.229,0.224,0.225"


def config(tmp_path, sources, **data):
    c = base_config()
    c.model.update(arch="vit", image_size=data.pop("image_size", S), patch_size=4, channels=data.pop("channels", 3),
                   num_classes=data.pop("num_classes", 0))
    c.data.update(sources=sources, cache_dir=str(tmp_path / "cache"), image_mean=MEAN, image_std=STD, **data)
    return c


def batches(info, split, B=16, seed=0, **kw):
    return ImageBatches(info, split, B, seed, image_size=info.image_size, channels=info.channels,
                        **{"mean": MEAN, "std": STD, **kw})


def encoded(rng, i) -> tuple[bytes, str]:
    """A random RGB image of one of SIZES as PNG bytes (every fifth a JPEG), and its file suffix (mixed case)."""
    w, h = SIZES[i % len(SIZES)]
    im = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")
    buf = io.BytesIO()
    jpeg = i % 5 == 4
    im.save(buf, "JPEG" if jpeg else "PNG")
    return buf.getvalue(), (".JPG" if jpeg else [".png", ".PNG"][i % 2])


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """{"folder": an image folder of 3 classes (5, 4, 6 images), "files": its files in class order, "labels",
    "bytes": each file's bytes}."""
    d = tmp_path_factory.mktemp("imgs")
    rng, files, labels, raw = np.random.default_rng(0), [], [], []
    for k, (c, n) in enumerate(zip(CLASSES, (5, 4, 6))):
        (d / "folder" / c).mkdir(parents=True)
        for i in range(n):
            data, suffix = encoded(rng, len(files))
            files.append(d / "folder" / c / f"img{i:02d}{suffix}")
            files[-1].write_bytes(data)
            labels.append(k)
            raw.append(data)
    (d / "folder" / "cat" / "notes.txt").write_text("not an image")  # skipped: not PNG/JPEG
    (d / "folder" / ".hidden").mkdir()  # skipped: not a class
    return {"folder": d / "folder", "files": files, "labels": np.asarray(labels), "bytes": raw}


def write_parquet(path: Path, raw, labels, names=None, struct=True, row_group_size=4, columns=("image", "label")):
    """Hugging Face datasets' layout: image {bytes, path} (or bytes), label int64, ClassLabel names in the schema's
    `huggingface` metadata as datasets writes them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    image = [{"bytes": b, "path": f"{i}.png"} for i, b in enumerate(raw)] if struct else list(raw)
    table = pa.table({columns[0]: image, columns[1]: pa.array(labels, pa.int64())})
    if names is not None:
        features = {columns[0]: {"_type": "Image"}, columns[1]: {"names": names, "_type": "ClassLabel"}}
        table = table.replace_schema_metadata({b"huggingface": json.dumps({"info": {"features": features}}).encode()})
    pq.write_table(table, path, row_group_size=row_group_size)


def test_digits_loads_1797_images_in_10_classes(tmp_path):
    from sklearn.datasets import load_digits

    info = prepare_images(config(tmp_path, "digits", image_size=8, channels=1, val_fraction=0.2))
    (_, x), = info.sources
    digits = load_digits()
    assert (x.count, info.num_classes, info.classes) == (1797, 10, tuple("0123456789"))
    assert x.images.shape == (1797, 8, 8, 1) and x.images.dtype == np.uint8
    np.testing.assert_array_equal(x.images[..., 0], np.rint(digits.images * 255 / 16).astype(np.uint8))
    np.testing.assert_array_equal(x.labels, digits.target)
    train, val = batches(info, "train", 64, mean="", std=""), batches(info, "val", 64, mean="", std="")
    assert (train.num_samples, val.num_samples) == ([1438], [359])  # max(1, round(0.2 x 1797)) held out
    rows = train.rows(0)
    assert rows["pixels"].shape == (64, 8, 8, 1) and rows["pixels"].min() >= -1 and rows["pixels"].max() <= 1
    assert {k: (v.shape, v.dtype) for k, v in rows.items()} == image_batch_shapes(64, 8, 1)
    assert train.tokens_by_source(3) == {"images/digits": 192} and train.tokens_in(rows) == 64


def test_imagefolder_and_parquet_give_the_same_images(tmp_path, images):
    folder = prepare_images(config(tmp_path, f"imagefolder:{images['folder']}", val_fraction=0.4))
    (tmp_path / "pq").mkdir()
    n = len(images["bytes"])  # two files, several row groups each
    write_parquet(tmp_path / "pq" / "train-00000-of-00002.parquet", images["bytes"][:9], images["labels"][:9],
                  CLASSES)
    write_parquet(tmp_path / "pq" / "train-00001-of-00002.parquet", images["bytes"][9:], images["labels"][9:],
                  CLASSES)
    pq_info = prepare_images(config(tmp_path, f"parquet:{tmp_path}/pq/*.parquet"))
    write_parquet(tmp_path / "plain.parquet", images["bytes"], images["labels"], struct=False)  # bytes, no names
    plain = prepare_images(config(tmp_path, str(tmp_path / "plain.parquet")))
    a, b, c = (i.sources[0][1] for i in (folder, pq_info, plain))
    assert a.count == b.count == c.count == n
    assert folder.classes == pq_info.classes == tuple(CLASSES) and plain.classes == ("0", "1", "2")
    np.testing.assert_array_equal(a.labels, images["labels"])
    for x in (b, c):
        np.testing.assert_array_equal(x.images, a.images)
        np.testing.assert_array_equal(x.labels, a.labels)
    assert a.where(0) == str(images["files"][0]) and b.where(10).endswith("train-00001-of-00002.parquet, row 1")
    assert folder.identity != plain.identity  # another split
    val = batches(folder, "val").val_batch(0)
    assert len(set(val["labels"][val["mask"] > 0].tolist())) > 1  # a fixed permutation's tail: not one class


def test_pixels_equal_transformers_vit_image_processor(tmp_path, images):
    """RGB images of other sizes (and one of size S) through jaxpar and through transformers' PIL processor (what
    `ViTImageProcessor` is without torchvision): the float32 pixels are identical."""
    import transformers

    processor_class = getattr(transformers, "ViTImageProcessorPil", transformers.ViTImageProcessor)
    mean, std = [float(v) for v in MEAN.split(",")], [float(v) for v in STD.split(",")]
    processor = processor_class(size={"height": S, "width": S}, image_mean=mean, image_std=std)
    c = config(tmp_path, f"imagefolder:{images['folder']}", val_source=f"imagefolder:{images['folder']}")
    val = batches(prepare_images(c), "val", B=len(images["files"]))
    ours = val.val_batch(0)
    expected = processor([Image.open(f) for f in images["files"]], return_tensors="np")["pixel_values"]
    assert expected.dtype == np.float32 and ours["pixels"].dtype == np.float32
    np.testing.assert_array_equal(ours["pixels"], expected.transpose(0, 2, 3, 1))
    np.testing.assert_array_equal(ours["labels"], images["labels"])


def test_rows_are_a_pure_function_of_step_and_row(tmp_path, images):
    """Two instances (the second from the cache), other slices, a blend, augmentation on: the same rows."""
    (tmp_path / "b").symlink_to(images["folder"])
    spec = f"0.3 imagefolder:{images['folder']} 0.7 imagefolder:{tmp_path / 'b'}"
    one = batches(prepare_images(config(tmp_path, spec)), "train", augment="crop,flip")
    two = batches(prepare_images(config(tmp_path, spec)), "train", augment="crop,flip")
    for step in (0, 3, 11):
        whole = one.rows(step)
        parts = [two.rows(step, a, b) for a, b in ((0, 5), (5, 6), (6, 16))]
        for k in whole:
            np.testing.assert_array_equal(whole[k], np.concatenate([p[k] for p in parts]))
    drawn = one.tokens_by_source(100)
    assert sum(drawn.values()) == 1600 and abs(drawn["images/b"] / 1600 - 0.7) < 0.01
    assert set(drawn) == {"images/folder", "images/b"}


def test_each_epoch_shuffles_every_train_image_once_and_resume_continues(tmp_path, images):
    info = prepare_images(config(tmp_path, f"imagefolder:{images['folder']}", val_fraction=0.2))
    a = batches(info, "train", B=8, seed=1)
    n = a.num_samples[0]
    order = np.concatenate([a.samples(s) for s in range(3)])[:, 1]  # two epochs of the 12 train images
    assert n == 12 and sorted(order[:n].tolist()) == sorted(order[n:].tolist()) == list(range(n))
    assert order[:n].tolist() != order[n:].tolist()  # reshuffled each epoch
    assert a.epoch(3) == 2.0
    b = batches(info, "train", B=4, seed=1)  # a resume at step 2 with another global batch
    b.resume_at(5, a.samples_before(2))
    for k, v in a.rows(2).items():
        np.testing.assert_array_equal(v, np.concatenate([b.rows(5)[k], b.rows(6)[k]]))
    with pytest.raises(ValueError):
        b.rows(4)
    other_seed = batches(info, "train", B=8, seed=2)
    assert other_seed.samples(0)[:, 1].tolist() != a.samples(0)[:, 1].tolist()


def test_val_batches_count_each_held_out_image_once(tmp_path):
    info = prepare_images(config(tmp_path, "digits", image_size=8, channels=1, val_fraction=0.2))
    val, B = batches(info, "val", 64, mean="0.5", std="0.5"), 64
    (_, x), = info.sources
    held = img.split_indices(1797, "val", 0.2)
    assert not set(held.tolist()) & set(img.split_indices(1797, "train", 0.2).tolist())
    out = [val.val_batch(i) for i in range(6)]  # ceil(359 / 64) = 6
    mask = np.concatenate([o["mask"] for o in out])
    assert mask.sum() == 359 and mask[:359].all() and not mask[359:].any()
    real = np.concatenate([o["pixels"] for o in out])[:359]
    scaled = (x.images[held] * (1 / 255)).astype(np.float32)  # as transformers rescales: float64, then float32
    np.testing.assert_array_equal(real, (scaled - np.float32(0.5)) / np.float32(0.5))
    np.testing.assert_array_equal(np.concatenate([o["labels"] for o in out])[:359], x.labels[held])
    np.testing.assert_array_equal(out[-1]["pixels"][-1], out[0]["pixels"][0])  # padding: image 0, mask 0
    assert val.tokens_in(out[-1]) == 359 - 5 * B
    np.testing.assert_array_equal(val.val_batch(5, 20, 40)["mask"], out[5]["mask"][20:40])
    np.testing.assert_array_equal(val.rows(2)["pixels"], out[2]["pixels"])


def test_augmentation_is_deterministic_and_only_on_train(tmp_path, images):
    info = prepare_images(config(tmp_path, f"imagefolder:{images['folder']}", val_fraction=0.2))
    plain = batches(info, "train", seed=3)
    crop_flip = [batches(info, "train", seed=3, augment="crop,flip") for _ in range(2)]
    flip = batches(info, "train", seed=3, augment="flip")
    u8 = plain._read(*plain.samples(1).T)[0]
    pad = S // 8
    padded = np.pad(u8, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    got = crop_flip[0].rows(1)
    np.testing.assert_array_equal(got["pixels"], crop_flip[1].rows(1)["pixels"])
    np.testing.assert_array_equal(got["labels"], plain.rows(1)["labels"])
    windows = [crop_flip[0].pixels(padded[:, y:y + S, x:x + S]) for y in range(2 * pad + 1)
               for x in range(2 * pad + 1)]
    for i, p in enumerate(got["pixels"]):  # a window of the zero-padded image, maybe mirrored
        assert any(np.array_equal(p, w[i]) or np.array_equal(p, w[i][:, ::-1]) for w in windows)
    assert not np.array_equal(got["pixels"], plain.rows(1)["pixels"])
    f, p = flip.rows(1)["pixels"], plain.rows(1)["pixels"]
    mirrored = [np.array_equal(a, b[:, ::-1]) and not np.array_equal(a, b) for a, b in zip(f, p)]
    assert all(m or np.array_equal(a, b) for m, a, b in zip(mirrored, f, p)) and 0 < sum(mirrored) < len(f)
    val_aug, val_plain = batches(info, "val", augment="crop,flip"), batches(info, "val")
    np.testing.assert_array_equal(val_aug.val_batch(0)["pixels"], val_plain.val_batch(0)["pixels"])


def test_the_cache_is_reused_rebuilt_on_change_and_decoded_in_workers(tmp_path, images, monkeypatch):
    c = config(tmp_path, f"imagefolder:{images['folder']}")
    first = prepare_images(c)
    monkeypatch.setattr(dec, "fit", lambda *a: pytest.fail("decoded again"))
    assert prepare_images(c).sources[0][1].path == first.sources[0][1].path  # the entry found: nothing decoded
    monkeypatch.undo()
    monkeypatch.setattr(img, "CHUNK", 4)  # 4 jobs over 2 spawned workers
    seen, run = [], dec.run
    monkeypatch.setattr(dec, "run", lambda jobs, n, *a: seen.append((len(jobs), n)) or run(jobs, n, *a))
    c2 = config(tmp_path / "w", f"imagefolder:{images['folder']}", workers=2)
    np.testing.assert_array_equal(prepare_images(c2).sources[0][1].images, first.sources[0][1].images)
    assert seen == [(4, 2)]
    f = images["files"][0]
    os.utime(f, ns=(os.stat(f).st_atime_ns, os.stat(f).st_mtime_ns + 10**9))  # a changed file: a new entry
    assert prepare_images(c).sources[0][1].path != first.sources[0][1].path


def test_a_failed_build_leaves_no_entry(tmp_path, images, monkeypatch):
    """A corrupt image or a crash mid-build leaves no entry; a killed build's leftovers (its temp dir, an entry
    without meta.json) are never trusted and are cleared by the next build."""
    d = tmp_path / "folder"
    for k, c in enumerate(CLASSES):
        (d / c).mkdir(parents=True)
        (d / c / "a.png").write_bytes(images["bytes"][0])
    (d / "dog" / "b.png").write_bytes(images["bytes"][0][:60])  # truncated
    c, cache = config(tmp_path, f"imagefolder:{d}"), tmp_path / "cache" / "images"
    with pytest.raises(DataError, match=r"dog/b\.png: not a readable image"):
        prepare_images(c)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []
    (d / "dog" / "b.png").unlink()
    before = set(cache.glob("*.lock"))
    monkeypatch.setattr(dec, "fit", lambda *a: (_ for _ in ()).throw(RuntimeError("crashed")))
    with pytest.raises(RuntimeError):
        prepare_images(c)
    monkeypatch.undo()
    (lock,) = set(cache.glob("*.lock")) - before  # the good folder's entry: another key
    entry = cache / lock.stem
    assert not any(p for p in cache.iterdir() if not p.name.endswith(".lock"))
    stale = cache / f".{entry.name}.tmp-999999"  # a killed build's: whole but for the rename
    for x in (stale, entry):  # and an entry without meta.json
        x.mkdir()
        (x / "images.npy").write_bytes(b"half")
    (stale / "meta.json").write_text("{}")
    got = prepare_images(c).sources[0][1]
    assert got.path == str(entry) and got.count == 3 and not stale.exists() and (entry / "meta.json").is_file()


def hf(tmp_path, images, name="x.parquet", labels=None, **kw) -> str:
    write_parquet(tmp_path / name, images["bytes"][:6], images["labels"][:6] if labels is None else labels, **kw)
    return f"parquet:{tmp_path / name}"


def bad_row(tmp_path, images):
    raw = list(images["bytes"][:6])
    raw[4] = b"\x89PNG garbage"
    write_parquet(tmp_path / "bad.parquet", raw, images["labels"][:6], CLASSES)
    return f"parquet:{tmp_path / 'bad.parquet'}", {}


def one_class(tmp_path, images):
    (tmp_path / "one" / "only").mkdir(parents=True)
    return f"imagefolder:{tmp_path / 'one'}", {}


def no_images(tmp_path, images):
    for c in CLASSES:
        (tmp_path / "none" / c).mkdir(parents=True)
    return f"imagefolder:{tmp_path / 'none'}", {}


ERRORS = {
    "corrupt image (folder)": (lambda t, i: (f"imagefolder:{corrupt_folder(t, i)}", {}),
                               r"eel/z\.jpeg: not a readable image"),
    "corrupt image (parquet row)": (bad_row, r"bad\.parquet, row 4: not a readable image"),
    "label past the class names": (lambda t, i: (hf(t, i, labels=[0, 1, 2, 5, 0, 1], names=CLASSES), {}),
                                   r"x\.parquet, row 3: label 5 is outside \[0, 3\) .*fix the label"),
    "label past model.num_classes": (lambda t, i: (f"imagefolder:{i['folder']}", {"num_classes": 2}),
                                     r"eel/img00\.JPG: label 2 is outside \[0, 2\) .*model\.num_classes=3"),
    "negative label": (lambda t, i: (hf(t, i, labels=[0, 1, -1, 0, 0, 0]), {}), r"row 2: label -1 .*labelled"),
    "one class folder": (one_class, r"one has 1 class subfolder\(s\) \['only'\]"),
    "no images": (no_images, r"imagefolder:.*none holds no PNG or JPEG images"),
    "no rows": (lambda t, i: (hf(t, {"bytes": [], "labels": np.zeros(0)}, names=CLASSES), {}), r"has no rows"),
    "no image column": (lambda t, i: (hf(t, i, columns=("img", "label")), {}),
                        r"has no column 'image' \(columns: img, label\); set --config\.data\.image_field"),
    "no label column": (lambda t, i: (hf(t, i, columns=("image", "fine_label")), {}),
                        r"no column 'label' \(columns: image, fine_label\); set --config\.data\.label_field"),
    "class counts disagree": (lambda t, i: (f"0.5 digits 0.5 imagefolder:{i['folder']}", {"channels": 1}),
                              r"imagefolder:.* has 3 classes, digits has 10"),
    "a text source": (lambda t, i: ("shakespeare", {}), r"'shakespeare' is not an image source"),
}


def corrupt_folder(tmp_path, images):
    d = tmp_path / "corrupt"
    for c in CLASSES:
        (d / c).mkdir(parents=True)
        (d / c / "a.png").write_bytes(images["bytes"][0])
    (d / "eel" / "z.jpeg").write_bytes(b"\xff\xd8 not really a jpeg")
    return d


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_inputs_are_one_line_data_errors(tmp_path, images, case):
    make, pattern = ERRORS[case]
    spec, over = make(tmp_path, images)
    with pytest.raises(DataError, match=pattern) as e:
        prepare_images(config(tmp_path, spec, **over))
    assert "\n" not in str(e.value)


def test_an_empty_val_split_is_refused(tmp_path, images):
    info = prepare_images(config(tmp_path, f"imagefolder:{images['folder']}", val_fraction=0.0))
    with pytest.raises(DataError, match=r"the val split has no images .*data\.val_fraction > 0"):
        batches(info, "val")
    with pytest.raises(DataError, match=r"label 2 is outside \[0, 2\)"):
        batches(info, "train", num_classes=2)
    with pytest.raises(DataError, match=r"data\.augment='rotate'"):
        batches(info, "train", augment="rotate")
    with pytest.raises(DataError, match=r"data\.image_std='1,2' has 2 values; model\.channels=3"):
        batches(info, "train", std="1,2")
