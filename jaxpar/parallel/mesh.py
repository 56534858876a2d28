"""The device mesh `(data, stage, expert, context, tensor)`: tensor on neighbouring devices (the fastest links), then
context (its K/V all-gathers) and expert (its all-to-all), data outermost.

`make_mesh(shape)` takes the resolved sizes from `validate.validate`. Devices are ordered by (node, process, id) and
reshaped to (data, stage, expert, context, tensor), tensor fastest: a tensor group (and an expert x tensor block, when a node
holds one) lies within a node and `data` spans nodes, so tensor-parallel traffic never crosses the network. The node of
each process comes from `jaxpar.cluster.distributed`; without it each process counts as its own node.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxpar.cluster import distributed
from jaxpar.config import MESH_AXES, ConfigError
from jaxpar.layout import Layout

AXES = MESH_AXES  # ("data", "stage", "expert", "context", "tensor"): the config's one list


def make_mesh(shape: Layout | dict[str, int], devices=None) -> Mesh:
    """Mesh with axes `AXES`, sizes `shape` (a `Layout`, or {'data', 'stage', 'tensor'[, 'expert', 'context']}), axis types Auto
    (compiler-propagated).

    Raises:
      ValueError: the product of the sizes differs from the number of devices.
      ConfigError: the devices cannot keep `tensor` within a node (see `node_order`).
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = shape.mesh_shape if isinstance(shape, Layout) else shape
    sizes = tuple(int(shape.get(a, 1)) for a in AXES)
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(f"mesh {dict(zip(AXES, sizes))} needs {int(np.prod(sizes))} devices, have {len(devices)}")
    grid = np.asarray(node_order(devices, sizes[-1], _nodes()), dtype=object).reshape(sizes)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def _nodes():
    return distributed.process_nodes()


def node_order(devices, tensor: int, nodes: dict[int, str] | None = None) -> list:
    """`devices` sorted by (node, process, id): on one GPU server neighbouring ids share the fastest links
    (NVLink / NVSwitch); `nodes` maps process index -> node name (None: each process is its own node).

    Raises:
      ConfigError: nodes hold different numbers of devices, or `tensor` does not divide a node's devices (its
        traffic would cross the network).
    """
    node_of = (lambda p: nodes.get(p, p)) if nodes else (lambda p: p)
    first = {}
    for d in sorted(devices, key=lambda d: d.process_index):
        first.setdefault(node_of(d.process_index), len(first))
    ordered = sorted(devices, key=lambda d: (first[node_of(d.process_index)], d.process_index, d.id))
    counts = {n: sum(first[node_of(d.process_index)] == n for d in devices) for n in first.values()}
    per_node = min(counts.values())
    if len(set(counts.values())) > 1:
        raise ConfigError(f"nodes hold different numbers of devices ({sorted(counts.values())}); give every node "
                          f"the same number of processes and devices.")
    if len(counts) > 1 and per_node % tensor:
        raise ConfigError(f"mesh.tensor={tensor} does not divide the {per_node} devices of a node, so tensor-parallel "
                          f"traffic would cross the network; use a tensor size dividing {per_node}.")
    return ordered
