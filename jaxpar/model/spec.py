"""The model spec (mesh-free): `GPT` (Flax NNX) defines and initialises the parameters of any family
(`jaxpar/model/families/`), with logical axis names and a role on every one; as a plain nested dict (`params`), the
same tree whatever the layout, the block parameters stacked on a leading `layers` axis.

Here and nowhere else: each parameter's role (which decides weight decay and what counts in FLOPs), what trains under
LoRA and its tree plumbing (`split_trainable`, `merge_adapters`), and the split of the params into per-layer and shared
parts (`split_params`, `join_params`, `map_layers`: no other module names the per-layer subtree).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.model import lora
from jaxpar.model.config import ModelConfig
from jaxpar.model.layers import LOGICAL, ROLE

_LAYERS = "blocks"  # the per-layer subtree of the params (leaves stacked on a leading `layers` axis)


class GPT(nnx.Module):
    """The family's input end (`Family.add_embedding`: token embeddings and gpt2's position table, or a ViT's
    patches), `layers` stacked blocks of the family, the final norm, the output end (`Family.add_head`: an LM head
    unless tied to `wte`, or a ViT's classifier)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt, family = jnp.dtype(cfg.weight_dtype), cfg.family
        family.add_embedding(self, cfg, rngs, dt)

        @nnx.split_rngs(splits=cfg.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(r):
            return family.block(cfg, r)

        self.blocks = make_blocks(rngs)
        self.ln_f = family.norm(cfg.embed, dt, cfg.norm_eps)
        family.add_head(self, cfg, rngs, dt)


def init_params(cfg: ModelConfig, key: jax.Array) -> dict:
    """Fresh parameters as a nested dict of arrays `{wte, wpe, blocks: {...[layers, ...]}, ln_f, [lm_head]}`.

    Values depend only on `key` and `cfg` (jit it with any out_shardings: threefry is partitionable)."""
    return nnx.to_pure_dict(nnx.split(GPT(cfg, nnx.Rngs(params=key)))[1])


def _metadata(cfg: ModelConfig, key: str) -> dict:
    """The params tree with, per leaf, its Param metadata entry `key`."""
    model = nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(params=0)))
    meta = jax.tree.map(lambda v: v.get_metadata()[key], nnx.state(model),
                        is_leaf=lambda v: isinstance(v, nnx.Variable))
    return nnx.to_pure_dict(meta) if not isinstance(meta, dict) else meta


def logical_axes(cfg: ModelConfig) -> dict:
    """The params tree with, per leaf, a tuple of logical axis names (per-layer leaves start with `layers`)."""
    names = _metadata(cfg, LOGICAL)
    names[_LAYERS] = jax.tree.map(lambda t: ("layers",) + tuple(t), names[_LAYERS],
                                  is_leaf=lambda t: isinstance(t, tuple))
    return names


def param_roles(cfg: ModelConfig) -> dict:
    """The params tree with, per leaf, its role: weight (a matmul's), bias, norm, embedding (the token table, also
    the tied LM head), position (the learned position table)."""
    return _metadata(cfg, ROLE)


def decay_mask(cfg: ModelConfig) -> dict:
    """True for each parameter AdamW decays: matmul weights and LoRA adapters; not biases, norms or embedding tables
    (GPT-2, Megatron; PEFT's adapters under Hugging Face's Trainer)."""
    return jax.tree.map(lambda r: r in ("weight", "expert", "router", "adapter"), param_roles(cfg))


def split_trainable(tree: dict, cfg: ModelConfig) -> tuple[dict, dict]:
    """A params-shaped tree -> (what trains, what is frozen): with LoRA the adapters and the base; else (tree, {})."""
    return lora.split_trainable(tree, cfg.lora_rank > 0)


def trainable(tree: dict, cfg: ModelConfig) -> dict:
    """The part of a params-shaped tree that trains (`split_trainable`)."""
    return split_trainable(tree, cfg)[0]


merge_trainable = lora.merge  # the inverse of `split_trainable` (and of `split_adapters`)


def split_adapters(tree: dict) -> tuple[dict, dict]:
    """A params-shaped tree -> (its LoRA adapters, the rest: the model without them; all of it without LoRA)."""
    return lora.split_trainable(tree, True)


def block_weights(cfg: ModelConfig) -> set[str]:
    """The block paths of the blocks' matmul weights ("wq", "moe.experts.w_gate"): what LoRA may adapt."""
    plain = dataclasses.replace(cfg, lora_rank=0, lora_targets=())
    _, layers = split_params(param_roles(plain))
    out = set()

    def walk(node, path):
        for k, v in node.items():
            if isinstance(v, dict):
                walk(v, f"{path}{k}.")
            elif v in ("weight", "expert"):
                out.add(path + k)

    walk(layers, "")
    return out


def adapter_specs(cfg: ModelConfig) -> dict:
    """{block path of each weight with a LoRA adapter ("wq", "moe.experts.w_gate"): its matmul's einsum spec}."""
    block = nnx.eval_shape(lambda: cfg.family.block(cfg, nnx.Rngs(params=0)))
    return {".".join(str(p) for p in path[:-2] + path[-1:]): m.spec for path, m in nnx.iter_graph(block)
            if isinstance(m, lora.LoRA)}


def merge_adapters(params: dict, cfg: ModelConfig) -> tuple[dict, ModelConfig]:
    """(params with the LoRA adapters folded into their base weights, in float32 at least; the config of that plain
    model): what an export of a LoRA run writes as a model (PEFT's `merge_and_unload`)."""
    if cfg.lora_rank == 0:
        return params, cfg
    plain = dataclasses.replace(cfg, lora_rank=0, lora_targets=(), lora_dropout=0.0, base_dtype="",
                                param_dtype=cfg.weight_dtype)
    return lora.merged(params, adapter_specs(cfg), cfg.lora_scale), plain


# ---- the per-layer / shared split: the only place that names the per-layer subtree ---------------------------------

def split_params(params: dict) -> tuple[dict, dict]:
    """params -> (shared: embeddings, final norm, head; layers: the stacked per-layer tree, leaves `[L, ...]`)."""
    return {k: v for k, v in params.items() if k != _LAYERS}, params[_LAYERS]


def join_params(shared: dict, layers) -> dict:
    """The inverse of `split_params`."""
    return {**shared, _LAYERS: layers}


def router_bias(params):
    """The MoE layers' choice biases `[layers, experts]` (`jaxpar/model/moe.py`)."""
    return params[_LAYERS]["moe"]["router_bias"]


def with_router_bias(params, bias) -> dict:
    """`params` with the choice biases replaced by `bias`."""
    layers = {**params[_LAYERS], "moe": {**params[_LAYERS]["moe"], "router_bias": bias}}
    return join_params(split_params(params)[0], layers)


def map_layers(tree, fn):
    """Apply `fn` to every leaf under the per-layer subtree, wherever it sits in `tree` (params, and the optimizer
    state that mirrors them)."""
    in_layers = lambda path: any(getattr(k, "key", None) == _LAYERS for k in path)
    return jax.tree_util.tree_map_with_path(lambda path, a: fn(a) if in_layers(path) else a, tree)
