"""The device mesh `(data, stage, tensor)`: tensor on neighbouring devices (the fastest links), data outermost.

`make_mesh(shape)` takes the resolved sizes from `config.validate`. With several processes (hosts) the mesh is a
hybrid one: `tensor` (and, when it fits, `stage`) stays inside a host, `data` spans hosts, so tensor-parallel traffic
never crosses the network.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("data", "stage", "tensor")


def make_mesh(shape: dict[str, int], devices=None) -> Mesh:
    """Mesh with axes `AXES`, sizes `shape` ({'data', 'stage', 'tensor'}), axis types Auto (compiler-propagated).

    Raises:
      ValueError: the product of the sizes differs from the number of devices.
    """
    devices = list(jax.devices() if devices is None else devices)
    sizes = tuple(int(shape[a]) for a in AXES)
    if int(np.prod(sizes)) != len(devices):
        raise ValueError(f"mesh {dict(zip(AXES, sizes))} needs {int(np.prod(sizes))} devices, have {len(devices)}")
    nproc = len({d.process_index for d in devices})
    if nproc > 1:
        from jax.experimental import mesh_utils

        per_host = len(devices) // nproc
        t = sizes[2]
        s_in = sizes[1] if per_host % (t * sizes[1]) == 0 else 1
        inner = (per_host // (t * s_in), s_in, t)
        outer = (sizes[0] // inner[0], sizes[1] // s_in, 1)
        grid = mesh_utils.create_hybrid_device_mesh(inner, outer, devices, process_is_granule=True)
    else:
        # sorted by id: on GPU servers neighbouring ids share the fastest links (NVLink / NVSwitch)
        devices = sorted(devices, key=lambda d: d.id)
        grid = np.asarray(devices, dtype=object).reshape(sizes)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 3)
