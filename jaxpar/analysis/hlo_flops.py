"""Matmul FLOPs per step of an optimized HLO module, loop trip counts applied (`hlo.module`: the parse and the
executions per step that `hlo.hlo_collectives` uses), attributed to `jax.named_scope`s by op_name metadata."""
from __future__ import annotations

import re

from jaxpar.analysis.hlo import _arrays, module


def _dims(shape: str) -> list[int]:
    """Dimensions of the (first) array in an HLO shape."""
    arrays = _arrays(shape)
    return [int(d.strip().lstrip("<=")) for d in arrays[0][1].split(",") if d.strip()] if arrays else []


def _dot_flops(ins, shapes: dict) -> int:
    """2 x result elements x contracted elements of a `dot` (operand shapes looked up by name in its computation)."""
    lhs = _dims(shapes.get(ins["operands"][0], "")) if ins["operands"] else []
    m = re.search(r"lhs_contracting_dims=\{([\d,\s]*)\}", ins["attrs"])
    contracted = 1
    for i in (int(x) for x in (m.group(1).split(",") if m else []) if x.strip()):
        contracted *= lhs[i] if i < len(lhs) else 1
    out = 1
    for d in _dims(ins["shape"]):
        out *= d
    return 2 * out * contracted


_SCOPE = re.compile(r'op_name="([^"]*)"')


def hlo_flops(text: str, scopes=("embed", "head")) -> dict:
    """Matmul FLOPs per step of an HLO module (every `dot`, fused ones included; loop trip counts applied as in
    `hlo_collectives`): {"total": FLOPs, "by_scope": {scope: FLOPs of the dots whose op_name metadata holds
    `scope/` or `(scope)` (a `jax.named_scope`, also under jvp/transpose)}}. Elementwise work is not counted. A CPU
    (dry-run) figure: XLA:GPU turns dots into cuBLAS/cuDNN custom calls, which this does not read."""
    comps, _, execs = module(text)
    total, by = 0, dict.fromkeys(scopes, 0)
    for cname, instrs in comps.items():
        n = execs.get(cname, 0)
        if not n:
            continue
        shapes = {i["name"]: i["shape"] for i in instrs}
        for ins in instrs:
            if ins["opcode"] != "dot":
                continue
            f = _dot_flops(ins, shapes) * n
            total += f
            name = _SCOPE.search(ins["line"])
            for s in scopes:
                if name and re.search(r"(^|[/(])" + re.escape(s) + r"([/)]|$)", name.group(1)):
                    by[s] += f
    return {"total": total, "by_scope": by}
