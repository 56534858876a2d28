"""LoRA adapters (Hu et al. 2021) beside a block's matmul weights, mesh-free: which weights get them (`targets`, from
Hugging Face projection names as PEFT's `target_modules` reads them, each family's `lora_names`), their parameters
and their matmul.

A weight `W` used as `einsum(spec, x, W)` gets `A` and `B` with `x A B · scale` added to its output, `scale` =
alpha / r (alpha / sqrt(r) with rsLoRA, Kalajdzievski 2023). The spec says which of `W`'s axes are inputs
(contracted with x), outputs, and batch axes (a routed expert's: kept in A and B, one adapter per expert):
A is `[batch.., inputs.., r]`, B is `[batch.., r, outputs..]`, so A's input axes carry the base's input names and B's
output axes its output names; the rank axis `lora_rank` is replicated (every layout shards them like their base
matmul). A is drawn as PEFT does (Kaiming-uniform with a = sqrt(5): U(±1 / sqrt(fan_in))), B is zero, so a fresh
adapter leaves the model's outputs unchanged. Dropout (PEFT's `lora_dropout`) applies to the adapter's input only.

In the params tree the adapters of a module sit under its `lora` key (`blocks.lora.wq.a`, `blocks.moe.experts.lora.
w_gate.b`): `trainable` / `split_trainable` say which leaves an adapter run trains (those under a `lora` key).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.model.base import LOGICAL, LORA as KEY, ROLE

RANK = "lora_rank"  # the logical name of the rank axis (replicated)

ALL = "all-linear"  # every projection of the blocks (not the LM head), as PEFT's "all-linear"
NOT_SUPPORTED_WITH_DROPOUT = "moe."  # a routed expert's adapter sees dispatched buffers, not sequences


def asked(family, targets: str) -> list[str]:
    """`lora.targets` -> the Hugging Face names it asks for: comma-separated names, `all-linear` (every name of the
    family), or `auto` (PEFT's default for the family). `family`: its `lora_names` (PEFT's target names -> block
    paths) and `lora_default` (`jaxpar/model/families/`)."""
    text = family.lora_default if targets.strip() == "auto" else targets
    names = [t.strip() for t in text.split(",") if t.strip()]
    return list(family.lora_names) if names == [ALL] else names


def candidates(family, targets: str) -> tuple[str, ...]:
    """Every block path the target names may stand for, sorted (a model adapts those it has)."""
    return tuple(sorted({p for t in asked(family, targets) for p in family.lora_names.get(t, ())}))


def missing(family, targets: str, weights) -> list[str]:
    """The target names that name no weight of a model whose blocks hold `weights` (block paths); `all-linear`
    misses nothing (it names what the model has)."""
    if targets.strip() == ALL:
        return []
    return [t for t in asked(family, targets) if not set(family.lora_names.get(t, ())) & set(weights)]


def known_names(family) -> str:
    return ", ".join(list(family.lora_names) + [ALL])


def scale(alpha: float, rank: int, rslora: bool) -> float:
    """The adapters' output scale: alpha / r, or alpha / sqrt(r) (rsLoRA), as PEFT."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def _axes(spec: str):
    """einsum spec "x,w->out" -> (x, w, out, the weight's batch, input and output letters, a free letter for r)."""
    ins, out = spec.split("->")
    x, w = ins.split(",")
    batch = [c for c in w if c in x and c in out]
    inputs = [c for c in w if c in x and c not in out]
    outputs = [c for c in w if c not in x]
    r = next(c for c in "rzyxqponmlk" if c not in spec)
    return x, w, out, batch, inputs, outputs, r


class LoRA(nnx.Module):
    """The adapter of one weight `[shape]` with logical `names`, used as `einsum(spec, x, W)`."""

    def __init__(self, key, shape, names, spec: str, rank: int, dtype, scale_: float):
        _, w, _, batch, inputs, outputs, _ = _axes(spec)
        dim = dict(zip(w, shape))
        name = dict(zip(w, names))
        fan_in = math.prod(dim[c] for c in inputs)
        a_shape = tuple(dim[c] for c in batch + inputs) + (rank,)
        b_shape = tuple(dim[c] for c in batch) + (rank,) + tuple(dim[c] for c in outputs)
        draw = jnp.float32 if jnp.dtype(dtype) == jnp.float64 else dtype  # float64 runs start from float32's numbers
        bound = 1.0 / math.sqrt(fan_in)
        a = jax.random.uniform(key, a_shape, draw, -bound, bound).astype(dtype)
        self.a = nnx.Param(a, **{LOGICAL: tuple(name[c] for c in batch + inputs) + (RANK,), ROLE: "adapter"})
        self.b = nnx.Param(jnp.zeros(b_shape, dtype),
                           **{LOGICAL: tuple(name[c] for c in batch) + (RANK,) + tuple(name[c] for c in outputs),
                              ROLE: "adapter"})
        self.spec, self.scale = spec, float(scale_)

    def __call__(self, x, drop=None):
        """The adapter's term of `einsum(spec, x, W)`: scale · (drop(x) A) B, in x's dtype."""
        xs, _, out, batch, inputs, outputs, r = _axes(self.spec)
        mid = "".join(c for c in xs if c not in inputs) + r
        a_spec, b_spec = "".join(batch + inputs) + r, "".join(batch) + r + "".join(outputs)
        h = jnp.einsum(f"{xs},{a_spec}->{mid}", x if drop is None else drop(x), self.a[...].astype(x.dtype))
        return jnp.einsum(f"{mid},{b_spec}->{out}", h, self.b[...].astype(x.dtype)) * jnp.asarray(self.scale, x.dtype)


