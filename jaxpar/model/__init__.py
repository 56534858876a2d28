"""The decoder of both families (`arch`: gpt2 or llama; their blocks are `jaxpar/model/layers.py`) in Flax NNX, with logical
axis names on every parameter and no knowledge of meshes.

Parameters live as a plain nested dict (`params`), the same tree whatever the layout; the block parameters are
stacked on a leading `layers` axis. `GPT` (NNX modules) defines and initialises them; `Forward` applies them as pure
functions in three pieces — `embed`, `layers` (any contiguous chunk of the stack, so a pipeline stage can run its
own), `head_loss` — so the pipeline can place them without knowing what a GPT is — and `decode` (one step with
a KV cache, for sampling; the same attention).

The model's spec lives here and nowhere else (with `jaxpar/model/config.py`: its config from the run config,
`config_from`, and the fields that define it, `IDENTITY_FIELDS`: what a resume or an export must match): its FLOPs
per token (active parameters for a mixture of experts), each parameter's role (which
decides weight decay and what counts in FLOPs), and the split of the params into per-layer and shared parts
(`split_params`, `join_params`, `map_layers`: no other module names the per-layer subtree).

Shapes: tokens `[batch, seq]` int32; activations `[batch, seq, embed]` in the compute dtype; logits
`[batch, seq, vocab]` float32 (vocab padded; padded entries masked to -inf before the softmax).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.model import lora, moe, vit
from jaxpar.model.config import (IDENTITY_FIELDS, LORA_FIELDS, MOE_FIELDS, ROPE_SCALINGS, SHAPE_FIELDS,  # noqa: F401
                                 ZERO_COUNTS, ModelConfig, config_from, has_dropout, identity,
                                 identity_defaults)  # the spec's config, re-exported
from jaxpar.kernels.cross_entropy import cross_entropy, token_log_probs
from jaxpar.parallel.logical import constrain
from jaxpar.model.layers import (BLOCKS, LOGICAL, NORMS, ROLE, KVCache, at_least_f32, dropout, lookup, param,  # noqa: F401
                       segment_positions)  # re-exported
from jaxpar.model.keys import KEY_SEP, flatten, param_items, unflatten  # noqa: F401 (the canonical keys, re-exported)

_LAYERS = "blocks"  # the per-layer subtree of the params (leaves stacked on a leading `layers` axis)
ARCHS = tuple(BLOCKS)  # model families: "gpt2", "llama"
class GPT(nnx.Module):
    """Token embeddings (+ gpt2's position table), `layers` stacked blocks of the family, final norm, LM head (tied to
    `wte` by default)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.weight_dtype)
        if cfg.arch == "vit":  # patches, class token and positions in; a classifier out (`jaxpar/model/vit.py`)
            vit.add_embedding(self, cfg, rngs, dt)
        else:
            self.wte = param(rngs.params(), (cfg.vocab_size, cfg.embed), 0.02, ("vocab", "embed"), dt, "embedding")
        if cfg.arch == "gpt2":
            self.wpe = param(rngs.params(), (cfg.max_positions, cfg.embed), 0.02, ("seq", "embed"), dt, "position")

        @nnx.split_rngs(splits=cfg.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(r):
            return BLOCKS[cfg.arch](cfg, r)

        self.blocks = make_blocks(rngs)
        self.ln_f = NORMS[cfg.arch](cfg.embed, dt, cfg.norm_eps)
        if cfg.arch == "vit":
            vit.add_head(self, cfg, rngs, dt)
        elif not cfg.tie_embeddings:
            self.lm_head = param(rngs.params(), (cfg.embed, cfg.vocab_size), 0.02, ("embed", "vocab"), dt)


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
    block = nnx.eval_shape(lambda: BLOCKS[cfg.arch](cfg, nnx.Rngs(params=0)))
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


def model_flops_per_token(n_params: int, layers: int, embed: int, seq_len: int) -> float:
    """Model FLOPs per trained token (forward + backward), PaLM's MFU numerator.

    Formula (Chowdhery et al. 2022, "PaLM: Scaling Language Modeling with Pathways", Appendix B, "Compute
    usage and model FLOPs utilization"): ``6 N + 12 L H Q T`` with H heads of size Q, so ``H Q = d_model``:

        flops_per_token = 6 * n_params + 12 * layers * embed * seq_len

    * ``6 N``: every parameter takes part in one multiply-add (2 FLOPs) per token in the forward pass and two in
      the backward pass (gradient w.r.t. activations and w.r.t. weights).
    * ``12 L d T``: the attention score and value matmuls (``Q K^T`` and ``P V``), which have no parameters:
      2 matmuls x 2 FLOPs x T x d per token per layer forward, x3 for forward + backward. As in PaLM, the full
      T x T attention matrix is counted (the causal mask's skipped half is not subtracted).
    * Rematerialisation (activation recompute) is excluded by definition: these are *model* FLOPs, so MFU does
      not go up when the trainer recomputes more (PaLM Appendix B contrasts this with hardware FLOPs utilisation).

    Args:
      n_params: N, the number of trained parameters with the tied token embedding counted once (its matmul is
        the output projection to the vocabulary; the input lookup is a gather with no FLOPs) and the learned
        position embedding left out (a lookup and an add, no matmul). The caller computes N from the params tree.
      layers: L, the number of transformer blocks.
      embed: heads x head size: d_model, the residual width, unless the model sets its head size apart (Qwen3).
      seq_len: T, the training sequence length in tokens.

    Returns:
      FLOPs per token (float).
    """
    for name, v in (("n_params", n_params), ("layers", layers), ("embed", embed), ("seq_len", seq_len)):
        if v < 0:
            raise ValueError(f"{name}={v} must be >= 0.")
    return 6.0 * float(n_params) + 12.0 * float(layers) * float(embed) * float(seq_len)


def flops_per_token(cfg: ModelConfig) -> float:
    """Model FLOPs per trained token, PaLM's 6N + 12·L·d·T (`model_flops_per_token`), N = the parameters a token's
    matmuls use: every weight, the token table only as the tied LM head (as an input table it is a lookup, as
    TorchTitan counts), no norm, bias or position table, and of a MoE layer the router, the shared experts and k of
    the routed experts (the active parameters). With LoRA the frozen weights take no weight gradient: 4 FLOPs per
    frozen weight and 6 per adapter parameter (as the compiled step runs them)."""
    counts = param_counts(cfg)
    full = model_flops_per_token(counts["matmul"], cfg.layers, cfg.heads * cfg.head_dim, cfg.seq_len)
    if cfg.arch == "vit":  # the classifier runs on one token of each image's seq_len
        full -= 6.0 * cfg.embed * cfg.num_classes * (1.0 - vit.head_share(cfg))
    return full - 2.0 * counts["matmul"] + 6.0 * counts["trainable"] if cfg.lora_rank else full


def _sizes(cfg: ModelConfig):
    """(parameter shapes, roles), abstract."""
    return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0))), param_roles(cfg)


