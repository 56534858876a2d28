"""The planner against published results; JSON + markdown tables in bench/results/plan_*.{json,md}.

    python bench/plan_published.py --out bench/results [--part table1,gpt3,deepspeed] [--nocompile]

- table1: Narayanan et al. 2021 (SC'21), Table 1: A100 80 GB (DGX A100: 8 per node, NVSwitch, 8 HDR NICs),
  V = 51,200, s = 2048, fp16, full recompute (the paper's), no ZeRO, no sequence parallelism, XLA attention (scores
  in HBM, as Megatron-LM 2021); the planner picks the microbatch and the 1F1B interleaving within each row's TP, PP
  and batch. TFLOP/s per GPU = the paper's 96·B·s·l·h²·(1 + s/6h + V/16lh) / predicted step time / GPUs.
- gpt3: GPT-3 175B on 1024 A100, batch 1536, the same techniques, every schedule: the top 10, and where
  Megatron-LM's README layout (TP 8 x PP 16 x DP 8, interleaved, 138 TFLOP/s per GPU) ranks.
- deepspeed: the scenario table of a widely read DeepSpeed + Megatron article (8 x A100 80 GB PCIe, no NVLink,
  ZeRO-2, fp16): A pure DP, B TP + DP, C TP + PP + DP, D tensor 8, for GPT-2 large and a 1.3B GPT.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jaxpar.plan.memory import compile_flags  # noqa: E402

if __name__ == "__main__":  # (imported by tests/test_plan.py for its tables: the importer's devices stay as they are)
    os.environ["XLA_FLAGS"] = compile_flags(os.environ.get("XLA_FLAGS", ""), 1024, True)

from common import write_results  # noqa: E402

from jaxpar import plan as planner  # noqa: E402
from jaxpar.config import base_config  # noqa: E402
from jaxpar.plan import cost, hardware, table  # noqa: E402
from jaxpar.plan.space import Space  # noqa: E402

# name, hidden, layers, heads, TP, PP, GPUs, batch, published TFLOP/s per GPU
TABLE1 = [("1.7B", 2304, 24, 24, 1, 1, 32, 512, 137), ("18B", 6144, 40, 48, 8, 1, 256, 1024, 135),
          ("145B", 12288, 80, 96, 8, 8, 1536, 2304, 148), ("530B", 20480, 105, 128, 8, 35, 2520, 2520, 163),
          ("1T", 25600, 128, 160, 8, 64, 3072, 3072, 163)]
# the 2021 techniques: full recompute (stage recompute in a pipeline), no ZeRO, no SP
MEGATRON_2021 = dict(zero=(0,), remat=("full",), sp=(False,), context=(1,), offload=("none",))  # what Megatron-LM had in 2021


def megatron_config(h, layers, heads, batch, seq=2048):
    c = base_config()
    c.model.update(vocab_size=51200, seq_len=seq, layers=layers, embed=h, heads=heads, remat="full",
                   attention="xla")
    c.train.update(global_batch_size=batch, compute_dtype="float16")
    return c


def _devices(compile_):
    import jax

    return jax.devices("cpu") if compile_ else None


def table1(compile_):
    rows = []
    for name, h, l, a, t, p, n, B, pub in TABLE1:
        c = megatron_config(h, l, a, B)
        sched = ("1f1b",) if p > 1 else None
        t0 = time.perf_counter()
        pl = planner.plan(c, hardware.cluster("a100-80g", n), Space(tensor=(t,), stage=(p,), schedule=sched,
                                                                      **MEGATRON_2021),
                          compile_top=1, devices=_devices(compile_))
        best = pl.ranked[0]
        tf = cost.narayanan_flops(pl.model) / best.time["step_s"] / n / 1e12
        rows.append({"model": name, "hidden": h, "layers": l, "heads": a, "tp": t, "pp": p, "gpus": n, "batch": B,
                     "published_tflops": pub, "predicted_tflops": tf, "error": tf / pub - 1,
                     "chosen": best.layout.name(), "micro_batch": best.layout.micro_batch(B),
                     "memory_gib": best.peak() / 2 ** 30, "memory_source": best.memory["source"] if best.memory
                     else "estimate", "time": best.time, "plan_s": time.perf_counter() - t0})
        print(rows[-1]["model"], rows[-1]["chosen"], f"{tf:.1f} vs {pub}", f"{tf / pub - 1:+.1%}", flush=True)
    md = ["| model | h, l, heads | TP x PP | GPUs | batch | published TFLOP/s | predicted | error | chosen "
          "(microbatch) | memory GiB |", "|---|---|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        md.append(f"| {r['model']} | {r['hidden']}, {r['layers']}, {r['heads']} | {r['tp']} x {r['pp']} | {r['gpus']} "
                  f"| {r['batch']} | {r['published_tflops']} | {r['predicted_tflops']:.1f} | {r['error']:+.1%} | "
                  f"{r['chosen']} (b {r['micro_batch']}) | {r['memory_gib']:.1f} ({r['memory_source']}) |")
    return rows, "\n".join(md)


def gpt3(compile_):
    c = megatron_config(12288, 96, 96, 1536)
    t0 = time.perf_counter()
    pl = planner.plan(c, hardware.cluster("a100-80g", 1024), Space(**MEGATRON_2021), compile_top=10,
                      devices=_devices(compile_))
    plan_s = time.perf_counter() - t0
    rs = table.rows(pl, 10)
    ref_best = next(x for x in pl.ranked if (x.layout.data, x.layout.tensor, x.layout.stage) == (8, 8, 16)
                    and x.layout.virtual_stages > 1 and x.layout.schedule == "1f1b")  # its best (ranked fits first)
    rank = pl.ranked.index(ref_best) + 1
    assert ref_best.fits(pl.capacity) is not False, ref_best.layout
    nf = lambda x: cost.narayanan_flops(pl.model) / x.time["step_s"] / 1024 / 1e12
    out = {"plan_s": plan_s, "considered": pl.considered, "compiles": pl.compiles,
           "top": [dict(r, narayanan_tflops=cost.narayanan_flops(pl.model) / r["time"]["step_s"] / 1024 / 1e12)
                   for r in rs],
           "megatron_layout": {"layout": ref_best.layout.name(), "rank": rank, "narayanan_tflops": nf(ref_best),
                               "published_tflops": 138, "vs_top": ref_best.time["step_s"] / pl.ranked[0].time["step_s"]
                               - 1}}
    md = [f"GPT-3 175B, 1024 x A100 80 GB, batch 1536: {pl.considered} layouts valid, {pl.compiles} compiled, "
          f"planned in {plan_s:.0f} s", "",
          "| # | layout (data,tensor,stage) | b | TFLOP/s per GPU (paper's count) | MFU | GiB | memory | fits | why "
          "it loses |", "|---:|---|---:|---:|---:|---:|---|---|---|"]
    for i, r in enumerate(out["top"], 1):
        md.append(f"| {i} | {r['layout']} | {r['micro_batch']} | {r['narayanan_tflops']:.1f} | {r['mfu']:.1%} | "
                  f"{r['memory_gib']:.1f} | {r['memory_source']} | {r['fits']} | {r['why']} |")
    m = out["megatron_layout"]
    md.append(f"\nMegatron-LM's layout {m['layout']}: rank {m['rank']}, {m['narayanan_tflops']:.1f} TFLOP/s per GPU "
              f"predicted vs 138 published; {m['vs_top']:+.1%} step time vs the top layout.")
    print("\n".join(md), flush=True)
    return out, "\n".join(md)


# (scenario, article's tokens/s, article's GB, (data, tensor, stage))
SCENARIOS = [("A pure data parallel", 120e3, 65, (8, 1, 1)), ("B TP + DP", 185e3, 72, (2, 4, 1)),
             ("C TP + PP + DP", 238e3, 75, (2, 2, 2)), ("D tensor 8, too little pipeline", 210e3, 70, (1, 8, 1))]


def deepspeed(compile_):
    models = {"GPT-2 large (774M), seq 1024": base_config_large(), "GPT 1.3B, seq 2048": gpt_1_3b(2048),
              "GPT 1.3B, seq 1024": gpt_1_3b(1024)}
    rows = []
    cl = hardware.cluster("a100-80g-pcie", 8, 8, "ib-hdr", nics_per_node=1)
    for mname, c in models.items():
        for sname, tps, gb, (d, t, s) in SCENARIOS:
            sp = Space(tensor=(t,), stage=(s,), zero=(2,), remat=("none", "selective", "full"), sp=(False, True),
                       context=(1,), offload=("none",))
            pl = planner.plan(c, cl, sp, compile_top=1, devices=_devices(compile_))
            if not pl.ranked:  # tensor and stage are fixed, so is data
                rows.append({"model": mname, "scenario": sname, "article_tokens_per_s": tps, "article_gb": gb,
                             "refused": refusal(c, d, t, s)})
                print(mname, sname, "refused:", rows[-1]["refused"], flush=True)
                continue
            best = pl.ranked[0]
            r = planner.summary(pl, best)
            article_mfu = tps * cost.model_flops_per_step(pl.model) / (pl.model.global_batch * pl.model.seq) \
                / 8 / cl.device.peak_flops
            rows.append({"model": mname, "scenario": sname, "article_tokens_per_s": tps, "article_gb": gb,
                         "article_mfu": article_mfu, **{k: r[k] for k in ("layout", "micro_batch", "tokens_per_s",
                                                                            "mfu", "memory_gib", "memory_source",
                                                                            "fits", "time")}})
            print(mname, sname, r["layout"], f"{r['tokens_per_s']:.3g}", f"{r['mfu']:.1%}",
                  f"{r['memory_gib']:.1f}", flush=True)
    md = ["| model | scenario | article: tokens/s, GB, implied MFU | jaxpar plan: layout (b) | tokens/s | MFU | "
          "GiB per device |", "|---|---|---|---|---:|---:|---:|"]
    for r in rows:
        if "refused" in r:
            md.append(f"| {r['model']} | {r['scenario']} | {r['article_tokens_per_s'] / 1e3:.0f}K, {r['article_gb']} "
                      f"| refused by validate: {r['refused']} | – | – | – |")
            continue
        md.append(f"| {r['model']} | {r['scenario']} | {r['article_tokens_per_s'] / 1e3:.0f}K, {r['article_gb']}, "
                  f"{r['article_mfu']:.0%} | {r['layout']} (b {r['micro_batch']}) | {r['tokens_per_s'] / 1e3:.0f}K | "
                  f"{r['mfu']:.1%} | {r['memory_gib']:.1f} ({r['memory_source']}) |")
    return rows, "\n".join(md)


def refusal(c, d, t, s):
    """validate's message for the mesh (d, t, s) with one microbatch per stage."""
    from jaxpar.config import ConfigError
    from jaxpar.validate import validate
    from jaxpar.plan.space import Layout, apply

    try:
        validate(apply(c, Layout(d, t, s, max(s, 1), "1f1b" if s > 1 else "gpipe", zero_stage=2)), d * t * s)
    except ConfigError as e:
        return " ".join(str(e).split("\n")[1:]).strip()
    return "no microbatch count fits the batch"


def base_config_large():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpt_large", os.path.join(os.path.dirname(__file__), "..",
                                                                            "configs", "gpt_large.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    c = mod.get_config()
    c.train.compute_dtype = "float16"
    return c


def gpt_1_3b(seq):
    """Megatron's 1.3B GPT (24 layers, d 2048, 16 heads, vocab 50304), fp16; batch 512 sequences."""
    c = base_config()
    c.model.update(vocab_size=50304, seq_len=seq, layers=24, embed=2048, heads=16)
    c.train.update(global_batch_size=512, compute_dtype="float16")
    return c


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--part", default="table1,gpt3,deepspeed")
    ap.add_argument("--nocompile", action="store_true")
    a = ap.parse_args()
    for part in a.part.split(","):
        rows, md = {"table1": table1, "gpt3": gpt3, "deepspeed": deepspeed}[part](not a.nocompile)
        print(md, flush=True)
        write_results(a.out, f"plan_{part}", rows, md)


if __name__ == "__main__":
    main()
