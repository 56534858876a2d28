"""Batches of images for the vision transformer (`model.arch = "vit"`), from what `jaxpar/data/images.py` prepared:
`ImageBatches` is `loader.Batches` for images. Row r of batch `step` is a pure function of (step, r) and reads only
its image from the memory-mapped cache. train: each source's images in a grain shuffle (seed, source), reshuffled
each epoch, blended by weight (`Blend`), optionally augmented (`crop`, `flip`) by randomness keyed by (seed,
position in the blended order), so the same on any layout or process count; val: in order, the last batch padded
with mask-0 rows. Pixels are `(uint8 / 255 - mean) / std` in float32, computed as transformers does (`pixel_table`).

Shapes: pixels float32 `[n, S, S, C]` (channels last), labels int32 `[n]`, mask float32 `[n]`.
"""
from __future__ import annotations

import numpy as np

from jaxpar.data.common import DataError, channel_values, check_split
from jaxpar.data.images import AUGMENTS, ImageInfo, _label, check_labels
from jaxpar.data.loader import Batches, Order


def pixel_table(mean, std, channels: int) -> np.ndarray:
    """float32 `[256, channels]`: the pixel of each uint8 value in each channel, `(v / 255 - mean) / std` computed
    as transformers does (v * (1/255) in float64, cast to float32, then `(x - mean) / std` in float32)."""
    m = channel_values(mean, channels, "data.image_mean")
    s = channel_values(std, channels, "data.image_std")
    if not np.all(s > 0):
        raise DataError(f"data.image_std={std!r}: every channel's standard deviation must be > 0.")
    scaled = (np.arange(256, dtype=np.float64) * (1 / 255)).astype(np.float32)
    return (scaled[:, None] - m[None]) / s[None]


def parse_augment(value: str) -> tuple:
    """`data.augment` ("", "crop", "flip", "crop,flip") -> the augmentations named, in the order applied."""
    words = {w.strip() for w in str(value).split(",") if w.strip()}
    if words - set(AUGMENTS):
        raise DataError(f"data.augment={value!r}: use '', 'crop', 'flip' or 'crop,flip'.")
    return tuple(a for a in AUGMENTS if a in words)


def _bits(seed: int, positions: np.ndarray, salt: int) -> np.ndarray:
    """uint64 random bits per position, a pure function of (seed, position, salt) (SplitMix64)."""
    def mix(x):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))

    with np.errstate(over="ignore"):
        key = mix(np.asarray([int(seed) % 2**62 * 4 + salt], np.uint64))
        return mix(key ^ np.asarray(positions, np.int64).astype(np.uint64))


def augment_images(images: np.ndarray, positions: np.ndarray, seed: int, which: tuple) -> np.ndarray:
    """uint8 `[n, S, S, C]` -> the same augmented: `crop` pads each side by S // 8 with 0 (black, before
    normalisation) and takes a random S x S window; `flip` mirrors left-right with probability 1/2. Image i's
    randomness is keyed by (seed, positions[i])."""
    n, S = images.shape[:2]
    pad = S // 8
    if "crop" in which and pad:
        padded = np.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
        dy = (_bits(seed, positions, 1) % np.uint64(2 * pad + 1)).astype(np.int64)
        dx = (_bits(seed, positions, 2) % np.uint64(2 * pad + 1)).astype(np.int64)
        images = np.stack([padded[i, y:y + S, x:x + S] for i, (y, x) in enumerate(zip(dy, dx))]) if n else images
    if "flip" in which:
        flip = (_bits(seed, positions, 3) >> np.uint64(63)).astype(bool)
        images = np.where(flip[:, None, None, None], images[:, :, ::-1], images)
    return images


