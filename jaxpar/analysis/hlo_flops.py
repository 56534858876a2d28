"""Matmul FLOPs per step of an optimized HLO module, loop trip counts applied (`hlo.module`: the parse and the
executions per step that `hlo.hlo_collectives` uses), attributed to `jax.named_scope`s by op_name metadata."""
from __future__ import annotations

import math
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


_LOC_DEF = re.compile(r"^(#loc\d+) = (.*)$")
_LOC_REF = re.compile(r"#loc\d+")
_TENSOR = re.compile(r"tensor<([^>]*)>")


def _tensor_dims(t: str) -> list[int]:
    return [int(x) for x in t.split("x")[:-1]]


def _signature(line: str) -> tuple[list, list]:
    """The operand and result shapes of an op's `: (tensor<..>, ...) -> tensor<..>` type."""
    sig = line.rsplit(" : ", 1)[-1]
    ins, _, outs = sig.partition("->")
    return [_tensor_dims(t) for t in _TENSOR.findall(ins)], [_tensor_dims(t) for t in _TENSOR.findall(outs)]


def _scoped(line: str, defs: dict, scope: str) -> bool:
    """Whether the op's location (its `loc(#locN)`, callsites followed) names `scope/` in a scope path."""
    todo, seen = _LOC_REF.findall(line.rsplit("loc(", 1)[-1]), set()
    while todo:
        ref = todo.pop()
        if ref in seen or ref not in defs:
            continue
        seen.add(ref)
        if re.search(r"[\"/(]" + re.escape(scope) + "/", defs[ref]):
            return True
        todo += _LOC_REF.findall(defs[ref])
    return False


def stablehlo_flops(text: str, scope: str) -> dict:
    """Matmul FLOPs of the ops a `jax.named_scope(scope)` holds in a StableHLO module (`jax.export`'s, e.g. lowered
    for CUDA), each op counted once (a loop body once): `dot_general` as 2 x result elements x contracted elements,
    a `chlo.ragged_dot` composite (the grouped matmul a GPU runs as a kernel) from its operand shapes with every
    row of its left operand counted (the group sizes' bound: rows past their sum cost a kernel nothing, but the
    program does not say how many), 2 x rows x in x out, and JAX's Mosaic GPU grouped kernel (a `mosaic_gpu` custom
    call on (group sizes `[G]`, rows `[M, in]`, weights `[G, in, out]`)) the same way. Ops inside a composite's
    decomposition are not counted.
    -> {"dot_general": FLOPs, "ragged_dot": FLOPs, "mosaic": FLOPs, "total": their sum}."""
    defs = {m.group(1): m.group(2) for m in map(_LOC_DEF.match, text.splitlines()) if m}
    out, inside = {"dot_general": 0, "ragged_dot": 0, "mosaic": 0}, False
    for line in text.splitlines():
        if line.lstrip().startswith("func.func"):
            inside = "@chlo." in line  # a composite's decomposition
            continue
        if inside or not _scoped(line, defs, scope):
            continue
        if "stablehlo.dot_general" in line:
            (lhs, _), (result,) = _signature(line)
            m = re.search(r"contracting_dims = \[([\d, ]*)\]", line)
            contracted = 1
            for i in (int(x) for x in m.group(1).split(",") if x.strip()) if m else ():
                contracted *= lhs[i]
            out["dot_general"] += 2 * contracted * math.prod(result)
        elif 'stablehlo.composite "chlo.ragged_dot"' in line:
            (lhs, rhs, _), _ = _signature(line)
            inner = rhs[1] * rhs[2] if len(rhs) == 3 else lhs[1] * rhs[1]
            out["ragged_dot"] += 2 * lhs[0] * inner
        elif "stablehlo.custom_call @mosaic_gpu" in line:
            ins, _ = _signature(line)
            if [len(s) for s in ins] == [1, 2, 3]:  # the grouped kernel's (group sizes, rows, weights)
                out["mosaic"] += 2 * ins[1][0] * ins[1][1] * ins[2][2]
    return {**out, "total": sum(out.values())}
