"""Time the compiled train step of a config on random tokens and print JSON.

    python bench/step_time.py --config configs/shakespeare.py [--config.KEY=VALUE ...] [--steps 10] [--vocab 256]

Prints: tokens/s (whole job), step time (s), achieved TFLOP/s per device (PaLM model FLOPs: 6N + 12·L·d·T per
token), MFU where the device's peak is known, and per-device bytes of the compiled step from XLA's memory analysis
(arguments, outputs, temporaries, generated code, peak = arguments + outputs + temporaries - aliased).
On fake CPU devices all devices share the host's cores: use the numbers for ratios, not absolute speed.
"""
import json

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from jaxpar.analysis import throughput
from jaxpar.model import flops_per_token
from jaxpar.plan.measure import time_step

_CONFIG = config_flags.DEFINE_config_file("config", None, "config file")
_STEPS = flags.DEFINE_integer("steps", 10, "timed steps (after one warm-up step)")
_VOCAB = flags.DEFINE_integer("vocab", 256, "vocabulary size when config.model.vocab_size is 0")


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    config = _CONFIG.value
    vocab = int(config.model.vocab_size) or _VOCAB.value
    got = time_step(config, vocab, steps=_STEPS.value)
    B, T = int(config.train.global_batch_size), int(config.model.seq_len)
    dt, ndev = got["step_s"], jax.device_count()
    fpt = flops_per_token(got["steps"].cfg)
    tps = B * T / dt
    print(json.dumps({
        "config": config.name, "mesh": got["mesh"], "devices": ndev,
        "device_kind": got["device_kind"], "global_batch": B, "seq_len": T,
        "microbatches": int(config.train.microbatches), "compile_s": got["compile_s"], "step_s": dt,
        "tokens_per_s": tps, "model_flops_per_token": fpt, "tflops_per_device": throughput.tflops_per_device(tps, fpt, ndev),
        "mfu": throughput.mfu(tps, fpt, ndev, throughput.peak_flops(got["device_kind"])),
        "bytes_per_device": got["memory"],
    }, indent=2))


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    app.run(main)
