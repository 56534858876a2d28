"""Context parallelism's step time and memory against the sequence length: the train step at context 1, 2 and 4 for
each `--seq_lens`, on the devices present; prints JSON (and writes it with --out).

    python bench/context.py [--seq_lens 512,1024,2048] [--contexts 1,2,4] [--embed 256] [--layers 2] [--steps 3]

A llama (GQA: 4 query heads per KV head) with full recompute, one sequence per context group: the mesh is
(data = devices / context, context); `peak_bytes` is XLA's per-device peak (`compile_report.memory_bytes`). At context
1 the attention is XLA's (its [heads, seq, seq] scores); at context > 1 each device holds seq / context tokens and the
blockwise kernel attends over the gathered K/V. On 8 fake CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=8) every device shares the same cores: the times measure total
work; on a GPU server they are the numbers to compare (cuDNN's fused kernel at context 1).
"""
import json
import os
import sys

import jax
from absl import app, flags, logging

from jaxpar.config import base_config
from jaxpar.plan.measure import time_step

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_results  # noqa: E402

_SEQ = flags.DEFINE_list("seq_lens", ["512", "1024", "2048"], "sequence lengths")
_CP = flags.DEFINE_list("contexts", ["1", "2", "4"], "context sizes")
_D = flags.DEFINE_integer("embed", 256, "model width (heads of 64)")
_L = flags.DEFINE_integer("layers", 2, "layers")
_DTYPE = flags.DEFINE_string("dtype", "float32", "compute dtype (bfloat16 on GPU)")
_STEPS = flags.DEFINE_integer("steps", 3, "timed steps")
_OUT = flags.DEFINE_string("out", "", "directory for context.json / context.md")
VOCAB = 256


def config_for(seq: int, cp: int):
    c = base_config()
    n = jax.device_count()
    heads = max(4, _D.value // 64)
    c.mesh.update(data=n // cp, context=cp)
    c.model.update(arch="llama", embed=_D.value, layers=_L.value, heads=heads, kv_heads=heads // 4, seq_len=seq,
                   max_positions=seq, vocab_size=VOCAB, remat="full")
    c.train.update(global_batch_size=n // cp, microbatches=1, compute_dtype=_DTYPE.value)
    c.log.progress = False
    return c


def one(seq: int, cp: int) -> dict:
    got = time_step(config_for(seq, cp), VOCAB, steps=_STEPS.value)
    return {"seq_len": seq, "context": cp, "mesh": got["mesh"], "step_s": got["step_s"], "loss": got["loss"],
            "peak_bytes": got["memory"].get("peak"), "tokens_per_s": jax.device_count() // cp * seq / got["step_s"]}


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    rows = [one(int(s), int(c)) for s in _SEQ.value for c in _CP.value if jax.device_count() % int(c) == 0]
    out = {"devices": jax.device_count(), "device_kind": jax.devices()[0].device_kind, "embed": _D.value,
           "layers": _L.value, "dtype": _DTYPE.value, "rows": rows}
    print(json.dumps(out, indent=1))
    table = "| seq | context | step s | tokens/s | peak MiB per device |\n|---|---|---|---|---|\n" + "\n".join(
        f"| {r['seq_len']} | {r['context']} | {r['step_s']:.4f} | {r['tokens_per_s']:.0f} | "
        f"{r['peak_bytes'] / 2 ** 20:.1f} |" for r in rows)
    write_results(_OUT.value, "context", [out], table)


if __name__ == "__main__":
    app.run(main)
