"""The KV cache on the training mesh, and the decode layout the params are read in.

The cache of every layer, `[layers, batch, length, kv_heads, head_dim]` in the compute dtype for keys and for values,
is sharded like the activations: rows (`batch`) over data x expert, KV heads over tensor where tensor divides them
(else each tensor device holds them all, as its params do); its per-row positions `[layers, batch]` int32 are tiny.
Under context parallelism the rows also split over `context` while a row fits its device's budget; a row that does
not (`kv_over_context`) has its positions split over `context` instead (a paged pool: each block's positions), the
rest of a decode step, its matmuls and the head, then running on every context device.

The decode layout is the training layout with the `layers` axis whole on every device: with pipeline stages > 1 the
params are gathered over `stage` for the generation (each device then holds all the layers of its tensor / ZeRO shard:
`stage` times its training share of the per-layer params, `decode_param_bytes`); with stage 1 it is the training
layout itself, no copy. ZeRO-3 params are gathered whole over ZeRO's group once for the engine (one decode copy a
device holds for the round, as ZeRO-1's step always does; DeepSpeed's hybrid engine), or with `gather_zero3=False`
stay sharded and are gathered one layer at a time inside the layer loop at every step, as the train step does.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar import model as gpt
from jaxpar.config import step_rules
from jaxpar.config_keys import DEFAULT_RULES
from jaxpar.formats import peft, start
from jaxpar.generate import paged
from jaxpar.kernels.paged import POOL_NAMES
from jaxpar.layout import Layout
from jaxpar.model.layers import KVCache
from jaxpar.parallel.logical import mesh_axes, spec
from jaxpar.parallel.sharding import param_specs
from jaxpar.train import objectives

CACHE_NAMES = (None, "batch", "kv_block", "kv_heads", "kv")  # the cache's logical axes (its layer axis is never split)


def decode_rules(rules, kv_context: bool = False) -> tuple:
    """The rules of the decode layout: the training rules with `layers` on no mesh axis (gathered over `stage`) and
    either the rows also split over `context` (context parallelism's devices decode rows of their own, each row's
    cache whole on one) or, `kv_context`, each row's KV positions (`kv_block`) over `context` (its rows whole on
    each context device, its cache spread over them, the attention's softmax and sum reduced across them), as tuples
    (a run's config.json holds lists)."""
    def axes(n, a):
        a = tuple(a) if isinstance(a, list) else a
        if n == "layers":
            return None
        if n == "batch" and not kv_context:
            a = (a,) if isinstance(a, str) else tuple(a or ())
            return a + (("context",) if "context" not in a else ())
        return a
    return tuple((n, axes(n, a)) for n, a in rules if n != "kv_block") + (("kv_block", "context" if kv_context
                                                                           else None),)


def kv_over_context(cfg, block: int, memory: int | None, rows: int, positions: int, sizes: dict, rules) -> bool:
    """Whether the engine splits each row's KV over `context` (`decode_rules`): when context > 1 and a row of
    `positions` positions does not fit its device's part of a paged pool of `memory` bytes a device with the rows
    split over context (a dense cache or a pool of every slot's whole context always fits)."""
    if sizes.get("context", 1) == 1 or not block or memory is None:
        return False
    blocks, split = pool_blocks(cfg, block, memory, rows, positions, sizes, decode_rules(rules))
    return paged.blocks_for(positions, block) > blocks // split


def _fitting(p: P, shape, sizes: dict) -> P:
    """`p` with the mesh axes that do not divide their dimension dropped (those dimensions replicated)."""
    out = []
    for entry, dim in zip(tuple(p) + (None,) * (len(shape) - len(p)), shape):
        axes = mesh_axes(entry)
        n = math.prod(sizes.get(a, 1) for a in axes)
        out.append(entry if axes and dim % n == 0 else None)
    return P(*out)


def cache_spec(cfg, rules, sizes: dict, batch: int, length: int) -> P:
    """The `PartitionSpec` of the cache's keys and values over a mesh of axis `sizes`."""
    return _fitting(spec(CACHE_NAMES, rules), (cfg.layers, batch, length, cfg.kv_heads, cfg.head_dim), sizes)


def pool_spec(cfg, rules, sizes: dict, blocks: int, block: int) -> P:
    """The `PartitionSpec` of a paged pool's keys and values `[kv_heads, layers, blocks, block, head_dim]`."""
    return _fitting(spec(POOL_NAMES, rules), (cfg.kv_heads, cfg.layers, blocks, block, cfg.head_dim), sizes)


def block_bytes(cfg, block: int) -> int:
    """Bytes of one block of a paged pool: keys and values of `block` positions, every layer."""
    return 2 * cfg.layers * block * cfg.kv_heads * cfg.head_dim * jnp.dtype(cfg.compute_dtype).itemsize


def pool_bytes(cfg, blocks: int, block: int, sizes: dict | None = None, rules=None) -> dict:
    """A paged pool's bytes, {"total", "per_device"}, over a mesh of axis `sizes` (default one device) under the
    decode `rules` (default: of `config_keys.DEFAULT_RULES`), split as `pool_spec`."""
    sizes = sizes or {}
    p = pool_spec(cfg, rules or decode_rules(DEFAULT_RULES), sizes, blocks, block)
    split = math.prod(math.prod(sizes.get(a, 1) for a in mesh_axes(e)) for e in p)
    return {"total": blocks * block_bytes(cfg, block), "per_device": blocks * block_bytes(cfg, block) // split}


def pool_blocks(cfg, block: int, memory: int | None, rows: int, positions: int, sizes: dict, rules) -> tuple:
    """(blocks, parts) of the paged pool an engine of `rows` slots holds: `memory` bytes a device (None: a slot's
    `positions` each), in `parts` equal parts, one per shard of the rows (data x expert; 1 if they do not divide)."""
    split = math.prod(sizes.get(a, 1) for a in mesh_axes(spec(CACHE_NAMES, rules)[1]))
    split = split if rows % split == 0 else 1
    one = pool_bytes(cfg, split, block, sizes, rules)["per_device"]  # a block in each part
    blocks = rows * -(-positions // block) if memory is None else int(memory) // one * split
    return blocks - blocks % split, split


def engine_options(section) -> dict:
    """The engine's options of a config section with `kv_block`, `kv_cache_gib` (GRPO's, the generate CLI's) and
    `gather_zero3` (GRPO's; default on)."""
    gib = float(section.kv_cache_gib)
    return {"kv_block": int(section.kv_block), "kv_memory": int(gib * (1 << 30)) if gib else None,
            "gather_zero3": bool(getattr(section, "gather_zero3", True))}


def empty_pool(cfg, blocks: int, block: int, batch: int, sharding=None) -> KVCache:
    """A paged pool of `blocks` blocks of `block` positions and the positions of `batch` empty rows (inside jit)."""
    return kv_zeros(cfg, (cfg.kv_heads, cfg.layers, blocks, block, cfg.head_dim), batch, sharding)


def kv_zeros(cfg, shape, batch: int, sharding=None) -> KVCache:
    dt = jnp.dtype(cfg.compute_dtype)
    k, v = jnp.zeros(shape, dt), jnp.zeros(shape, dt)
    if sharding is not None:
        k, v = (jax.lax.with_sharding_constraint(a, sharding) for a in (k, v))
    return KVCache(k, v, jnp.zeros((cfg.layers, batch), jnp.int32))


def empty(cfg, batch: int, length: int, sharding=None) -> KVCache:
    """A cache of `batch` empty rows of `length` positions, every layer (inside jit: `sharding` constrains it)."""
    return kv_zeros(cfg, (cfg.layers, batch, length, cfg.kv_heads, cfg.head_dim), batch, sharding)


def cache_bytes(cfg, batch: int, length: int, layout: Layout | None = None, rules=None) -> dict:
    """The KV cache's bytes for `batch` rows of `length` positions: {"total", "per_device"} (keys and values; the
    positions are negligible). `layout` (default one device) and `rules` (default `config_keys.DEFAULT_RULES`)
    decide the split, as `cache_spec`."""
    total = 2 * cfg.layers * batch * length * cfg.kv_heads * cfg.head_dim * jnp.dtype(cfg.compute_dtype).itemsize
    sizes = (layout or Layout(1, 1, 1, 1)).mesh_shape
    p = cache_spec(cfg, decode_rules(rules or DEFAULT_RULES), sizes, batch, length)
    split = math.prod(math.prod(sizes[a] for a in mesh_axes(e)) for e in p)
    return {"total": int(total), "per_device": int(total // split)}


def decode_param_bytes(params) -> int:
    """Bytes of `params` (placed arrays) per device in the decode layout: each leaf's training shard times the
    number of `stage` devices its layer axis was split over (the gather `decode_params` does)."""
    out = 0
    for a in jax.tree.leaves(params):
        sh = a.sharding
        stage = sh.mesh.shape.get("stage", 1) if isinstance(sh, NamedSharding) and "stage" in str(sh.spec) else 1
        out += a.addressable_shards[0].data.nbytes * stage
    return int(out)


def decode_specs(cfg, rules, mesh, zero3: bool) -> dict:
    """The params' `PartitionSpec`s in the decode layout (ZeRO-3's data split kept when `zero3`)."""
    names = gpt.logical_axes(cfg)
    shapes = jax.eval_shape(lambda: gpt.init_params(cfg, jax.random.key(0)))
    return param_specs(names, shapes, decode_rules(rules), mesh, zero=zero3)


def layer_specs(cfg, rules, mesh) -> dict:
    """Each per-layer leaf's spec inside the layer loop (its `layers` axis gone), without ZeRO's data split: what
    ZeRO-3 gathers one layer at a time."""
    layers = gpt.split_params(decode_specs(cfg, rules, mesh, False))[1]
    return jax.tree.map(lambda p: P(*tuple(p)[1:]), layers, is_leaf=lambda p: isinstance(p, P))


def decode_params(params, cfg, rules, mesh, zero3: bool, layer_order=None, gather_zero3: bool = False):
    """The params in the decode layout: gathered over `stage` (and, `gather_zero3`, over ZeRO-3's split: the params
    whole over data x expert x context for the round) and in the canonical layer order (`layer_order[p]` is the
    canonical layer at position p of the training layout). With stage 1, the canonical order and nothing of ZeRO-3
    to gather: `params` itself, no copy."""
    gather = zero3 and gather_zero3
    if mesh.shape.get("stage", 1) == 1 and (layer_order is None or list(layer_order) == sorted(layer_order)) \
            and not gather:
        return params
    shardings = jax.tree.map(lambda p: NamedSharding(mesh, p), decode_specs(cfg, rules, mesh, zero3 and not gather),
                             is_leaf=lambda p: isinstance(p, P))
    inverse = np.argsort(np.asarray(layer_order if layer_order is not None else range(cfg.layers)))

    def gather(params):
        shared, layers = gpt.split_params(params)
        return gpt.join_params(shared, jax.tree.map(lambda a: a[inverse], layers))

    return jax.jit(gather, out_shardings=shardings)(params)


def dry_run_entry(config, num_devices: int) -> dict:
    """What `train.py --dry_run` reports of generation on the run's layout: the dense KV cache of a decode batch of
    a step's rows (`train.global_batch_size`; GRPO's completions: x `grpo.num_generations`) of `model.seq_len`
    positions ({"rows", "positions", "total", "per_device"} bytes) and, for GRPO's paged cache, its pool ("paged":
    {"block", "kv_blocks", "total", "per_device", "parts" (the rows' split), "kv_context" (each row's KV split
    over context: `kv_over_context`)})."""
    config = gpt.derived(peft.apply(start.apply(config, say=False)))
    layout = Layout.from_config(config, num_devices)
    cfg = gpt.config_from(config, int(config.model.vocab_size) or 256, layout.tensor)
    obj = objectives.from_config(config)
    rows, positions = obj.rows(config), int(config.model.seq_len)  # (GRPO: x G)
    out = {"rows": rows, "positions": positions, **cache_bytes(cfg, rows, positions, layout, step_rules(config))}
    opts = engine_options(config.get(obj.section)) if obj.samples else {"kv_block": 0}  # (GRPO's KV keys)
    if opts["kv_block"]:  # the paged pool a round's engine holds
        block, sizes, memory = opts["kv_block"], layout.mesh_shape, opts["kv_memory"]
        split_kv = kv_over_context(cfg, block, memory, rows, positions, sizes, step_rules(config))
        rules = decode_rules(step_rules(config), split_kv)
        n, parts = pool_blocks(cfg, block, memory, rows, positions, sizes, rules)
        out["paged"] = {"block": block, "kv_blocks": n, **pool_bytes(cfg, n, block, sizes, rules), "parts": parts,
                        "kv_context": split_kv}
    return out
