"""What the processes of a multi-host run hand each other outside the compiled steps: a device array's whole value on
every process (`fetch`), each process's share of a list of items (`share`), and small JSON values gathered from every
process (`gather_json`, through the coordination service's key-value store). Each is called by every process in the
same order (the program's own order, as every collective is); with one process each is the plain one-process value.
"""
from __future__ import annotations

import itertools
import json

_calls = itertools.count()  # (the keys of `gather_json`: the n-th call of every process meets the others' n-th)


def fetch(tree):
    """`jax.device_get` on every process, also of arrays that span other processes' devices (gathered: each process
    gets the whole global value)."""
    import jax

    if all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(tree)):
        return jax.device_get(tree)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


def share(n: int, unit: int = 1) -> tuple[int, int]:
    """(lo, hi): the items [lo, hi) of n that this process takes, in whole units of `unit` items (a group's
    completions stay on one process), as evenly as the units allow, the first processes taking one more."""
    import jax

    p = jax.process_index()
    units, extra = divmod(n // unit, jax.process_count())
    start = p * units + min(p, extra)
    return start * unit, (start + units + (p < extra)) * unit


def gather_json(value) -> list:
    """Every process's `value` (JSON-able), in process order."""
    import jax

    if jax.process_count() == 1:
        return [value]
    from jax._src import distributed as jax_distributed

    client, key = jax_distributed.global_state.client, f"jaxpar/gather/{next(_calls)}"
    client.key_value_set(f"{key}/{jax.process_index()}", json.dumps(value))
    return [json.loads(client.blocking_key_value_get(f"{key}/{p}", 24 * 3600 * 1000))
            for p in range(jax.process_count())]
