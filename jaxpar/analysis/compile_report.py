"""What a compiled step costs, read from XLA: per-device memory, every collective and how often it runs per step.

    compiled = steps.train.lower(state, batch).compile()
    rep = report.compile_report(compiled, abstract_state=steps.abstract_state(), flops_per_step=6 * N * tokens)
    print(report.format_table(rep))

Units: bytes are per device; FLOPs are floating-point operations per step (a multiply-add counts as 2).

Memory comes from `compiled.memory_analysis()` (XLA's buffer assignment for one device). `peak` is
argument + output + temp - alias: the inputs, the outputs and the temporaries live at once, less the outputs that
reuse (alias) a donated input buffer. It is the same estimate `bench/step_time.py` prints, an upper bound on the
step's live bytes (XLA's temp figure already accounts for buffer reuse inside the step).

Collectives come from the optimized HLO text (`compiled.as_text()`); see `jaxpar.analysis.hlo.hlo_collectives` for the rules
(kinds, bytes, executions per step, loop trip counts).
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import numpy as np

from jaxpar.analysis.hlo import COLLECTIVE_KINDS, hlo_collectives
from jaxpar.analysis.hlo_flops import hlo_flops

# ------------------------------------------------------------------------------------------------- memory and state

def memory_bytes(compiled) -> dict:
    """Per-device bytes from `compiled.memory_analysis()`: argument, output, temp, alias, generated_code and
    peak = argument + output + temp - alias. {} when the backend gives no analysis."""
    try:
        m = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - some backends raise NotImplemented/Unimplemented
        return {}
    if m is None:
        return {}
    kinds = ("argument", "output", "temp", "alias")
    out = {k: int(getattr(m, f"{k}_size_in_bytes")) for k in kinds + ("generated_code",)}
    out["peak"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
    host = {k: int(getattr(m, f"host_{k}_size_in_bytes", 0) or 0) for k in kinds}
    out["host_peak"] = host["argument"] + host["output"] + host["temp"] - host["alias"]
    return out


def placement(memory: dict, host_state: int) -> dict:
    """Device and host bytes per device of a step whose state holds `host_state` bytes per device in pinned host
    memory (`optim.offload`). Where XLA reports host memory apart (GPU, TPU: `host_peak` > 0) both come from its
    report; XLA:CPU has one memory and counts everything as device bytes, so there the device figure is its peak
    less the host-resident state (an argument aliased to its output: counted once), and the host figure that state.
    -> {"device": bytes, "host": bytes, "source": "xla" | "xla - host state (XLA:CPU)"}."""
    if not memory:
        return {}
    if memory.get("host_peak", 0) > 0 or not host_state:
        return {"device": memory["peak"], "host": memory.get("host_peak", 0), "source": "xla"}
    return {"device": memory["peak"] - host_state, "host": host_state, "source": "xla - host state (XLA:CPU)"}


HOST_KINDS = ("pinned_host", "unpinned_host")


def host_state_bytes(abstract_state) -> int:
    """Per-device bytes of the state's leaves whose sharding puts them in host memory."""
    leaves = [a for a in jax.tree.leaves(abstract_state)
              if getattr(getattr(a, "sharding", None), "memory_kind", None) in HOST_KINDS]
    return sum(_leaf_bytes(a, a.sharding) for a in leaves)


def _leaf_bytes(leaf, sharding) -> int:
    shape = tuple(leaf.shape)
    local = tuple(sharding.shard_shape(shape)) if sharding is not None else shape
    return int(math.prod(local)) * np.dtype(leaf.dtype).itemsize


