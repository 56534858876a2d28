"""Host memory of a Hugging Face import onto 8 fake CPU devices, against reading the whole state dict at once.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python bench/hf_import.py [--dir /tmp/hf_1g] [--out bench/results]

Builds (once, in --dir) a Llama checkpoint of about 1.2 GB, float32 random weights, in 400 MB shards: d 1024,
16 layers, 16 heads, 4 KV heads, MLP 4096, vocab 32000 (largest tensor: the 131 MB embedding). Then, each in a fresh
process, places it on a (data 2, tensor 2, stage 2) mesh:
  * `jaxpar`: `jaxpar.formats.hf.load_params` (per device the slices it holds, one layer at a time);
  * `whole`: `safetensors.numpy.load_file` of every shard, then the same placement from those host arrays.
Prints JSON: per mode the peak RSS (ru_maxrss), the RSS before the import (the process with JAX up: the fixed
overhead), the bytes resident on the devices after it (fake CPU devices live in host memory), and
`import_overhead` = peak - before - device bytes, also as a multiple of the largest tensor.
"""
import argparse
import json
import os
import resource
import subprocess
import sys

import numpy as np

SHAPE = dict(embed=1024, layers=16, heads=16, kv_heads=4, mlp=4096, vocab=32000)


def build(directory: str) -> None:
    from jaxpar.data import ByteTokenizer
    from jaxpar.formats.hf import files, hf_config, keys, layer_names
    from jaxpar.model import ModelConfig

    if os.path.isfile(os.path.join(directory, "config.json")):
        return
    os.makedirs(directory, exist_ok=True)
    s = SHAPE
    cfg = ModelConfig(vocab_size=s["vocab"], vocab_real=s["vocab"], seq_len=128, layers=s["layers"], embed=s["embed"],
                    heads=s["heads"], kv_heads=s["kv_heads"], mlp=s["mlp"], arch="llama", tie_embeddings=False)
    rng = np.random.default_rng(0)
    hd = s["embed"] // s["heads"]
    one = {"wte": (s["vocab"], s["embed"]), "lm_head": (s["embed"], s["vocab"]), "ln_f.scale": (s["embed"],),
           "blocks.ln1.scale": (s["embed"],), "blocks.ln2.scale": (s["embed"],),
           "blocks.wq": (s["embed"], s["heads"], hd), "blocks.wk": (s["embed"], s["kv_heads"], hd),
           "blocks.wv": (s["embed"], s["kv_heads"], hd), "blocks.wo": (s["heads"], hd, s["embed"]),
           "blocks.w_gate": (s["embed"], s["mlp"]), "blocks.w_up": (s["embed"], s["mlp"]),
           "blocks.w_down": (s["mlp"], s["embed"])}

    def tensors():
        for m in keys.llama_maps(False):
            for name in layer_names(m, s["layers"]):
                a = (rng.standard_normal(one[m.ours], np.float32) * 0.02).astype(np.float32)
                yield name, keys.to_hf(m, a, s["vocab"])

    files.write(directory, tensors(), 400 * 10 ** 6)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(hf_config(cfg, "float32"), f)
    ByteTokenizer.to_hf().save(os.path.join(directory, "tokenizer.json"))


def rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(directory: str, mode: str) -> dict:
    import jax

    from jaxpar.formats import hf
    from jaxpar.config import base_config
    from jaxpar.validate import validate
    from jaxpar.formats.hf import files
    from jaxpar.parallel.mesh import make_mesh
    from jaxpar.train.step import build as build_steps

    c = base_config()
    c.init_from = f"hf:{directory}"
    c.mesh.update(data=2, tensor=2, stage=2)
    c.model.seq_len = 128
    c.train.update(microbatches=2, global_batch_size=8)
    c = hf.apply(c)
    steps = build_steps(c, make_mesh(validate(c, 8)), c.model.vocab_size)
    shardings = steps.state_shardings["params"]
    jax.block_until_ready(jax.device_put(np.zeros(4), jax.devices()[0]) + 1)
    before = rss_peak()
    if mode == "jaxpar":
        params = hf.load_params(directory, steps.cfg, shardings, steps.layer_order)
    else:
        params = _whole(directory, steps.cfg, shardings)
    jax.block_until_ready(params)
    peak = rss_peak()
    dev = sum(s.data.nbytes for a in jax.tree.leaves(params) for s in a.addressable_shards)
    largest = max(int(np.prod(v.shape)) * 4 for v in files.tensors(directory).values())
    over = peak - before - dev
    return {"mode": mode, "peak_rss_bytes": peak, "rss_before_bytes": before, "device_bytes": dev,
            "checkpoint_bytes": sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory)
                                    if n.endswith(".safetensors")),
            "largest_tensor_bytes": largest, "import_overhead_bytes": over,
            "overhead_over_largest_tensor": round(over / largest, 3)}


def _whole(directory, cfg, shardings):
    """The baseline: every shard read whole into host memory (`load_file`), each leaf assembled on the host, then
    placed with its sharding."""
    import jax

    from jaxpar.formats import hf
    from jaxpar.export import _items, unflatten
    from jaxpar.formats.hf import keys
    from jaxpar.model import init_params
    from safetensors.numpy import load_file

    state = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            state.update(load_file(os.path.join(directory, name)))
    shapes, sh, flat = dict(_items(jax.eval_shape(lambda: init_params(cfg, jax.random.key(0))))), \
        dict(_items(shardings)), {}
    for m in hf.maps(cfg):
        one = tuple(shapes[m.ours].shape[1:] if m.per_layer else shapes[m.ours].shape)
        whole = tuple(slice(None) for _ in one)
        part = lambda name: keys.block_of(m, one, whole, lambda box: state[name][box], cfg.vocab_real)
        names = hf.layer_names(m, cfg.layers)
        full = np.stack([part(n) for n in names]) if m.per_layer else part(names[0])
        flat[m.ours] = jax.device_put(full, sh[m.ours])
    return unflatten(flat)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/jaxpar_hf_1g")
    ap.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="", help="write bench results (JSON, markdown) here")
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(measure(args.dir, args.mode)))
        return
    build(args.dir)
    rows = []
    for mode in ("jaxpar", "whole"):
        r = subprocess.run([sys.executable, __file__, "--dir", args.dir, "--mode", mode], capture_output=True,
                           text=True, check=True)
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    print(json.dumps(rows, indent=1))
    if args.out:
        from common import write_results

        mib = lambda b: f"{b / 2 ** 20:,.0f}"
        table = "\n".join(["| mode | checkpoint MiB | largest tensor MiB | on devices MiB | RSS before MiB "
                           "| peak RSS MiB | import overhead MiB (x largest) |", "|---|---|---|---|---|---|---|"] + [
            f"| {r['mode']} | {mib(r['checkpoint_bytes'])} | {mib(r['largest_tensor_bytes'])} | "
            f"{mib(r['device_bytes'])} | {mib(r['rss_before_bytes'])} | {mib(r['peak_rss_bytes'])} | "
            f"{mib(r['import_overhead_bytes'])} ({r['overhead_over_largest_tensor']}) |" for r in rows])
        write_results(args.out, "hf_import", rows, table)


if __name__ == "__main__":
    main()