def _count(shapes, roles, keep) -> int:
    return sum(math.prod(a.shape) for a, r in zip(jax.tree.leaves(shapes), jax.tree.leaves(roles)) if keep(r))


def _layer_matmul(cfg: ModelConfig) -> float:
    """Active matmul parameters per layer, averaged over the layers (dense and MoE layers as the config mixes
    them)."""
    def per_layer(c, moe_layer: bool):
        shapes, roles = (split_params(t)[1] for t in _sizes(c))
        weights = _count(shapes, roles, lambda r: r in ("weight", "router"))
        experts = _count(shapes, roles, lambda r: r == "expert")
        return (weights + (experts * c.experts_per_token / c.experts if moe_layer else 0)) / c.layers

    if cfg.experts == 0:
        return per_layer(cfg, False)
    n_moe = sum(bool(moe.is_moe_layer(cfg, i)) for i in range(cfg.layers))
    sparse = per_layer(dataclasses.replace(cfg, first_dense_layers=0, moe_every=1), True)
    dense = per_layer(dataclasses.replace(cfg, experts=0), False)
    return (n_moe * sparse + (cfg.layers - n_moe) * dense) / cfg.layers


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """The model's parameter counts (abstract: nothing allocated), what the planner and reports read: "total";
    "layer" (one block, every tensor) and "layer_matmul" (its active matmul weights, averaged over the layers);
    "shared" (outside the blocks: the tables, the final norm); "trainable" (all of them, or with LoRA the
    adapters: what has gradients and optimizer state); "experts" (the routed experts' weights, all layers);
    "matmul" (N of `flops_per_token`: the active matmul parameters)."""
    shapes, roles = _sizes(cfg)
    size = lambda tree: sum(math.prod(a.shape) for a in jax.tree.leaves(tree))  # noqa: E731
    (shared, layers), (shared_roles, _) = split_params(shapes), split_params(roles)
    head = _count(shared, shared_roles, lambda r: r == "weight" or (r == "embedding" and cfg.tie_embeddings))
    layer_mm = _layer_matmul(cfg)
    return {"total": size(shapes), "trainable": size(trainable(shapes, cfg)), "layer": size(layers) // cfg.layers,
            "layer_matmul": round(layer_mm),
            "shared": size(shared), "experts": _count(shapes, roles, lambda r: r == "expert"),
            "matmul": round(head + layer_mm * cfg.layers)}


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