def state_group_bytes(abstract_state, state_shardings=None) -> dict:
    """Per-device bytes of each top-level group of a state: {'params': ..., 'opt_state': ..., ...}.

    Each leaf (anything with `.shape` and `.dtype`, e.g. `jax.ShapeDtypeStruct`) counts
    prod(sharding.shard_shape(shape)) * itemsize, using the leaf's `.sharding`, else the matching leaf of
    `state_shardings`, else the full shape (replicated). A state that is not a mapping is one group 'state'.
    With ZeRO stage >= 1 the opt_state bytes drop by the data-parallel size (for the leaves `data` divides).
    """
    groups = abstract_state.items() if isinstance(abstract_state, Mapping) else [("state", abstract_state)]
    out = {}
    for key, sub in groups:
        leaves = jax.tree.leaves(sub)
        if state_shardings is not None:
            sh_sub = state_shardings[key] if isinstance(abstract_state, Mapping) else state_shardings
            shs = jax.tree.leaves(sh_sub, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
            if len(shs) != len(leaves):
                shs = [None] * len(leaves)
        else:
            shs = [None] * len(leaves)
        out[key] = sum(_leaf_bytes(x, getattr(x, "sharding", None) or s) for x, s in zip(leaves, shs))
    return out


# -------------------------------------------------------------------------------------------------------- report

def compile_report(lowered_or_compiled, *, state_shardings=None, abstract_state=None,
                   flops_per_step: float | None = None, keep_hlo: bool = False) -> dict:
    """A dict of what one compiled step costs, per device.

    Args:
      lowered_or_compiled: a `jax.stages.Lowered` (compiled here) or `jax.stages.Compiled`.
      state_shardings: optional pytree of shardings matching `abstract_state` (used for leaves without one).
      abstract_state: optional state of `jax.ShapeDtypeStruct`s with `.sharding` (e.g. `Steps.abstract_state()`).
      keep_hlo: also return the optimized HLO text the report was read from, under "hlo_text".
      flops_per_step: analytic model FLOPs per step, copied in. Pass it: XLA's own `cost_analysis()` counts each
        while-loop body once (not trip-count times), so its figure (`xla_flops`, when available) undercounts a
        step with microbatch or layer scans.

    Returns:
      {"memory": `memory_bytes`, "placement": `placement` (device and host bytes), "state_bytes":
       `state_group_bytes` or {}, "collectives": list,
       "collectives_by_kind": dict, "loops": list (see `hlo_collectives`), "flops_per_step": float or None,
       "xla_flops": float or None, "hlo_flops": `hlo_flops.hlo_flops` (matmul FLOPs per device per step, loop trip counts
       applied; by named scope: embed, head)}.

    Raises:
      ValueError: an HLO element type `shape_bytes` does not know.
    """
    compiled = lowered_or_compiled
    if not hasattr(compiled, "memory_analysis") and hasattr(compiled, "compile"):
        compiled = compiled.compile()
    text = compiled.as_text()  # once: a large model's HLO text takes seconds to print
    col = hlo_collectives(text)
    xla_flops = None
    try:
        ca = compiled.cost_analysis()
        ca = ca[0] if isinstance(ca, (list, tuple)) and ca else ca
        if ca and "flops" in ca:
            xla_flops = float(ca["flops"])
    except Exception:  # noqa: BLE001 - optional, backend dependent
        pass
    memory = memory_bytes(compiled)
    host = host_state_bytes(abstract_state) if abstract_state is not None else 0
    return {
        "memory": memory,
        "placement": placement(memory, host),
        "state_bytes": state_group_bytes(abstract_state, state_shardings) if abstract_state is not None else {},
        "collectives": col["collectives"],
        "collectives_by_kind": col["by_kind"],
        "loops": col["loops"],
        "flops_per_step": None if flops_per_step is None else float(flops_per_step),
        "xla_flops": xla_flops,
        "hlo_flops": hlo_flops(text),
    } | ({"hlo_text": text} if keep_hlo else {})


def _fmt_bytes(n) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024


def format_table(report: Mapping[str, Any]) -> str:
    """A short plain-text table: per-device memory rows, state groups, collectives per kind, FLOPs."""
    lines = ["per-device memory (XLA)           bytes"]
    for k, v in report.get("memory", {}).items():
        note = "  (argument + output + temp - alias)" if k == "peak" else ""
        lines.append(f"  {k:<30} {v:>14,}  {_fmt_bytes(v)}{note}")
    pl = report.get("placement")
    if pl and (pl["host"] or pl["source"] != "xla"):
        lines.append(f"  {'device (offload)':<30} {pl['device']:>14,}  {_fmt_bytes(pl['device'])}  ({pl['source']})")
        lines.append(f"  {'host, pinned':<30} {pl['host']:>14,}  {_fmt_bytes(pl['host'])}")
    for k, v in report.get("state_bytes", {}).items():
        lines.append(f"  state[{k!r}]{'':<{max(0, 21 - len(k))}} {v:>14,}  {_fmt_bytes(v)}")
    by = report.get("collectives_by_kind", {})
    lines.append("collectives          count  executions/step   bytes/step (program dtypes)")
    if not by:
        lines.append("  (none)")
    for kind in COLLECTIVE_KINDS:
        if kind in by:
            k = by[kind]
            lines.append(f"  {kind:<18} {k['count']:>6} {k['executions']:>16} {_fmt_bytes(k['bytes']):>12}")
    unknown = [lp["name"] for lp in report.get("loops", []) if lp["source"] == "unknown"]
    if unknown:
        lines.append(f"  note: trip count unknown (counted once) for {', '.join(unknown)}")
    if report.get("flops_per_step") is not None:
        lines.append(f"model FLOPs/step      {report['flops_per_step']:.4g}")
    hf = report.get("hlo_flops")
    if hf and hf["total"]:
        scopes = ", ".join(f"{k} {v / hf['total']:.2%}" for k, v in hf["by_scope"].items())
        lines.append(f"matmul FLOPs/step/device (HLO, loops applied) {hf['total']:.4g}  ({scopes})")
    if report.get("xla_flops") is not None:
        lines.append(f"XLA cost_analysis     {report['xla_flops']:.4g}  (loop bodies counted once)")
    return "\n".join(lines)
