"""One-GPU speed and memory bench: tokens/s, TFLOP/s, MFU and peak memory of the train step, about 8 minutes.

    python bench/gpu.py --out bench/results            # on a machine with one GPU
    python bench/gpu.py --smoke                        # the same logic on tiny models (CPU: checks the script)

On a GPU image without ml-collections (e.g. the lent H200s), carry its wheel and install it first:
    pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl ml-collections==1.1.0   # here
    pip install -q --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site:. python bench/gpu.py ...

Runs, all bf16 compute / float32 params and AdamW (ZeRO 0, one device), random tokens:
  - GPT 1.3B (Megatron's: 24 layers, d 2048, 16 heads, vocab 50304), seq 2048: attention xla vs auto (the fused
    kernel `model.attention=auto` picks: cuDNN) x remat none / selective / full;
  - GPT-2 124M and 350M (seq 1024) and a Llama-3.2-1B-shaped model (seq 2048): auto attention, selective remat.
The batch is sized to fill memory (at most 64 sequences): an estimate from Korthikanti et al.'s per-layer bytes and
the loss chunk's logits (`model.loss_chunk` 256 here), then the compiled step's own peak (XLA's memory analysis)
scales it down if it would not fit in 92 % of the device. No run starts after `BUDGET_S` (400 s); the loss check
only if time is left. MFU = model FLOPs/s /
the device's dense bf16 peak (`PEAK_TFLOPS`); model FLOPs per token: PaLM's 6N + 12·L·d·T ("palm"), and with the
attention term halved for the causal mask ("causal", 6N + 6·L·d·T); n/a on a device without a known peak. A last
pair of runs evaluates the 1.3B model's loss on one batch with XLA's and the fused attention: "agree" is a relative
difference below 2e-2 (bf16 noise on a loss of ~11 nats is ~1e-3).
Prints one JSON object (rows, loss check, device, versions) and a markdown table; --out writes gpu.{json,md}.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jaxpar.cluster.runtime import GPU_FLAGS, known_flags, merged_flags  # noqa: E402  (no jax backend yet)

if "--smoke" not in sys.argv:
    os.environ["XLA_FLAGS"] = merged_flags(os.environ.get("XLA_FLAGS", ""), known_flags(GPU_FLAGS))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxpar import config as jcfg  # noqa: E402
from jaxpar.kernels import attention
from jaxpar.compiled import steps_for  # noqa: E402
from jaxpar import model as gpt  # noqa: E402
from jaxpar.analysis.compile_report import memory_bytes  # noqa: E402

# dense bf16 TFLOP/s (NVIDIA datasheets; H200 = H100 SXM's core), matched in this order against the device kind
PEAK_TFLOPS = {"H100 PCIe": 756.0, "H200": 989.0, "H100": 989.0, "A100": 312.0}
BUDGET_S = 400.0  # no run starts after this
LOSS_CHUNK, MAX_BATCH = 256, 64

MODELS = {  # name: (model keys, seq)
    "gpt-1.3b": (dict(layers=24, embed=2048, heads=16, vocab_size=50304), 2048),
    "gpt2-124m": (dict(layers=12, embed=768, heads=12, vocab_size=50304), 1024),
    "gpt2-350m": (dict(layers=24, embed=1024, heads=16, vocab_size=50304), 1024),
    "llama-1b": (dict(arch="llama", layers=16, embed=2048, heads=32, kv_heads=8, mlp=8192, vocab_size=128256,
                      rope_theta=500000.0), 2048),
}
SMOKE = {k: (dict(v[0], layers=2, embed=64, heads=4, vocab_size=512, **({"mlp": 128, "kv_heads": 2} if "mlp" in v[0] else {})), 128)
         for k, v in MODELS.items()}
RUNS = ([("gpt-1.3b", a, r) for a in ("xla", "auto") for r in ("none", "selective", "full")]
        + [(m, "auto", "selective") for m in ("gpt2-124m", "gpt2-350m", "llama-1b")])
BYTES_PER_LAYER_SBH = {"none": 70, "selective": 34, "full": 4}  # bf16 bytes per seq·embed element per layer


def config_for(name, attn, remat, batch, models):
    keys, seq = models[name]
    c = jcfg.base_config()
    c.model.update(seq_len=seq, remat=remat, attention=attn, loss_chunk=LOSS_CHUNK, **keys)
    c.train.update(global_batch_size=batch, microbatches=1, param_dtype="float32", compute_dtype="bfloat16")
    c.mesh.update(data=1, tensor=1, stage=1)
    return c


def estimate_batch(c, free_bytes: float) -> int:
    """Sequences that fit: activations per sequence from Korthikanti et al.'s per-layer count (+ XLA's attention
    scores when not recomputed) and one loss chunk's logits (float32 z, exp, bf16 dz: ~10 bytes per entry), after
    16 bytes per parameter of state (params, 2 Adam moments, grads)."""
    m = c.model
    per_seq = m.layers * m.seq_len * m.embed * BYTES_PER_LAYER_SBH[m.remat] + 10 * m.loss_chunk * m.vocab_size
    if m.attention == "xla" and m.remat == "none":
        per_seq += m.layers * 3 * 4 * m.heads * m.seq_len ** 2  # scores, probs, exp in float32
    cfg = gpt.config_from(c, m.vocab_size, 1)
    params = (gpt.flops_per_token(cfg) - 12 * cfg.layers * cfg.embed * cfg.seq_len) / 6  # N
    return max(1, int((free_bytes - 16 * params) * 0.8 // per_seq))


def device_memory() -> float:
    stats = jax.devices()[0].memory_stats() or {}
    return float(stats.get("bytes_limit", 16 * 2**30))


def compiled_for(c, vocab):
    steps = steps_for(c, vocab, jax.devices()[:1])
    state = steps.init(0)
    B, T = c.train.global_batch_size, c.model.seq_len
    tokens = np.random.default_rng(0).integers(0, vocab, (B, T + 1), dtype=np.int32)
    batch = {"tokens": jax.device_put(tokens, steps.batch_sharding)}
    t0 = time.time()
    compiled = steps.train.lower(state, batch).compile()
    return steps, state, batch, compiled, time.time() - t0


def fit(c, vocab, limit, tries: int = 3):
    """Compile at the estimated batch; shrink it (recompiling) while XLA's peak exceeds 92 % of the device."""
    for i in range(tries):
        steps, state, batch, compiled, compile_s = compiled_for(c, vocab)
        peak = memory_bytes(compiled).get("peak", 0)
        b = c.train.global_batch_size
        if peak <= 0.92 * limit or b == 1 or i == tries - 1:
            return steps, state, batch, compiled, compile_s, peak
        c.train.global_batch_size = max(1, int(b * 0.9 * limit / peak))
        del steps, state, batch, compiled


