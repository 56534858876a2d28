"""Shared pieces of `jaxpar.data`: `DataError`, hashing, atomic JSON writes, the cache file lock, the images'
per-channel settings (`channel_values`), and a user's function named in the config (`user_function`)."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import importlib.util
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


def user_function(spec: str, key: str, example: str):
    """(name, function) of `spec`, `MODULE:FUNCTION` (importable) or `FILE.py:FUNCTION` (a path), which config key
    `key` names. Raises ValueError in one line naming the key, the spec and the fix (`example`: a good one)."""
    where, _, name = spec.strip().rpartition(":")
    if not where or not name:
        raise ValueError(f"{key}: {spec!r} is not MODULE:FUNCTION or FILE.py:FUNCTION (e.g. {example}).")
    try:
        if where.endswith(".py"):
            if not os.path.isfile(where):
                raise ValueError(f"{key}: {spec!r}: no file {where}; give a path to a Python file.")
            found = importlib.util.spec_from_file_location(os.path.basename(where)[:-3], where)
            module = importlib.util.module_from_spec(found)
            found.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except ImportError as e:
        raise ValueError(f"{key}: {spec!r}: cannot import {where} ({e}); check the module's name and "
                         f"PYTHONPATH.") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{key}: {spec!r}: {where} has no function {name!r}.")
    return name, fn
