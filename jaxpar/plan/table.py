"""The planner's output: a ranked plain-text table, the JSON list, and why each layout loses to the best."""
from __future__ import annotations

from jaxpar.plan import Plan, summary
from jaxpar.plan.hardware import GiB

_TERMS = (("bubble_s", "bubble"), ("tp_comm_s", "tensor-parallel comm"), ("pp_comm_s", "stage transfers"),
          ("ep_comm_s", "expert all-to-all"), ("cp_comm_s", "context K/V all-gather"), ("dp_comm_s", "data-parallel/ZeRO comm"), ("recompute_s", "recompute"),
          ("optimizer_s", "optimizer update"), ("offload_s", "host offload transfers"),
          ("round_s", "the round's sampling"))


def why(p: Plan, c, best) -> str:
    """The term that costs `c` the most against `best`; memory first."""
    if c.fits(p.capacity) is False:
        if c.generation is not None and c.generation["peak"] > p.capacity:
            g = c.generation
            return f"its round's generation does not fit (KV pool {g['kv_bytes'] / GiB:.1f} + params " \
                   f"{g['params_bytes'] / GiB:.1f} > {p.capacity / GiB:.1f} GiB; set grpo.kv_cache_gib)"
        if c.memory is None:
            return f"does not fit (params, gradients and optimizer state alone {c.estimate[0] / GiB:.1f} > " \
                   f"{p.capacity / GiB:.1f} GiB)"
        return f"does not fit ({c.peak() / GiB:.1f} > {p.capacity / GiB:.1f} GiB)"
    if c is best:
        return "best"
    total = c.time["step_s"] - best.time["step_s"]
    if c.fits(p.capacity) is None and best.fits(p.capacity) is True:  # placed by the rule, not by its time
        faster = f"{-total:.3g} s faster, " if total < 0 else ""
        return f"{faster}not compiled: its fit is unknown (estimate {c.peak() / GiB:.1f} GiB), so it ranks after " \
               f"the layouts compiled and known to fit"
    deltas = [(c.time.get(k, 0.0) - best.time.get(k, 0.0), name) for k, name in _TERMS]
    other = (c.time["compute_s"] - c.time["recompute_s"]) - (best.time["compute_s"] - best.time["recompute_s"])
    deltas.append((other, "matmul and elementwise work"))
    d, name = max(deltas)
    if abs(total) <= 1e-9 * best.time["step_s"]:
        return "ties with the best"
    return f"{name} +{d:.3g} s (step {total:+.3g} s)" if d > 0 else f"step {total:+.3g} s"


def rows(p: Plan, top: int) -> list[dict]:
    """The `top` best candidates that fit (compiled) or are unknown (not compiled), plus the faster ones that do
    not fit (at most `top`), in the plan's order."""
    best = p.ranked[0] if p.ranked else None
    ok = [c for c in p.ranked if c.fits(p.capacity) is not False][:top]
    limit = ok[0].time["step_s"] if ok else float("inf")
    no = [c for c in p.ranked if c.fits(p.capacity) is False and c.time["step_s"] < limit][:top]
    out = []
    for c in sorted(ok + no, key=lambda c: c.rank(p.capacity)):
        r = summary(p, c)
        r["why"] = why(p, c, best)
        out.append(r)
    return out


def format_table(p: Plan, rs: list[dict]) -> str:
    cl = p.cluster
    head = (f"{cl.gpus} x {cl.device.name} ({cl.gpus_per_node} per node, {cl.intra.name} within, "
            f"{cl.nics_per_node} x {cl.inter.name} between nodes); {p.considered} layouts valid, {p.compiles} "
            f"compiled; memory limit {p.capacity / GiB:.1f} GiB per device")
    gen = any(r.get("generation") for r in rs)  # an objective that samples: its round's KV pool and decode params
    lines = [head, f"{'#':>3} {'layout (data,tensor,stage)':<40} {'b':>3} {'tokens/s':>10} {'TFLOP/s':>8} "
                   f"{'MFU':>6} {'GiB':>7} {'host':>6} {'GiB from':<16} " + ("KV+params GiB sampling " if gen else "")
             + f"{'fits':<5} why it loses"]
    for i, r in enumerate(rs, 1):
        fits = {True: "yes", False: "no", None: "?"}[r["fits"]]
        g = r.get("generation")
        kv = (f"{g['kv_bytes'] / GiB:6.2f}+{g['params_bytes'] / GiB:<6.2f} "
              f"{r['time']['round_s'] / r['time']['step_s']:>8.0%} " if g else " " * 23) if gen else ""
        lines.append(f"{i:>3} {r['layout']:<40} {r['micro_batch']:>3} {r['tokens_per_s']:>10.4g} "
                     f"{r['tflops_per_gpu']:>8.1f} {r['mfu']:>6.1%} {r['memory_gib']:>7.1f} {r['host_gib']:>6.1f} "
                     f"{r['memory_source']:<16} {kv}{fits:<5} {r['why']}")
    return "\n".join(lines)