class Adapters(nnx.Module):
    """A module's adapters, one `LoRA` per adapted weight, as attributes named like the weight."""

    def __init__(self, owner: nnx.Module, specs: dict, cfg, rngs: nnx.Rngs, prefix: str = ""):
        """`specs`: {weight name: its einsum spec} of the owner's weights; those whose block path (`prefix` + name)
        `cfg.lora_targets` names get an adapter, in sorted order (the keys they draw do not depend on the layout)."""
        for name in sorted(specs):
            if prefix + name in cfg.lora_targets and hasattr(owner, name):
                w = getattr(owner, name)
                setattr(self, name, LoRA(rngs.params(), w.shape, w.get_metadata()[LOGICAL], specs[name],
                                         cfg.lora_rank, jnp.dtype(cfg.param_dtype), cfg.lora_scale))


def attach(owner: nnx.Module, specs: dict, cfg, rngs: nnx.Rngs, prefix: str = "") -> None:
    """Give `owner` its `lora` adapters when `cfg.lora_rank` > 0 and a target names one of its weights."""
    if cfg.lora_rank > 0 and any(prefix + n in cfg.lora_targets and hasattr(owner, n) for n in specs):
        setattr(owner, KEY, Adapters(owner, specs, cfg, rngs, prefix))


# the dropout sites of the adapters' inputs (after the block's two residual sites): one mask per adapted weight
SITES = ("wqkv", "wq", "wk", "wv", "wo", "w_in", "w_out", "w_gate", "w_up", "w_down")


def input_dropout(drop, cfg):
    """The block's `drop(y, site, rate)` -> the adapters' input dropout `f(x, weight name)`, or None (no rng, or
    `lora_dropout` 0): each adapted weight its own mask, as PEFT's one dropout module per adapted layer."""
    if drop is None or cfg.lora_rank == 0 or cfg.lora_dropout == 0:
        return None
    return lambda x, name: drop(x, 2 + SITES.index(name), cfg.lora_dropout)


# ---- which leaves train ------------------------------------------------------------------------------------------

def _is_adapter(path) -> bool:
    return any(getattr(k, "key", None) == KEY for k in path)


def split_trainable(tree: dict, lora: bool) -> tuple[dict, dict]:
    """A params-shaped nested dict -> (trainable, frozen) nested dicts with disjoint leaves: with `lora` the adapters
    and the rest; else (tree, {})."""
    if not lora:
        return tree, {}

    def part(node, want: bool, inside: bool):
        out = {}
        for k, v in node.items():
            here = inside or k == KEY
            if isinstance(v, dict):
                sub = part(v, want, here)
                if sub:
                    out[k] = sub
            elif here == want:
                out[k] = v
        return out

    return part(tree, True, False), part(tree, False, False)


def merge(trainable: dict, frozen: dict) -> dict:
    """The inverse of `split_trainable`: one nested dict holding both's leaves."""
    out = dict(frozen)
    for k, v in trainable.items():
        out[k] = merge(v, out[k]) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def trainable(tree: dict, lora: bool) -> dict:
    return split_trainable(tree, lora)[0]


def adapted_paths(params: dict) -> set[str]:
    """The block paths of the weights with adapters in a params-shaped tree ("wq", "moe.experts.w_gate")."""
    out = set()

    def walk(node, path):
        for k, v in node.items():
            if k == KEY:
                out.update(path + name for name in v)
            elif isinstance(v, dict):
                walk(v, f"{path}{k}.")

    walk(params.get("blocks", {}), "")
    return out


def adapter_key(path: str, x: str) -> str:
    """Block path of a weight and "a" | "b" -> the adapter leaf's dotted key under `blocks` ("moe.experts.lora.
    w_gate.a")."""
    owner, _, name = path.rpartition(".")
    return f"{owner + '.' if owner else ''}{KEY}.{name}.{x}"


def delta(a, b, spec: str, lead: str = ""):
    """The weight an adapter adds, `A B` in the base weight's axis order (`spec`: the base matmul's einsum; `lead`:
    letters of leading axes A, B and the weight share, e.g. the stacked layers), unscaled, in A's dtype."""
    _, w, _, batch, inputs, outputs, r = _axes(spec)
    a_spec, b_spec = "".join(batch + inputs) + r, "".join(batch) + r + "".join(outputs)
    return jnp.einsum(f"{lead}{a_spec},{lead}{b_spec}->{lead}{w}", a, b)


def merged(params: dict, specs: dict, scale_: float) -> dict:
    """`params` (one model's, per-layer leaves under `blocks` with a leading layers axis) with every adapter folded
    into its base weight, W + scale · A B, computed in at least float32 and cast to W's dtype (PEFT's
    `merge_and_unload`), and no adapters left. `specs`: {block path of an adapted weight: its einsum spec}."""
    def fold(node, path):
        out = {k: fold(v, f"{path}{k}.") if isinstance(v, dict) and k != KEY else v
               for k, v in node.items() if k != KEY}
        for name, ab in node.get(KEY, {}).items():
            w = out[name]
            f = jnp.promote_types(w.dtype, jnp.float32)
            d = delta(ab["a"].astype(f), ab["b"].astype(f), specs[path + name], lead="Z")
            out[name] = (w.astype(f) + scale_ * d).astype(w.dtype)
        return out

    return {k: fold(v, "") if k == "blocks" else v for k, v in params.items()}
