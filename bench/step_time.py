"""Time the compiled train step of a config on random tokens and print JSON.

    python bench/step_time.py --config configs/shakespeare.py [--config.KEY=VALUE ...] [--steps 10] [--vocab 256]

Prints: tokens/s (whole job), step time (s), achieved TFLOP/s per device (PaLM model FLOPs: 6N + 12·L·d·T per
token), MFU where the device's peak is known, and per-device bytes of the compiled step from XLA's memory analysis
(arguments, outputs, temporaries, generated code, peak = arguments + outputs + temporaries - aliased).
On fake CPU devices all devices share the host's cores: use the numbers for ratios, not absolute speed.
"""
import json
import time

import jax
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

from jaxpar import metrics
from jaxpar.config import validate
from jaxpar.mesh import make_mesh
from jaxpar.report import memory_bytes
from jaxpar.step import build
from jaxpar.model import flops_per_token

_CONFIG = config_flags.DEFINE_config_file("config", None, "config file")
_STEPS = flags.DEFINE_integer("steps", 10, "timed steps (after one warm-up step)")
_VOCAB = flags.DEFINE_integer("vocab", 256, "vocabulary size when config.model.vocab_size is 0")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    config = _CONFIG.value
    shape = validate(config, jax.device_count())
    vocab = int(config.model.vocab_size) or _VOCAB.value
    steps = build(config, make_mesh(shape), vocab)
    B, T = int(config.train.global_batch_size), int(config.model.seq_len)
    rng = np.random.default_rng(0)
    batch = {"tokens": jax.device_put(rng.integers(0, vocab, (B, T + 1), dtype=np.int32), steps.batch_sharding)}
    state = steps.init(int(config.train.seed))
    t0 = time.perf_counter()
    compiled = steps.train.lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    state, m = steps.train(state, batch)
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for _ in range(_STEPS.value):
        state, m = steps.train(state, batch)
    jax.block_until_ready(m)
    dt = (time.perf_counter() - t0) / _STEPS.value
    ndev = jax.device_count()
    fpt = flops_per_token(steps.cfg)
    tps = B * T / dt
    print(json.dumps({
        "config": config.name, "mesh": dict(steps.mesh.shape), "devices": ndev,
        "device_kind": jax.devices()[0].device_kind, "global_batch": B, "seq_len": T,
        "microbatches": int(config.train.microbatches), "compile_s": compile_s, "step_s": dt, "tokens_per_s": tps,
        "model_flops_per_token": fpt, "tflops_per_device": metrics.tflops_per_device(tps, fpt, ndev),
        "mfu": metrics.mfu(tps, fpt, ndev, metrics.peak_flops(jax.devices()[0].device_kind)),
        "bytes_per_device": memory_bytes(compiled),
    }, indent=2))


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    app.run(main)
