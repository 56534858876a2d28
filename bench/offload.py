"""Host offload's price and saving: the train step with `optim.offload` none / optimizer / params (and activation
offload, `model.remat=offload`, against `selective`), its step time and its device and host bytes per device, and the
host link's measured bandwidth; prints JSON (and writes it with --out).

    python bench/offload.py [--embed 1024] [--layers 8] [--seq_len 1024] [--batch 8] [--steps 5]

On the devices present: a GPU server's GPUs (where XLA reports device and host memory apart and the transfers cross
PCIe: the numbers users want), or 8 fake CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8; XLA:CPU
drops the transfers, so there the device bytes are XLA's less the host-resident state and the times barely differ:
`compile_report.placement`). The layout is data-parallel over every device with ZeRO 1 (`--zero`).
"""
import json
import os
import sys
import time

import jax
import numpy as np
from absl import app, flags, logging

from jaxpar.config import base_config
from jaxpar.plan.measure import time_step

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_results  # noqa: E402

_D = flags.DEFINE_integer("embed", 256, "model width (heads of 64)")
_L = flags.DEFINE_integer("layers", 4, "layers")
_T = flags.DEFINE_integer("seq_len", 256, "sequence length")
_B = flags.DEFINE_integer("batch", 16, "global batch (sequences)")
_Z = flags.DEFINE_integer("zero", 1, "ZeRO stage")
_DTYPE = flags.DEFINE_string("dtype", "float32", "compute dtype (bfloat16 on GPU); weights float32")
_STEPS = flags.DEFINE_integer("steps", 5, "timed steps")
_LINK_MB = flags.DEFINE_integer("link_mb", 256, "MiB moved to measure the host link")
_OUT = flags.DEFINE_string("out", "", "directory for offload.json / offload.md")
VOCAB = 256
CASES = [("none", "selective"), ("optimizer", "selective"), ("params", "selective"), ("none", "offload")]


def config_for(offload: str, remat: str):
    c = base_config()
    c.mesh.update(data=jax.device_count())
    c.model.update(arch="llama", embed=_D.value, layers=_L.value, heads=max(1, _D.value // 64), seq_len=_T.value,
                   vocab_size=VOCAB, remat=remat)
    c.train.update(global_batch_size=_B.value, microbatches=1, compute_dtype=_DTYPE.value)
    c.optim.update(zero_stage=_Z.value, offload=offload)
    c.log.progress = False
    return c


def host_link() -> dict:
    """GB/s of one device's copies between pinned host memory and the device, each direction (median of 5)."""
    dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    host = dev.with_memory_kind("pinned_host")
    x = jax.device_put(np.ones(_LINK_MB.value * 2 ** 18, np.float32), host)
    out = {}
    for name, src, dst in (("to_device", x, dev), ("to_host", jax.device_put(x, dev), host)):
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            jax.block_until_ready(jax.device_put(src, dst))
            times.append(time.perf_counter() - t0)
        out[f"{name}_gb_s"] = x.nbytes / sorted(times)[2] / 1e9
    return out


def one(offload: str, remat: str) -> dict:
    got = time_step(config_for(offload, remat), VOCAB, steps=_STEPS.value)
    pl = got["placement"]
    return {"offload": offload, "remat": remat, "step_s": got["step_s"], "loss": got["loss"],
            "device_bytes": pl["device"], "host_bytes": pl["host"], "bytes_source": pl["source"],
            "xla_peak_bytes": got["memory"].get("peak")}


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    rows = [one(o, r) for o, r in CASES]
    base = rows[0]
    for r in rows:
        r["step_over_none"] = r["step_s"] / base["step_s"]
        r["device_bytes_saved"] = base["device_bytes"] - r["device_bytes"]
    out = {"devices": jax.device_count(), "device_kind": jax.devices()[0].device_kind, "embed": _D.value,
           "layers": _L.value, "seq_len": _T.value, "batch": _B.value, "zero": _Z.value, "dtype": _DTYPE.value,
           "host_link": host_link(), "rows": rows, "same_loss": len({r["loss"] for r in rows[:3]}) == 1}
    print(json.dumps(out, indent=1))
    gib = lambda b: f"{b / 2 ** 30:.3f}"  # noqa: E731
    table = ("| optim.offload | model.remat | step s | x none | device GiB | host GiB | bytes from |\n"
             "|---|---|---|---|---|---|---|\n" + "\n".join(
                 f"| {r['offload']} | {r['remat']} | {r['step_s']:.4f} | {r['step_over_none']:.2f} | "
                 f"{gib(r['device_bytes'])} | {gib(r['host_bytes'])} | {r['bytes_source']} |" for r in rows))
    write_results(_OUT.value, "offload", [out], table)


if __name__ == "__main__":
    app.run(main)
