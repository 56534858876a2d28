"""Shared pieces of `jaxpar.data`: `DataError`, hashing, atomic JSON writes, the cache file lock, and the images'
per-channel settings (`channel_values`)."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from pathlib import Path

import numpy as np


class DataError(ValueError):
    """Data that cannot be used (missing, empty, corrupt, too short, wrong hash); the message names the fix."""


def check_split(split: str) -> str:
    if split not in ("train", "val"):
        raise ValueError(f"split={split!r}: use 'train' or 'val'.")
    return split


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_json(path) -> dict:
    with open(path) as f:
        return json.load(f)


def write_json(path, obj) -> None:
    """Write via a temp name and `os.replace`, so readers see the old file or the whole new one."""
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


@contextlib.contextmanager
def locked(lock_path: Path):
    """Exclusive `fcntl.flock` on `lock_path` (created, never deleted) for the `with` body."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def channel_values(value, channels: int, key: str, default: float = 0.5) -> np.ndarray:
    """`data.image_mean` / `data.image_std` (comma-separated floats, one per channel or one for all; "" = `default`
    each; or a sequence) -> float32 `[channels]`."""
    words = str(value).replace(",", " ").split() if isinstance(value, str) else list(value)
    try:
        values = [float(w) for w in words] or [default]
    except (TypeError, ValueError):
        raise DataError(f"{key}={value!r}: give one number per channel, comma-separated (e.g. '0.5,0.5,0.5').") \
            from None
    if len(values) == 1:
        values *= channels
    if len(values) != channels:
        raise DataError(f"{key}={value!r} has {len(values)} values; model.channels={channels} needs {channels} "
                        f"(comma-separated) or one for all.")
    return np.asarray(values, np.float32)
