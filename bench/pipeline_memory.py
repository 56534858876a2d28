"""Per-device activation memory of each pipeline schedule against the number of microbatches M (compile only).

    python bench/pipeline_memory.py [--stages 4] [--mult 1,2,4,8] [--micro_batch 8] [--seq_len 128] [--out_dir ...]

For S stages (mesh 1 x 1 x S on fake CPU devices) and M = S·k microbatches of `--micro_batch` sequences each, compiles
the train step of every schedule (`gpipe`, `circular` v = 2, `1f1b`, `1f1b` v = 2 interleaved, `zb_h1`) and reads
XLA's memory analysis per device: `peak_bytes` (argument + output + temp - alias) and `temp_bytes`. Nothing runs,
so the numbers do not depend on the host's load. Activations are the part that moves with M: GPipe and circular
(autodiff of the tick loop) keep every in-flight microbatch's stage inputs, O(M); 1F1B and ZB-H1 keep ring buffers
of O(v·S) entries, flat once M >= 2S. `stage_input_bytes` = micro_batch x seq_len x embed x 4 is the unit.

Prints a JSON list of rows (with `--markdown`, the table); writes pipeline_memory.{json,md,png} to `--out_dir`.
"""
import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from absl import app, flags, logging  # noqa: E402

from common import m_axis, write_results  # noqa: E402
from jaxpar.config import base_config  # noqa: E402
from jaxpar.compiled import steps_for  # noqa: E402
from jaxpar.analysis.compile_report import memory_bytes  # noqa: E402

_STAGES = flags.DEFINE_integer("stages", 4, "pipeline stages S")
_MULT = flags.DEFINE_list("mult", ["1", "2", "4", "8"], "microbatches M as multiples of S")
_MICRO = flags.DEFINE_integer("micro_batch", 8, "sequences per microbatch")
_SEQ = flags.DEFINE_integer("seq_len", 128, "sequence length")
_EMBED = flags.DEFINE_integer("embed", 64, "model width")
_LAYERS = flags.DEFINE_integer("layers", 16, "model layers")
_OUT = flags.DEFINE_string("out_dir", "bench/results", "where pipeline_memory.json/.md/.png go ('': nowhere)")
_MARKDOWN = flags.DEFINE_bool("markdown", False, "print the markdown table on stdout instead of the JSON")

SCHEDULES = [("gpipe", 1), ("circular", 2), ("1f1b", 1), ("1f1b", 2), ("zb_h1", 1)]


def measure(name, v, S, M) -> dict:
    c = base_config()
    c.model.update(vocab_size=256, seq_len=_SEQ.value, layers=_LAYERS.value, embed=_EMBED.value, heads=4,
                   mlp=4 * _EMBED.value)
    c.mesh.update(data=1, tensor=1, stage=S)
    c.train.update(global_batch_size=M * _MICRO.value, microbatches=M)
    c.pipeline.update(schedule=name, virtual_stages=v)
    devices = jax.devices()[:S]
    steps = steps_for(c, 256, devices)
    abstract = steps.abstract_state()
    batch = {"tokens": jax.ShapeDtypeStruct((M * _MICRO.value, _SEQ.value + 1), np.int32,
                                            sharding=steps.batch_sharding)}
    mem = memory_bytes(steps.train.lower(abstract, batch).compile())
    return {"schedule": name, "v": v, "S": S, "M": M, "peak_bytes": mem.get("peak"), "temp_bytes": mem.get("temp"),
            "stage_input_bytes": _MICRO.value * _SEQ.value * _EMBED.value * 4}


def markdown(rows) -> str:
    Ms = sorted({r["M"] for r in rows})
    out = ["| schedule | " + " | ".join(f"M={m}" for m in Ms) + " | growth M={}→{} (stage inputs) |".format(Ms[0], Ms[-1]),
           "|---|" + "---:|" * (len(Ms) + 1)]
    for name, v in SCHEDULES:
        rs = {r["M"]: r for r in rows if (r["schedule"], r["v"]) == (name, v)}
        label = name + (f" v={v}" if v > 1 else "")
        cells = [f"{rs[m]['peak_bytes'] / 2**20:.1f}" for m in Ms]
        grow = (rs[Ms[-1]]["peak_bytes"] - rs[Ms[0]]["peak_bytes"]) / rs[Ms[0]]["stage_input_bytes"]
        out.append(f"| {label} | " + " | ".join(cells) + f" | {grow:+.1f} |")
    return "\n".join(out)


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, v in SCHEDULES:
        rs = sorted((r for r in rows if (r["schedule"], r["v"]) == (name, v)), key=lambda r: r["M"])
        ax.plot([r["M"] for r in rs], [r["peak_bytes"] / 2**20 for r in rs], "-o",
                label=name + (f" v={v}" if v > 1 else ""))
    ms = sorted({r["M"] for r in rows})
    m_axis(ax, ms)
    ax.set(title=f"per-device peak bytes, S={rows[0]['S']}, {_MICRO.value} x {_SEQ.value} tokens per microbatch",
           xlabel="microbatches M", ylabel="MiB")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    S = _STAGES.value
    rows = []
    for name, v in SCHEDULES:
        for k in (int(k) for k in _MULT.value):
            rows.append(measure(name, v, S, S * k))
            print(f"{name} v={v} M={S * k}: peak {rows[-1]['peak_bytes'] / 2**20:.2f} MiB", file=sys.stderr,
                  flush=True)
    table = markdown(rows)
    print(table, file=sys.stderr)
    write_results(_OUT.value, "pipeline_memory", rows, table, plot)
    print(table if _MARKDOWN.value else json.dumps(rows, indent=1))


if __name__ == "__main__":
    app.run(main)
