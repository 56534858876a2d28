"""The canonical parameter keys of the model spec: one flat name per leaf ("blocks.wqkv"), what checkpoints' exports and
Hugging Face files are keyed by, whatever layout trained the params. Imports nothing of jaxpar."""
from __future__ import annotations

import jax
import numpy as np

KEY_SEP = "."


def param_items(tree: dict, prefix: str = ""):
    """(dotted key, leaf) of a nested dict of leaves, depth-first in sorted key order."""
    for k in sorted(tree):
        if not isinstance(k, str) or not k or KEY_SEP in k:
            raise ValueError(f"param key {prefix}{k!r}: keys must be non-empty strings without {KEY_SEP!r}.")
        v = tree[k]
        if isinstance(v, dict):
            yield from param_items(v, f"{prefix}{k}{KEY_SEP}")
        else:
            yield f"{prefix}{k}", v


def flatten(params: dict) -> dict[str, np.ndarray]:
    """A nested params dict -> `{"blocks.wqkv": array, ...}` of host numpy arrays, shape and dtype unchanged.

    Leaves may be jax arrays (on any devices or sharding; they are gathered to the host) or numpy arrays.

    Raises:
      ValueError: a key is not a non-empty string, or contains ".".
    """
    flat = dict(param_items(params))
    return {k: np.asarray(v, order="C") for k, v in jax.device_get(flat).items()}


def unflatten(flat: dict) -> dict:
    """The inverse of `flatten`: `{"a.b": x}` -> `{"a": {"b": x}}`; leaves are kept as given (no copy or cast).

    Raises:
      ValueError: an empty key or key part, or a key that is both a leaf and a prefix of another (`a` and `a.b`).
    """
    out: dict = {}
    for key in sorted(flat):
        parts = key.split(KEY_SEP) if isinstance(key, str) else [""]
        if not all(parts):
            raise ValueError(f"flat key {key!r}: empty name part.")
        node = out
        for i, p in enumerate(parts[:-1]):
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ValueError(f"flat key {key!r}: {KEY_SEP.join(parts[:i + 1])!r} is also a leaf.")
        if parts[-1] in node:
            raise ValueError(f"flat key {key!r} is also a prefix of other keys.")
        node[parts[-1]] = flat[key]
    return out