def time_steps(compiled, state, batch, n: int):
    for _ in range(2):  # warm-up
        state, m = compiled(state, batch)
    jax.block_until_ready(m["loss"])
    t0 = time.time()
    for _ in range(n):
        state, m = compiled(state, batch)
    jax.block_until_ready(m["loss"])
    return (time.time() - t0) / n, float(m["loss"]), state


def one_run(name, attn, remat, models, limit, peak_tflops, n_steps, max_batch):
    c = config_for(name, attn, remat, 1, models)
    c.train.global_batch_size = min(max_batch, estimate_batch(c, limit))
    vocab = int(c.model.vocab_size)
    steps, state, batch, compiled, compile_s, xla_peak = fit(c, vocab, limit)
    dt, loss, state = time_steps(compiled, state, batch, n_steps)
    cfg, B, T = steps.cfg, c.train.global_batch_size, c.model.seq_len
    palm = gpt.flops_per_token(cfg)
    causal = palm - 6 * cfg.layers * cfg.embed * T
    tok_s = B * T / dt
    kernel = attention.choose(attn, "bfloat16", T, cfg.head_dim, False)[0]
    stats = jax.devices()[0].memory_stats() or {}
    row = {"model": name, "attention": attn, "kernel": kernel, "remat": remat, "batch": B, "seq": T,
           "step_s": dt, "tokens_per_s": tok_s, "tflops_palm": palm * tok_s / 1e12,
           "tflops_causal": causal * tok_s / 1e12, "compile_s": compile_s, "xla_peak_gib": xla_peak / 2**30,
           "process_peak_so_far_gib": stats.get("peak_bytes_in_use", 0) / 2**30, "loss": loss}
    if peak_tflops:
        row["mfu_palm"], row["mfu_causal"] = row["tflops_palm"] / peak_tflops, row["tflops_causal"] / peak_tflops
    del steps, state, batch, compiled
    return row