class ImageBatches(Batches):
    """Global batches of images from the blended sources: `rows(step, start, stop)` -> {"pixels": float32
    `[n, S, S, C]`, "labels": int32 `[n]`, "mask": float32 `[n]`}; row r of batch `step` is a pure function of
    (step, r).

    split="train": source k's images in a grain shuffle (seed, k), reshuffled every epoch of k, blended by weight
    (`Blend`); position p = step * global_batch + r (after `resume_at`: as `Batches`); `augment` ("crop", "flip",
    "crop,flip") keyed by (seed, p). split="val": the split's images in order (the sources one after another), no
    augmentation: batch i holds images i*B .. i*B + B - 1, rows past the end repeat image 0 with mask 0, so
    ceil(N / B) batches count every image once. Shares `Batches`' order, `resume_at`, `samples_before`, `epoch`.

    Raises (on construction, before anything compiles):
      DataError: a split with no images, an image shape other than the prepared one, a label outside
        [0, num_classes), a bad mean, std or augmentation.
    """

    def __init__(self, info: ImageInfo, split: str, global_batch: int, seed: int = 0, *, image_size: int,
                 channels: int, mean="", std="", augment: str = "", num_classes: int = 0):
        # Batches.__init__ reads token streams: not called; the order (`Order`) and its methods are shared
        self.split, self.global_batch, self.seed = check_split(split), int(global_batch), int(seed)
        if self.global_batch < 1:
            raise DataError(f"global_batch={global_batch} must be >= 1.")
        if (int(image_size), int(image_size), int(channels)) != info.shape:
            raise DataError(f"the images were prepared as {info.shape} (S, S, C), asked for ({image_size}, "
                            f"{image_size}, {channels}); prepare them with this model.image_size and model.channels.")
        sources, self.parts = info.parts(split)
        names = [s.name for s, _ in sources]
        self.names = [n if names.count(n) == 1 else f"{n}{k}" for k, n in enumerate(names)]
        self.num_samples = [len(p) for p in self.parts]
        _check_split_sizes(sources, self.num_samples, split, info.val_fraction)
        self.num_classes = int(num_classes) or info.num_classes
        for p in self.parts:
            check_labels(p.images.labels, self.num_classes, p.images.where, info.num_classes, int(num_classes))
        self.order = Order(self.num_samples, [s.weight for s, _ in sources], self.split, self.seed, self.global_batch)
        self.packed = None
        self.image_size, self.channels = int(image_size), int(channels)
        self.table = pixel_table(mean, std, self.channels).T.reshape(-1)  # [C * 256]: channel c's at c * 256
        self.augment = parse_augment(augment) if split == "train" else ()
        self.val_starts = np.cumsum([0] + self.num_samples)

    def tokens_by_source(self, step: int) -> dict:
        """Training images drawn from each source before batch `step`: {"images/<source name>": images}."""
        n = self.order.consumed(step)
        return {f"images/{name}": int(v) for name, v in zip(self.names, n)}

    def tokens_in(self, rows: dict) -> int:
        """The images (rows with mask 1) of host rows: what throughput counts."""
        return int(np.count_nonzero(rows["mask"]))

    def rows(self, step: int, start: int = 0, stop: int | None = None) -> dict:
        """Rows start..stop (default: all) of global batch `step` (the val split: `val_batch(step)`). Reads only
        these rows' images."""
        if self.split == "val":
            return self.val_batch(step, start, stop)
        samples = self.samples(step, start, stop)
        images, labels = self._read(samples[:, 0], samples[:, 1])
        if self.augment:
            images = augment_images(images, self.order.positions(step, start, stop), self.seed, self.augment)
        return {"pixels": self.pixels(images), "labels": labels, "mask": np.ones(len(labels), np.float32)}

    def val_batch(self, i: int, start: int = 0, stop: int | None = None) -> dict:
        """Rows start..stop of validation batch i: images i*B + start .. of the val split in order; rows past its
        end hold image 0 with mask 0."""
        if self.split != "val":
            raise ValueError("val_batch needs ImageBatches(..., split='val').")
        stop = self.global_batch if stop is None else stop
        if i < 0 or not 0 <= start <= stop <= self.global_batch:
            raise ValueError(f"need i >= 0 and 0 <= start <= stop <= {self.global_batch}; got {i=}, {start=}, "
                             f"{stop=}.")
        g = int(i) * self.global_batch + np.arange(start, stop, dtype=np.int64)
        real = g < self.val_starts[-1]
        g = np.where(real, g, 0)
        k = np.searchsorted(self.val_starts, g, side="right") - 1
        images, labels = self._read(k, g - self.val_starts[k])
        return {"pixels": self.pixels(images), "labels": labels, "mask": real.astype(np.float32)}

    def _read(self, k: np.ndarray, j: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Image j of source k's split, for each pair: (uint8 `[n, S, S, C]`, int32 labels `[n]`)."""
        S, C = self.image_size, self.channels
        images, labels = np.zeros((len(k), S, S, C), np.uint8), np.zeros(len(k), np.int32)
        for a in np.unique(k):
            rows = np.flatnonzero(k == a)
            part = self.parts[a]
            idx = part.indices[j[rows]]
            images[rows] = part.images.images[idx]
            labels[rows] = part.images.labels[idx]
        return images, labels

    def pixels(self, images: np.ndarray) -> np.ndarray:
        """uint8 `[n, S, S, C]` -> float32 `[n, S, S, C]`: `(v / 255 - mean) / std` per channel."""
        return np.take(self.table, images.astype(np.uint16) + np.arange(self.channels, dtype=np.uint16) * 256)


def _check_split_sizes(sources, counts: list, split: str, val_fraction: float) -> None:
    if split == "val" and not sum(counts):
        raise DataError("the val split has no images (data.val_fraction=0 and no data.val_source); set "
                        "--config.data.val_fraction > 0 or give --config.data.val_source.")
    for (s, x), n in zip(sources, counts):
        if split == "train" and not n:
            raise DataError(f"data source {_label(s)}: its train split has no images (data.val_fraction="
                            f"{val_fraction} of its {x.count} took them all); lower data.val_fraction or give "
                            f"more images.")


def image_batch_shapes(global_batch: int, image_size: int, channels: int) -> dict:
    """{name: (shape, dtype)} of a global batch as `ImageBatches.rows` gives it."""
    S, C = int(image_size), int(channels)
    return {"pixels": ((global_batch, S, S, C), np.float32), "labels": ((global_batch,), np.int32),
            "mask": ((global_batch,), np.float32)}
