"""Which devices a collective in HLO text runs over: the first replica group (or source-target pair), and the mesh
axes it spans.

Formats read (XLA's HloPrinter): explicit `replica_groups={{0,1},{2,3}}`; iota `replica_groups=[G,S]<=[d0,d1]T(1,0)`
(iota over prod(d) reshaped to d, transposed, reshaped to G groups of S); named-mesh
`replica_groups=mesh['a'=2,'b'=4], device_ids=([4,2]T(1,0)) {'b'}` (the device ids laid over the mesh, grouped over
the listed axes); collective-permute's `source_target_pairs={{0,1},...}`. Device ids are positions in the
computation's device assignment (`use_global_device_ids`), i.e. in the jaxpar mesh's flattened device grid.
"""
from __future__ import annotations

import re

import numpy as np

_EXPLICIT = re.compile(r"(?:replica_groups|source_target_pairs)=\{\{([\d,\s]*)\}")
_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(" ", "").split(",") if x]


def _iota(dims: list[int], perm: str | None) -> np.ndarray:
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    return ids.transpose(_ints(perm)) if perm else ids


def first_group(attrs: str) -> list[int] | None:
    """Device ids of the collective's first group (for a permute: its first source and target); None when the
    text has no groups (all devices) or a format this module does not read."""
    m = _EXPLICIT.search(attrs)
    if m:
        return _ints(m.group(1))
    m = _IOTA.search(attrs)
    if m:
        G, S = _ints(m.group(1))
        return [int(x) for x in _iota(_ints(m.group(2)), m.group(3)).reshape(G, S)[0]]
    m = _MESH.search(attrs)
    if m:
        axes = [(a.split("=")[0].strip(" '"), int(a.split("=")[1])) for a in m.group(1).split(",")]
        sizes = [n for _, n in axes]
        ids = (_iota(_ints(m.group(2)), m.group(3)) if m.group(2) else np.arange(int(np.prod(sizes))))
        ids = ids.reshape(sizes)
        grouped = {a.strip(" '") for a in m.group(4).split(",")}
        index = tuple(slice(None) if name in grouped else 0 for name, _ in axes)
        return [int(x) for x in ids[index].ravel()]
    return None


def axes_of(group: list[int] | None, mesh_shape: dict[str, int]) -> tuple[str, ...]:
    """The mesh axes (of `mesh_shape`, in its order, e.g. {'data': 2, 'stage': 1, 'tensor': 4}) along which the
    group's devices differ; every axis of size > 1 when `group` is None."""
    names, sizes = list(mesh_shape), list(mesh_shape.values())
    if group is None:
        return tuple(n for n, s in zip(names, sizes) if s > 1)
    coords = np.array(np.unravel_index(np.asarray(group), sizes))
    return tuple(n for n, row in zip(names, coords) if len(set(row.tolist())) > 1)