def loss_check(models, batch=4):
    """The 1.3B model's loss on one batch with XLA's and the fused attention (same init, same tokens)."""
    out = {}
    for attn in ("xla", "auto"):
        c = config_for("gpt-1.3b", attn, "full", batch, models)
        vocab = int(c.model.vocab_size)
        steps = steps_for(c, vocab, jax.devices()[:1])
        params = steps.init(0)["params"]
        tokens = np.random.default_rng(1).integers(0, vocab, (batch, c.model.seq_len + 1), dtype=np.int32)
        s, n = steps.evaluate(params, {"tokens": jax.device_put(tokens, steps.batch_sharding)})
        out[attn] = float(s) / float(n)
        del steps, params
    out["relative_difference"] = abs(out["auto"] - out["xla"]) / out["xla"]
    out["agree"] = out["relative_difference"] < 2e-2
    return out


def pct(row, key) -> str:
    return f"{row[key]:.1%}" if key in row else "n/a"


def table(rows) -> str:
    head = ("| model | attention (kernel) | remat | batch × seq | tokens/s | TFLOP/s (PaLM) | MFU PaLM | "
            "MFU causal | XLA peak GiB | compile s |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r['model']} | {r['attention']} ({r['kernel']}) | {r['remat']} | {r['batch']} × {r['seq']} "
                     f"| {r['tokens_per_s']:,.0f} | {r['tflops_palm']:.1f} | {pct(r, 'mfu_palm')} | "
                     f"{pct(r, 'mfu_causal')} | {r['xla_peak_gib']:.1f} | {r['compile_s']:.0f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--smoke", action="store_true", help="tiny models, any backend: checks the script")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    models = SMOKE if args.smoke else MODELS
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", str(dev))
    peak = next((v for k, v in PEAK_TFLOPS.items() if k in kind), None)
    limit = device_memory() if not args.smoke else 2 * 2**30
    t0, rows, skipped = time.time(), [], []
    for name, attn, remat in RUNS:
        if time.time() - t0 > BUDGET_S:
            skipped.append([name, attn, remat])
            continue
        try:
            rows.append(one_run(name, attn, remat, models, limit, peak, args.steps, 4 if args.smoke else MAX_BATCH))
        except Exception as e:  # noqa: BLE001 - one failed run (an OOM, a kernel refusing a shape) is a result too
            rows.append({"model": name, "attention": attn, "remat": remat, "error": f"{type(e).__name__}: {e}"[:500]})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    check = None
    if time.time() - t0 < BUDGET_S + 20:
        try:
            check = loss_check(models)
        except Exception as e:  # noqa: BLE001 - keep the rows
            check = {"error": f"{type(e).__name__}: {e}"[:500]}
    result = {"device": kind, "peak_tflops_bf16": peak, "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"),
              "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": rows, "skipped": skipped, "loss_check": check,
              "wall_s": time.time() - t0}
    ok = [r for r in rows if "error" not in r]
    md = table(ok) + "".join(f"\n\nfailed: {r['model']} {r['attention']} {r['remat']}: {r['error']}"
                             for r in rows if "error" in r)
    print(json.dumps(result, indent=1))
    print(md)
    if args.out:
        from common import write_results
        write_results(args.out, "gpu", result, md)


if __name__ == "__main__":
    main()
