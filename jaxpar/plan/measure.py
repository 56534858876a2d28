"""Time a config's real train step on the devices present (random tokens; one warm-up step, then `steps` timed)."""
from __future__ import annotations

import time

import jax
import numpy as np

from jaxpar.compiled import steps_for
from jaxpar.analysis.compile_report import host_state_bytes, memory_bytes, placement


def time_step(config, vocab: int, steps: int = 5, devices=None) -> dict:
    """-> {"step_s", "compile_s", "loss", "memory" (XLA's per-device bytes), "placement" (device and host bytes,
    `compile_report.placement`), "mesh", "device_kind"}; step_s is the mean over `steps` steps after a warm-up
    step."""
    devices = list(jax.devices() if devices is None else devices)
    built = steps_for(config, vocab, devices)
    B, T = int(config.train.global_batch_size), int(config.model.seq_len)
    rng = np.random.default_rng(0)
    batch = {"tokens": jax.device_put(rng.integers(0, vocab, (B, T + 1), dtype=np.int32), built.batch_sharding)}
    state = built.init(int(config.train.seed))
    t0 = time.perf_counter()
    compiled = built.train.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    memory = memory_bytes(compiled)
    placed = placement(memory, host_state_bytes(state))
    state, m = built.train(state, batch)
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for _ in range(steps):
        state, m = built.train(state, batch)
    jax.block_until_ready(m)
    return {"step_s": (time.perf_counter() - t0) / steps, "compile_s": compile_s, "loss": float(m["loss"]),
            "memory": memory, "placement": placed, "mesh": dict(built.mesh.shape), "steps": built,
            "device_kind": devices[0].device_kind}
