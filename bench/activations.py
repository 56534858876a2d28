"""Activation bytes per layer per device, compiled, against Korthikanti et al. 2022's formulas (sec. 4, eq. 1-2, 4-6).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/activations.py [--out bench/results]

Measured: XLA's temporaries of the compiled loss-and-grads (no optimizer) with L = 4 minus L = 2 layers, over 2:
what one more layer keeps for its backward pass (the scan stacks it per layer), float32, on (data 1, tensor t).
Formulas (their 16-bit activations, 1-byte masks), for jaxpar's block: no attention dropout and dropout 0, so their
mask terms and the dropout output (2 sbh + 3 as²b of 34 sbh + 5 as²b) drop; float32 doubles the rest:
  no parallelism           (32 sbh + 2 as²b) x 2          = 64 sbh + 4 as²b
  tensor t                 (8 sbh + (24 sbh + 2 as²b)/t) x 2
  tensor t + SP            (32 sbh + 2 as²b)/t x 2
  selective recompute      the as²b terms go (eq. 6)
  full recompute           the layer input only, 2 sbh x 2 (/t with SP)
s = seq, b = batch, h = embed, a = heads. Prints JSON rows and a markdown table.
"""
import argparse
import json
import sys

import jax
import numpy as np

from common import write_results
from jaxpar import config as jcfg
from jaxpar.compiled import steps_for

S, B, H, A, V = 512, 4, 256, 4, 256


def formula(t: int, sp: bool, remat: str) -> float:
    sbh, as2b = S * B * H, A * S * S * B
    if remat == "full":  # only the layer input (sec. 4.3: 2 sbh)
        return 2 * 2 * sbh / (t if sp else 1)
    attn = 0 if remat == "selective" else 2 * as2b
    if t == 1 or sp:
        return 2 * (32 * sbh + attn) / t
    return 2 * (8 * sbh + (24 * sbh + attn) / t)


def temp_bytes(t: int, sp: bool, remat: str, layers: int) -> int:
    c = jcfg.base_config()
    c.model.update(seq_len=S, layers=layers, embed=H, heads=A, vocab_size=V, remat=remat, sequence_parallel=sp,
                   loss_chunk=S, attention="xla")
    c.mesh.update(data=1, tensor=t, stage=1)
    c.train.update(global_batch_size=B, microbatches=1)
    steps = steps_for(c, V, jax.devices()[:t])
    params = jax.eval_shape(steps.init, 0)["params"]
    params = jax.tree.map(lambda a, sh: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh), params,
                          steps.state_shardings["params"])
    batch = {"tokens": jax.ShapeDtypeStruct((B, S + 1), np.int32, sharding=steps.batch_sharding)}
    return jax.jit(steps.grads).lower(params, batch).compile().memory_analysis().temp_size_in_bytes


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    rows = []
    for t, sp in ((1, False), (4, False), (4, True)):
        for remat in ("none", "selective", "full"):
            per_layer = (temp_bytes(t, sp, remat, 4) - temp_bytes(t, sp, remat, 2)) / 2
            f = formula(t, sp, remat)
            rows.append({"tensor": t, "sequence_parallel": sp, "remat": remat, "measured_bytes": per_layer,
                         "formula_bytes": f, "ratio": per_layer / f})
            print(json.dumps(rows[-1]), file=sys.stderr)
    table = "\n".join(["| tensor | SP | remat | measured MiB/layer | formula MiB/layer | measured / formula |",
                       "|---|---|---|---|---|---|"] +
                      [f"| {r['tensor']} | {'on' if r['sequence_parallel'] else 'off'} | {r['remat']} | "
                       f"{r['measured_bytes'] / 2**20:.2f} | {r['formula_bytes'] / 2**20:.2f} | {r['ratio']:.2f} |"
                       for r in rows])
    print(json.dumps(rows, indent=1))
    print(table)
    write_results(args.out, "activations", rows, table)


if __name__ == "__main__":
    main()
