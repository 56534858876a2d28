"""Collectives in optimized HLO text: kind, bytes, and executions per step with loop trip counts applied.

Matmul FLOPs from the same parse: `jaxpar/analysis/hlo_flops.py`. `hlo_collectives(compiled.as_text())` finds every all-reduce, reduce-scatter, all-gather, collective-permute and
all-to-all, the bytes of its result on one device, and how many times it runs per step: collectives inside `while`
bodies count trip-count times (nested loops multiply). `shape_bytes` reads HLO shapes like `f32[4,128]{1,0}`.
"""
from __future__ import annotations

import functools
import re
from collections import defaultdict

from jaxpar.analysis.hlo_groups import first_group

COLLECTIVE_KINDS = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute", "all-to-all")

# element width in bits of each HLO primitive type (xla/xla_data.proto PrimitiveType; f8/f4 variants below)
_BITS = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32, "u32": 32,
    "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128, "token": 0,
}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*[a-z0-9]*)\[([^\]]*)\]")


def _bits(dtype: str) -> int:
    if dtype in _BITS:
        return _BITS[dtype]
    if dtype.startswith("f8"):
        return 8
    if dtype.startswith("f4"):
        return 4
    if dtype.startswith("f6"):
        return 6
    raise ValueError(f"unknown HLO element type {dtype!r}")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string: an array `f32[4,128]{1,0}` or a tuple `(f32[4], bf16[2,2]{1,0})`.

    Layouts (`{...}`), dynamic bounds (`<=8`) and `/*index=5*/` comments are ignored; a tuple is the sum of its
    arrays; each array is ceil(elements * bits / 8) (sub-byte types packed); `token[]` and `()` are 0.

    Raises:
      ValueError: an element type this module does not know.
    """
    shape = re.sub(r"/\*.*?\*/", "", shape)
    shape = re.sub(r"\{[^{}]*\}", "", re.sub(r"\{[^{}]*\}", "", shape))  # layouts, possibly nested once
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        n = 1
        for d in dims.split(","):
            d = d.strip().lstrip("<=")
            if d:
                n *= int(d)
        total += -(-n * _bits(dtype) // 8)
    return total


# ---------------------------------------------------------------------------------------------------------- HLO text

_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+)$")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_TRIP = re.compile(r'known_trip_count\\?"\s*:\s*\{\s*\\?"n\\?"\s*:\s*\\?"?(\d+)')


def _split_shape(rest: str):
    """'SHAPE opcode(operands), attrs' -> (shape, opcode, operands text, attrs text)."""
    i, depth = 0, 0
    if rest.startswith("("):
        for i, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                break
        i += 1
    else:
        while i < len(rest) and not (rest[i].isspace() and depth == 0):
            depth += rest[i] in "({["
            depth -= rest[i] in ")}]"
            i += 1
    shape, tail = rest[:i], rest[i:].lstrip()
    m = re.match(r"([\w\-]+)\(", tail)
    if not m:
        return shape, "", "", tail
    j, depth = m.end() - 1, 0
    for k in range(j, len(tail)):
        depth += tail[k] == "("
        depth -= tail[k] == ")"
        if depth == 0:
            break
    return shape, m.group(1), tail[j + 1:k], tail[k + 1:]


def _names(text: str) -> list[str]:
    """Operand names in an operand list (with or without `%`, with or without printed operand shapes)."""
    out = []
    for part in re.sub(r"/\*.*?\*/", "", text).split(","):
        toks = part.split()
        if toks:
            out.append(toks[-1].lstrip("%"))
    return out


def _parse(text: str):
    """HLO module text -> ({computation: [instr dict]}, entry name or None)."""
    comps: dict[str, list[dict]] = {}
    entry, cur = None, None
    for line in text.splitlines():
        if cur is None:
            h = _HEADER.match(line)
            if h:
                cur = h.group(2)
                comps[cur] = []
                if h.group(1):
                    entry = cur
            continue
        if line.strip() == "}":
            cur = None
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        trip = _TRIP.search(line)
        rest = re.sub(r"/\*.*?\*/", "", m.group(3))
        shape, opcode, operands, attrs = _split_shape(rest)
        attrs = _STRING.sub('""', attrs)
        comps[cur].append({
            "name": m.group(2), "root": bool(m.group(1)), "shape": shape, "opcode": opcode,
            "operands": _names(operands), "attrs": attrs, "line": line,
            "known_trip_count": int(trip.group(1)) if trip else None,
        })
    return comps, entry


def _attr_comps(attrs: str, key: str) -> list[str]:
    m = re.search(r"\b" + key + r"=\{([^}]*)\}", attrs)
    if m:
        return [n.strip().lstrip("%") for n in m.group(1).split(",") if n.strip()]
    m = re.search(r"\b" + key + r"=%?([\w.\-]+)", attrs)
    return [m.group(1)] if m else []


def _constant(ins) -> int | None:
    if ins is not None and ins["opcode"] == "constant" and re.fullmatch(r"[su]\d+\[\]", ins["shape"].split("{")[0]):
        try:
            return int(ins["operands"][0]) if ins["operands"] else None
        except ValueError:
            return None
    return None


def _trip_from_condition(comps, caller: list[dict], while_ins: dict, cond: str) -> int | None:
    """Infer a while loop's trip count from its condition `compare(get-tuple-element(param, i), constant N)`.

    Handles LT/LE (and GT/GE with the constant first), a compare wrapped in a fusion, and a step of 1; the start
    value is the constant at tuple index i of the while's init operand when it is one, else 0 (JAX's scans and
    fori_loops with lower bound 0). Returns None when the condition does not have this form."""
    body = comps.get(cond, [])
    by = {i["name"]: i for i in body}
    root = next((i for i in body if i["root"]), None)
    if root is None:
        return None
    ops, cmp_attrs = root["operands"], root["attrs"]
    if root["opcode"] == "fusion":
        fused = comps.get((_attr_comps(root["attrs"], "calls") or [""])[0], [])
        froot = next((i for i in fused if i["root"]), None)
        if froot is None or froot["opcode"] != "compare":
            return None
        params = {i["name"]: int(i["operands"][0]) for i in fused if i["opcode"] == "parameter"}
        try:
            ops = [root["operands"][params[o]] for o in froot["operands"]]
        except (KeyError, IndexError, ValueError):
            return None
        cmp_attrs = froot["attrs"]
    elif root["opcode"] != "compare":
        return None
    d = re.search(r"direction=(\w+)", cmp_attrs)
    if len(ops) != 2 or not d:
        return None
    a, b = (by.get(o) for o in ops)
    direction = d.group(1)
    if _constant(a) is not None and _constant(b) is None:  # N > i  ==  i < N
        a, b = b, a
        direction = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}.get(direction, direction)
    bound = _constant(b)
    if bound is None or a is None or a["opcode"] != "get-tuple-element":
        return None
    idx = re.search(r"index=(\d+)", a["attrs"])
    start = 0
    if idx and while_ins["operands"]:
        init = next((i for i in caller if i["name"] == while_ins["operands"][0]), None)
        if init is not None and init["opcode"] == "tuple" and int(idx.group(1)) < len(init["operands"]):
            el = next((i for i in caller if i["name"] == init["operands"][int(idx.group(1))]), None)
            start = _constant(el) if _constant(el) is not None else 0
    if direction == "LT":
        return max(bound - start, 0)
    if direction == "LE":
        return max(bound - start + 1, 0)
    return None


_NO_FOLLOW = ("async-done", "async-update")
_CALLEE_KEYS = ("calls", "called_computations", "branch_computations", "true_computation", "false_computation")


def _while_loop(comps, cname: str, instrs: list[dict], ins: dict) -> tuple[dict, list]:
    """A `while` instruction -> (its `loops` entry, its call edges [(body, n), (condition, n + 1)]).

    n is `known_trip_count`, else inferred from the condition, else 1 (source "unknown")."""
    cond = (_attr_comps(ins["attrs"], "condition") or [None])[0]
    body = (_attr_comps(ins["attrs"], "body") or [None])[0]
    n, src = ins["known_trip_count"], "known_trip_count"
    if n is None:
        n, src = _trip_from_condition(comps, instrs, ins, cond), "condition"
    if n is None:
        n, src = 1, "unknown"
    loop = {"name": ins["name"], "computation": cname, "trip_count": n, "source": src}
    edges = ([(body, n)] if body else []) + ([(cond, n + 1)] if cond else [])
    return loop, edges


def _call_graph(comps) -> tuple[dict, list]:
    """({computation: [(callee, executions per execution of the caller)]}, [loop dicts]) over every instruction."""
    edges: dict[str, list] = defaultdict(list)
    loops = []
    for cname, instrs in comps.items():
        for ins in instrs:
            op, attrs = ins["opcode"], ins["attrs"]
            if op == "while":
                loop, loop_edges = _while_loop(comps, cname, instrs, ins)
                loops.append(loop)
                edges[cname] += loop_edges
                continue
            if op in _NO_FOLLOW:
                continue
            callees = [c for key in _CALLEE_KEYS for c in _attr_comps(attrs, key)]
            if op == "call":
                callees += _attr_comps(attrs, "to_apply")
            edges[cname] += [(c, 1) for c in callees if c in comps]
    return edges, loops


def _post_order(comps, edges, roots: list[str]) -> list[str]:
    """Computations reachable from `roots` in depth-first post-order (every callee before its callers)."""
    order, seen = [], set()
    for r in roots:
        if r in seen:
            continue
        stack = [(r, iter(edges.get(r, ())))]
        seen.add(r)
        while stack:
            node, it = stack[-1]
            for callee, _ in it:
                if callee not in seen and callee in comps:
                    seen.add(callee)
                    stack.append((callee, iter(edges.get(callee, ()))))
                    break
            else:
                order.append(node)
                stack.pop()
    return order


def _executions(comps, entry, edges) -> dict[str, int]:
    """Executions per step of each computation: 1 for ENTRY (or, without one, each computation nobody calls),
    propagated through the call DAG in topological order (a callee's count is the sum over its call sites)."""
    roots = [entry] if entry in comps else [c for c in comps if not any(c == e for v in edges.values()
                                                                       for e, _ in v)]
    order = _post_order(comps, edges, roots)
    execs: dict[str, int] = defaultdict(int)
    for r in roots:
        execs[r] = 1
    for c in reversed(order):
        for callee, m in edges.get(c, ()):
            execs[callee] += execs[c] * m
    return execs


def _arrays(shape: str) -> list[tuple[str, str]]:
    """(dtype, dims text) of each array in an HLO shape (one for an array, each element of a tuple)."""
    shape = re.sub(r"\{[^{}]*\}", "", re.sub(r"\{[^{}]*\}", "", re.sub(r"/\*.*?\*/", "", shape)))
    return _ARRAY.findall(shape)


# AllReducePromotion widens these (xla/service/cpu/cpu_compiler.cc: BF16 -> F32; gpu_compiler.cc: U16/S16 -> 32 bit)
# and renames the reduction computation `*_promoted`
_PROMOTED_FROM = {"f32": "bf16", "u32": "u16", "s32": "s16"}


def _program_arrays(ins) -> list[tuple[str, str]]:
    """The arrays of a collective's result as the program had them, before a backend's all-reduce promotion."""
    arrays = _arrays(ins["shape"])
    if "promoted" not in "".join(_attr_comps(ins["attrs"], "to_apply")):
        return arrays
    return [(_PROMOTED_FROM.get(dt, dt), dims) for dt, dims in arrays]


def _array_bytes(arrays) -> int:
    return sum(shape_bytes(f"{dt}[{dims}]") for dt, dims in arrays)


def _collectives_in(comps, execs) -> list[dict]:
    """Every collective instruction (`X-start` as X, with the shape of its `X-done`) with bytes and executions."""
    out = []
    for cname, instrs in comps.items():
        done_shape = {}
        for ins in instrs:
            if ins["opcode"].endswith("-done") and ins["operands"]:
                done_shape[ins["operands"][0]] = ins["shape"]
        for ins in instrs:
            op = ins["opcode"]
            kind = op[:-len("-start")] if op.endswith("-start") else op
            if kind not in COLLECTIVE_KINDS:
                continue
            shape = done_shape.get(ins["name"], ins["shape"]) if op.endswith("-start") else ins["shape"]
            arrays = _program_arrays(dict(ins, shape=shape))
            b, n = _array_bytes(arrays), execs.get(cname, 0)
            out.append({"kind": kind, "name": ins["name"], "computation": cname, "group": first_group(ins["attrs"]),
                        "dtype": ",".join(sorted({dt for dt, _ in arrays})), "bytes": b,
                        "backend_bytes": shape_bytes(shape), "executions": n, "total_bytes": b * n})
    return out


def _by_kind(collectives: list[dict]) -> dict:
    """{kind: {count, executions, bytes}}: bytes is the sum of total_bytes (per-device bytes per step)."""
    by_kind = {}
    for c in collectives:
        k = by_kind.setdefault(c["kind"], {"count": 0, "executions": 0, "bytes": 0})
        k["count"] += 1
        k["executions"] += c["executions"]
        k["bytes"] += c["total_bytes"]
    return by_kind


def hlo_collectives(text: str) -> dict:
    """Every collective in an HLO module's text, with its bytes and executions per step.

    Kinds: all-reduce, reduce-scatter, all-gather, collective-permute, all-to-all, and their async forms: `X-start`
    counts as one X, `X-done` is skipped; a collective wrapped in `async-start(..., calls=C)` is counted inside C.
    `bytes` is the per-device bytes of the collective's result shape (for `X-start`, the shape of its `X-done`:
    the start's own shape also carries the operands) in the dtype the program gave it (`dtype`): a bf16 all-reduce
    that XLA:CPU promoted to float32 counts 2 bytes per element, as a GPU runs it (`_program_arrays`;
    `backend_bytes`: as compiled): the gathered buffer for all-gather, the shard for
    reduce-scatter, the whole (reduced) buffer for all-reduce. It is not the bytes sent on the wire (a ring
    all-reduce of B bytes over n devices sends 2(n-1)/n * B per device).

    Executions per step: ENTRY runs once; a computation called from several call sites runs the sum over them. A
    `while` body runs trip-count times per execution of the while (its condition trip-count + 1), so nested loops
    multiply. The trip count is XLA's `known_trip_count` from the while's backend_config when present; otherwise it
    is inferred from the condition (`_trip_from_condition`: `i < N` on a tuple element, start from the init tuple
    or 0); otherwise it is unknown and counted as 1 (listed under `loops` with source "unknown"). Conditional
    branches are each counted as if taken (an upper bound). Computations reached only from async-done/update, or
    from `to_apply` of anything but `call`, are not followed (reduction bodies hold no collectives).

    Returns:
      {"collectives": [{kind, name, computation, group (`hlo_groups.first_group`), dtype, bytes, backend_bytes, executions,
       total_bytes}], "by_kind": {kind: {count,
       executions, bytes}} (bytes = sum of total_bytes: per-device bytes per step), "loops": [{name, computation,
       trip_count, source}]}.

    Raises:
      ValueError: an element type `shape_bytes` does not know.
    """
    comps, loops, execs = module(text)
    out = _collectives_in(comps, execs)
    return {"collectives": out, "by_kind": _by_kind(out), "loops": loops}


@functools.lru_cache(maxsize=1)
def module(text: str):
    """HLO module text -> ({computation: [instr dict]}, [loop dicts], {computation: executions per step}); the last
    module's parse is kept (the compile report reads one module twice: collectives and FLOPs)."""
    comps, entry = _parse(text)
    edges, loops = _call_graph(comps)
    return comps, loops, _executions(comps, entry, edges)