# Korthikanti et al. 2022's selective recompute (sec. 5): keep what their eq. 1 counts except the attention core
# (QK^T, softmax, ·V), which the backward recomputes; the names are the block's (`jaxpar/model/layers.py`) (a MoE layer's
# dispatched tokens too: saving them spares the backward pass an all-to-all)
_SELECTIVE = ("norm", "qkv", "attention", "residual", "mlp_in", "mlp_act", "moe_dispatch")
_REMAT = {
    "full": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "selective": jax.checkpoint_policies.save_only_these_names(*_SELECTIVE),
    "attention": jax.checkpoint_policies.save_only_these_names("attention"),
    # the same residuals as `selective`, kept in pinned host memory between the forward and the backward pass
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(_SELECTIVE),
        offload_src="device", offload_dst="pinned_host"),
}


def _positions(positions, segments):
    """The tokens' positions: given, or each segment's from its start."""
    return positions if positions is not None else segment_positions(segments)


class Forward:
    """Pure functions over the params dict; build once per config (holds the block's graph definition)."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.block_def = nnx.graphdef(nnx.eval_shape(lambda: BLOCKS[cfg.arch](cfg, nnx.Rngs(params=0))))
        self.norm_def = nnx.graphdef(NORMS[cfg.arch](1, jnp.float32, cfg.norm_eps))
        self.cdt = jnp.dtype(cfg.compute_dtype)

    @jax.named_scope("embed")  # the scope names in the HLO's op_name metadata (`hlo_flops` reads them)
    def embed(self, params, tokens, rng=None, seq_ids=None, pos0=0, segments=None, positions=None):
        """tokens `[batch, seq]` int32 -> `[batch, seq, embed]` (compute dtype); positions start at `pos0`, or at
        each segment's start (`segments` `[batch, seq]` int32: packed documents), or are given (`positions`
        `[batch, seq]` int32: a context-parallel shard of a sequence, `jaxpar/parallel/context.py`)."""
        if self.cfg.arch == "vit":  # tokens: images `[batch, H, W, channels]`
            x = vit.embed(params, tokens, self.cfg.patch_size, self.cdt)
        else:
            x = lookup(params["wte"], constrain(tokens, ("batch", "seq")), self.cdt)
        if self.cfg.arch == "gpt2":  # gpt2's learned positions; llama rotates q and k in each block instead
            if positions is None and segments is None:
                pos = jax.lax.dynamic_slice_in_dim(params["wpe"], pos0, tokens.shape[1], 0)[None]
            else:
                pos = jnp.take(params["wpe"], _positions(positions, segments), axis=0)
            x = x + pos.astype(self.cdt)
        if rng is not None and self.cfg.dropout_embed > 0:
            x = dropout(x, self.cfg.dropout_embed, jax.random.fold_in(rng, 0), seq_ids)
        # not split on `act_seq`: the pipeline's stage-0 branch and its buffer reads must agree on the layout
        return constrain(x, ("batch", "seq", "embed"))

    def layers(self, block_params, x, rng=None, seq_ids=None, first_layer=0, prepare=None, segments=None,
               positions=None):
        """Apply the stacked blocks `block_params` (leading axis: layers of this chunk) to x `[batch, seq, embed]`.

        `first_layer` is the global index of the chunk's first layer (it keys dropout, so any split agrees).
        `prepare(layer_params)`, if given, runs on each layer's params inside the scan before use (ZeRO-3 gathers
        them there, one layer at a time). `segments`, `positions`: as in `block`."""
        return self.layers_and_stats(block_params, x, rng, seq_ids, first_layer, prepare, segments, positions)[0]

    def layers_and_stats(self, block_params, x, rng=None, seq_ids=None, first_layer=0, prepare=None, segments=None,
                         positions=None):
        """`layers`, also returning the MoE layers' stats (`jaxpar/model/moe.py: STATS`, leaves `[layers of the chunk,
        ...]`; None for a dense model)."""
        cfg = self.cfg

        def one(x, inp):
            p, i = inp
            return self.block(prepare(p) if prepare is not None else p, x, rng, seq_ids, i, segments, stats=True,
                              positions=positions)

        if cfg.remat != "none":
            one = jax.checkpoint(one, policy=_REMAT[cfg.remat], prevent_cse=False)
        n = jax.tree.leaves(block_params)[0].shape[0]
        return jax.lax.scan(one, x, (block_params, first_layer + jnp.arange(n)))

    def block(self, layer_params, x, rng=None, seq_ids=None, layer=0, segments=None, stats=False, positions=None):
        """One transformer block (params without the `layers` axis) on x `[batch, seq, embed]`; `layer` is its
        global index (int or traced int32), which keys its dropout. `segments` `[batch, seq]` int32 (packed
        documents): attention within a segment only, positions from each segment's start; `positions` `[batch, seq]`
        int32, if given, are the tokens' (a context-parallel shard). With `stats`: (x, the MoE layer's stats or
        None)."""
        cfg = self.cfg
        drop = None
        if rng is not None and has_dropout(cfg):
            lk = jax.random.fold_in(rng, 1 + layer)
            drop = lambda y, site, rate: dropout(y, rate, jax.random.fold_in(lk, site), seq_ids)
        positions = None if positions is None and segments is None else _positions(positions, segments)
        y, _, st = nnx.merge(self.block_def, layer_params)(x, cfg, drop, None, positions, segments, layer)
        return (y, st) if stats else y

    def logits(self, params, x):
        """x `[batch, seq, embed]` -> float32 logits `[batch, seq, vocab]`, padded ids set to -inf."""
        cfg = self.cfg
        h = nnx.merge(self.norm_def, params["ln_f"])(x)
        w = params["wte"].T if cfg.tie_embeddings else params["lm_head"]
        z = jnp.einsum("btd,dv->btv", h, w.astype(self.cdt), preferred_element_type=at_least_f32(self.cdt))
        z = constrain(z, ("batch", "seq", "vocab"))
        if cfg.vocab_real < cfg.vocab_size:
            z = jnp.where(jnp.arange(cfg.vocab_size) < cfg.vocab_real, z, -jnp.inf)
        return z

    def class_logits(self, params, x):
        """ViT: x `[batch, seq, embed]` (the last layer's output) -> logits `[batch, num_classes]` (float32 at
        least) of the class token after the final norm."""
        return vit.logits(params, nnx.merge(self.norm_def, params["ln_f"])(x[:, 0]))

    @jax.named_scope("head")
    def classify(self, params, x, labels, weights):
        """ViT: (summed cross-entropy of the images' labels `[batch]` int32 under `weights` `[batch]`, [weight sum,
        weighted top-1 hits])."""
        return vit.loss(self.class_logits(params, x), labels, weights)

    @jax.named_scope("head")
    def head_loss(self, params, x, targets, mask):
        """Summed next-token cross-entropy (nats) over tokens where mask is 1, and the number of such tokens, by
        chunks of `loss_chunk` positions (`jaxpar/kernels/cross_entropy.py`: the float32 logits never whole).

        targets `[batch, seq]` int32, mask `[batch, seq]` float32 -> (loss_sum, token_count), float32 scalars."""
        cfg = self.cfg
        h = constrain(nnx.merge(self.norm_def, params["ln_f"])(x), ("batch", "seq", "embed"))  # SP: gather seq
        w = params["wte"].T if cfg.tie_embeddings else params["lm_head"]
        return cross_entropy(h, w, targets, mask, cfg.vocab_real, cfg.loss_chunk)

    @jax.named_scope("head")
    def token_logps(self, params, x, targets):
        """Each position's log-probability of its target under the model: x `[batch, seq, embed]` (the last layer's
        output), targets `[batch, seq]` int32 -> `[batch, seq]` float32 (`kernels.cross_entropy.token_log_probs`)."""
        cfg = self.cfg
        h = constrain(nnx.merge(self.norm_def, params["ln_f"])(x), ("batch", "seq", "embed"))
        w = params["wte"].T if cfg.tie_embeddings else params["lm_head"]
        return token_log_probs(h, w, targets, cfg.vocab_real, cfg.loss_chunk)

    def loss(self, params, tokens, targets, mask, rng=None, seq_ids=None, prepare=None, segments=None,
             positions=None):
        """The whole model on one (micro)batch: (loss_sum, token_count). `prepare`, `segments`, `positions`: as in
        `layers`."""
        return self.loss_and_stats(params, tokens, targets, mask, rng, seq_ids, prepare, segments, positions)[:2]

    def loss_and_stats(self, params, tokens, targets, mask, rng=None, seq_ids=None, prepare=None, segments=None,
                       positions=None, head=None):
        """`loss`, and the MoE layers' stats (`layers_and_stats`). `head(params, x) -> (loss_sum, count)` replaces
        the next-token loss (a training objective's own: `jaxpar/train/objective.py`)."""
        x = self.embed(params, tokens, rng, seq_ids, segments=segments, positions=positions)
        x, stats = self.layers_and_stats(params[_LAYERS], x, rng, seq_ids, prepare=prepare, segments=segments,
                                         positions=positions)
        out = self.head_loss(params, x, targets, mask) if head is None else head(params, x)
        return (*out, stats)

    def init_cache(self, batch: int, length: int | None = None) -> KVCache:
        """An empty KV cache for `batch` sequences of up to `length` tokens (default max_positions), every layer
        (leading `[layers]` axis), `kv_heads` heads."""
        cfg = self.cfg
        shape = (cfg.layers, batch, length or cfg.max_positions, cfg.kv_heads, cfg.head_dim)
        pos = jnp.zeros((cfg.layers, batch), jnp.int32)
        return KVCache(jnp.zeros(shape, self.cdt), jnp.zeros(shape, self.cdt), pos)

    def decode(self, params, tokens, caches: KVCache):
        """tokens `[batch, t]` at positions caches.pos.. -> (last-position logits `[batch, vocab]`, new caches)."""
        x = self.embed(params, tokens, positions=caches.pos[0][:, None] + jnp.arange(tokens.shape[1]))

        def one(x, inp):
            p, c, i = inp
            return nnx.merge(self.block_def, p)(x, self.cfg, None, c, layer=i)[:2]

        x, caches = jax.lax.scan(one, x, (params[_LAYERS], caches, jnp.arange(self.cfg.layers)))
        return self.logits(params, x[:, -1:])[:, 0], caches
