"""A Hugging Face checkpoint directory's tensors: `model.safetensors`, or shards `model-0000k-of-0000n.safetensors`
named by `model.safetensors.index.json`; read header-first and lazily, written in shards.

safetensors layout (huggingface/safetensors README): an 8-byte little-endian header length N, N bytes of JSON
`{name: {dtype, shape, data_offsets: [begin, end]}}` (offsets from the end of the header), then the data. A file
shorter than its header says is truncated: `tensors` refuses it before anything is read.
"""
from __future__ import annotations

import json
import os
import struct
from typing import NamedTuple

from jaxpar.config import ConfigError

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


class HFError(ConfigError):
    """A Hugging Face directory jaxpar cannot use; the message names the file and the fix."""


class StoredTensor(NamedTuple):
    path: str
    dtype: str  # numpy / jax dtype name
    shape: tuple
    offset: int  # of the tensor's first byte in the file


def _header(path: str) -> dict:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if n < 2 or 8 + n > size:
            raise HFError(f"{path}: not a complete safetensors file ({size} bytes, too short for its header); "
                          f"copy it again.")
        try:
            head = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HFError(f"{path}: unreadable safetensors header ({e}); copy the file again.") from e
    if not isinstance(head, dict):
        raise HFError(f"{path}: the safetensors header is not a JSON object; copy the file again.")
    head.pop("__metadata__", None)
    for key, v in head.items():
        _check_entry(path, key, v)
    end = max((int(v["data_offsets"][1]) for v in head.values()), default=0)
    if 8 + n + end > size:
        raise HFError(f"{path} is truncated: {size} bytes, its header needs {8 + n + end}; copy the file again.")
    for v in head.values():
        v["data_offsets"] = [8 + n + int(x) for x in v["data_offsets"]]
    return head


_ITEMSIZE = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def _check_entry(path: str, key: str, v) -> None:
    """One header entry: {dtype, shape, data_offsets [begin, end]} with end - begin = its bytes."""
    ok = isinstance(v, dict) and isinstance(v.get("dtype"), str) and isinstance(v.get("shape"), list) and \
        isinstance(v.get("data_offsets"), list) and len(v["data_offsets"]) == 2
    if ok:
        begin, end = v["data_offsets"]
        count = 1
        for n in v["shape"]:
            count *= n
        size = _ITEMSIZE.get(v["dtype"])
        ok = 0 <= begin <= end and (size is None or end - begin == size * count)
    if not ok:
        raise HFError(f"{path}: tensor {key!r} has a malformed header entry {v!r}; copy the file again.")


def tensors(directory: str) -> dict[str, StoredTensor]:
    """{tensor name: StoredTensor} of every tensor in the directory, from the headers only.

    Raises:
      HFError: no weights, an unreadable index, a shard the index names is missing, truncated or malformed, a
        tensor the index places in a file that lacks it.
    """
    single, index = os.path.join(directory, SINGLE), os.path.join(directory, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise HFError(f"{index} is not a safetensors index (JSON with a weight_map): {e}.") from e
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(single):
        weight_map, files = None, [SINGLE]
    else:
        raise HFError(f"{directory} has neither {SINGLE} nor {INDEX}: not a Hugging Face checkpoint in safetensors "
                      f"(a PyTorch .bin checkpoint can be converted with transformers' save_pretrained).")
    out = {}
    for name in files:
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise HFError(f"{path} is missing ({INDEX} names it); copy every shard of the checkpoint.")
        for key, v in _header(path).items():  # (a dtype jaxpar cannot read is refused where the tensor is wanted)
            out[key] = StoredTensor(path, DTYPES.get(v["dtype"], v["dtype"]), tuple(v["shape"]), v["data_offsets"][0])
    for key, name in (weight_map or {}).items():
        if key not in out:
            raise HFError(f"{INDEX} places {key!r} in {name}, which does not hold it; the index and shards disagree.")
    return out


class Reader:
    """`read(name, index)`: one tensor's part (a tuple of slices) as numpy, reading from its file only the rows that
    part spans (plain reads, no memory map: host memory is the part read, and nothing stays resident after)."""

    def __init__(self, where: dict):
        self.where, self.open = where, {}

    def read(self, name: str, index: tuple):
        import numpy as np

        e = self.where[name]
        dtype = np.dtype(jnp_dtype(e.dtype)).newbyteorder("<")
        rows = index[0].indices(e.shape[0]) if e.shape else (0, 1, 1)
        row = dtype.itemsize * int(np.prod(e.shape[1:], dtype=np.int64))
        if e.path not in self.open:
            self.open[e.path] = open(e.path, "rb")
        f = self.open[e.path]
        f.seek(e.offset + rows[0] * row)
        n = max(rows[1] - rows[0], 0)
        part = np.frombuffer(f.read(n * row), dtype).reshape((n,) + tuple(e.shape[1:]))
        rest = (slice(None, None, rows[2]),) + tuple(index[1:])
        full = all(s == slice(None) or s.indices(k) == (0, k, 1) for s, k in zip(rest, part.shape))
        return part if full else np.array(part[rest])  # a copy: drops the rows' buffer

    def close(self):
        for f in self.open.values():
            f.close()
        self.open.clear()


def jnp_dtype(name: str):
    import jax.numpy as jnp

    return jnp.dtype(name)


def write(directory: str, tensors_in_order, max_shard_bytes: int) -> list[str]:
    """Write `(name, numpy array)` pairs into `model.safetensors`, or into shards of at most `max_shard_bytes`
    (a tensor bigger than that gets a shard of its own) with `model.safetensors.index.json`, as
    `save_pretrained(max_shard_size=...)` does. Holds one shard in memory at a time. Returns the file names."""
    from safetensors.numpy import save_file

    shards, cur, size, total = [], {}, 0, 0
    for name, a in tensors_in_order:
        if cur and size + a.nbytes > max_shard_bytes:
            shards.append(_spill(directory, cur, len(shards), save_file))
            cur, size = {}, 0
        cur[name], size, total = a, size + a.nbytes, total + a.nbytes
    if not shards:
        save_file(cur, os.path.join(directory, SINGLE), metadata={"format": "pt"})
        return [SINGLE]
    shards.append(_spill(directory, cur, len(shards), save_file))
    n, names, weight_map = len(shards), [], {}
    for k, (tmp, keys) in enumerate(shards):
        final = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        os.rename(os.path.join(directory, tmp), os.path.join(directory, final))
        names.append(final)
        weight_map.update({key: final for key in keys})
    with open(os.path.join(directory, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    return names + [INDEX]


def _spill(directory, cur, k, save_file):
    tmp = f"shard-{k}.tmp"
    save_file(cur, os.path.join(directory, tmp), metadata={"format": "pt"})
    return tmp, list(cur)


