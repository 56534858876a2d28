"""The building blocks of both model families, Flax NNX, mesh-free: norms, rotary embeddings, attention with a KV
cache, and one transformer block per family.

`gpt2`: pre-LayerNorm block, fused QKV with biases, GELU (tanh) MLP (Radford et al. 2019). `llama`: pre-RMSNorm block,
rotary position embeddings, grouped-query attention, SwiGLU MLP, no biases (Touvron et al. 2023; Dubey et al. 2024
for Llama 3's RoPE frequency scaling). Both: column-parallel in (QKV, MLP-in: output split on `heads` / `mlp`),
row-parallel out (attention-out, MLP-out: input split), Megatron-LM's pattern (Shoeybi et al. 2019, sec. 3).

Shapes: activations `[batch, seq, embed]`; q `[batch, seq, heads, head_dim]`; k, v `[batch, seq, kv_heads, head_dim]`
(kv_heads = heads for gpt2). Statistics (norms, softmax, RoPE angles) in float32, float64 for float64 inputs.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.kernels import attention as kernels
from jaxpar.model import moe
from jaxpar.dtypes import at_least_f32  # noqa: F401 (re-exported)
from jaxpar.parallel.logical import constrain, context_split
from jaxpar.model import lora
from jaxpar.model.kv_cache import KVCache  # noqa: F401 (re-exported)
from jaxpar.model.base import LOGICAL, ROLE, matmul, param, swiglu  # noqa: F401 (re-exported)

def _ones(dim, dtype, names=("embed",)):
    return nnx.Param(jnp.ones((dim,), dtype), **{LOGICAL: names, ROLE: "norm"})


class LayerNorm(nnx.Module):
    """x `[..., dim]` -> same dtype: (x - mean) / sqrt(var + eps) · scale + bias, statistics in float32."""

    def __init__(self, dim: int, dtype, eps: float = 1e-5):
        self.scale = _ones(dim, dtype)
        self.bias = nnx.Param(jnp.zeros((dim,), dtype), **{LOGICAL: ("embed",), ROLE: "norm"})
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(at_least_f32(x.dtype))
        mean = xf.mean(-1, keepdims=True)
        var = jnp.square(xf - mean).mean(-1, keepdims=True)
        y = (xf - mean) * jax.lax.rsqrt(var + self.eps) * self.scale[...] + self.bias[...]
        return y.astype(x.dtype)


class RMSNorm(nnx.Module):
    """x `[..., dim]` -> same dtype: x / sqrt(mean(x²) + eps) · scale (Zhang & Sennrich 2019), statistics in float32;
    normalised x is cast to x's dtype before the scale, as Llama's reference code does."""

    def __init__(self, dim: int, dtype, eps: float = 1e-5, names=("embed",)):
        self.scale = _ones(dim, dtype, names)
        self.eps = eps

    def __call__(self, x):
        xf = x.astype(at_least_f32(x.dtype))
        y = (xf * jax.lax.rsqrt(jnp.square(xf).mean(-1, keepdims=True) + self.eps)).astype(x.dtype)
        return y * self.scale[...].astype(x.dtype)


# ---- rotary position embeddings (Su et al. 2021), rotate-half convention (as Hugging Face's Llama stores q, k) ----

def rope_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> np.ndarray:
    """Inverse frequencies `[head_dim / 2]` float32: theta^(-2i / head_dim), then Llama 3's scaling if given.

    `scaling` (Llama 3.1's `apply_scaling`, Dubey et al. 2024): {factor, low_freq_factor, high_freq_factor,
    original_max_len}; frequencies whose wavelength is above original_max_len / low_freq_factor are divided by factor,
    those below original_max_len / high_freq_factor kept, the band between interpolated linearly in
    original_max_len / wavelength.
    """
    inv = 1.0 / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))
    if not scaling:
        return inv.astype(np.float32)
    f, lo, hi, n = (scaling[k] for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_len"))
    wavelen = 2 * math.pi / inv
    smooth = (n / wavelen - lo) / (hi - lo)
    scaled = np.where(wavelen > n / lo, inv / f, inv)
    medium = (wavelen >= n / hi) & (wavelen <= n / lo)
    return np.where(medium, (1 - smooth) * scaled / f + smooth * scaled, scaled).astype(np.float32)


def apply_rope(x, positions, inv_freq):
    """x `[batch, seq, heads, head_dim]`, positions `[seq]` or `[batch, seq]` int32 -> x rotated, x's dtype.

    Pair (x_i, x_{i + head_dim/2}) turns by angle position · inv_freq_i."""
    f = at_least_f32(x.dtype)
    ang = jnp.asarray(positions).astype(f)[..., None] * jnp.asarray(inv_freq, f)  # [(batch,) seq, head_dim/2]
    ang = ang[None] if ang.ndim == 2 else ang
    cos, sin = jnp.cos(ang)[:, :, None], jnp.sin(ang)[:, :, None]
    x1, x2 = jnp.split(x.astype(f), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


# ---- attention --------------------------------------------------------------------------------------------------

def self_attention(q, k, v, cache: KVCache | None = None, segment_ids=None, implementation: str = "xla",
                   causal: bool = True):
    """Causal self-attention with grouped-query heads: q `[b, t, heads, hd]`, k, v `[b, t, kv_heads, hd]` ->
    (`[b, t, heads, hd]` in q's dtype, cache). Query head j reads KV head j // (heads / kv_heads), as Hugging Face's
    `repeat_kv`. `implementation`: `model.attention` (`jaxpar/kernels/attention.py`: auto | xla | cudnn | pallas). With a
    cache, attends over the cache's filled positions (`KVCache.attend`)."""
    if cache is not None:
        out, cache = cache.attend(q, k, v, implementation)
        return checkpoint_name(out, "attention"), cache
    if context_split() > 1:  # this device holds a piece of every sequence: attend over the gathered K/V
        return checkpoint_name(kernels.context_attention(q, k, v, segment_ids), "attention"), cache
    rep = q.shape[2] // k.shape[2]
    if rep > 1:  # under tensor parallelism each device then slices its own heads (KV heads split or replicated)
        k, v = (jnp.repeat(a, rep, axis=2) for a in (k, v))
    k, v = (constrain(a, ("batch", "seq", "heads", "kv")) for a in (k, v))
    impl, _ = kernels.choose(implementation, q.dtype, q.shape[1], q.shape[3], segment_ids is not None,
                             causal=causal)
    return checkpoint_name(kernels.attention(q, k, v, segment_ids, impl, causal), "attention"), cache


# ---- blocks -----------------------------------------------------------------------------------------------------

# Names for remat policies (`checkpoint_name`): "norm" (norm outputs), "qkv", "attention" (its output), "residual"
# (the stream between attention and MLP), "mlp_in" (pre-activations), "mlp_act"; what Korthikanti et al. 2022
# keep under selective recompute, everything but the attention core (`model._REMAT["selective"]`).
# the residual stream's names: `act_seq` is the sequence outside the tensor-parallel regions (norms, dropout,
# residual adds), split over `tensor` with sequence parallelism (Korthikanti et al. 2022), else like `seq`
_RESIDUAL = ("batch", "act_seq", "embed")


class _PreNormBlock(nnx.Module):
    """x + Attn(norm1(x)), then x + FFN(norm2(x)); a family fills in `qkv`, `attn_out` and its dense `mlp`. With
    `experts` the FFN is a mixture of experts (`jaxpar/model/moe.py`) in the layers `moe.is_moe_layer` names."""
    CAUSAL = True  # a decoder's attention; an encoder's (ViT) sees the whole sequence

    def __call__(self, x, cfg, drop=None, cache=None, positions=None, segments=None, layer=0, replay=None):
        """x `[batch, seq, embed]` -> (same, cache, MoE stats or None; decoding, {"experts": `[b, t, k]`}).
        `drop(y, site, rate)` applies dropout keyed by site (0, 1: the residual branches; the adapters' inputs:
        `lora.site`); `positions` `[seq]` or `[batch, seq]` (default: from each row's cache fill, else 0..seq-1);
        `cache` is for decoding; `segments` `[batch, seq]` int32 keeps attention within each packed document;
        `layer` is the block's global index (int or traced int32: which FFN a model of dense and MoE layers runs);
        `replay` `[batch, seq, k]` int32: the experts its MoE layer uses (routing replay, `moe.route`)."""
        if positions is None:
            positions = jnp.arange(x.shape[1]) if cache is None else cache.pos[:, None] + jnp.arange(x.shape[1])
        ad = lora.input_dropout(drop, cfg)
        q, k, v = self.qkv(checkpoint_name(self.ln1(x), "norm"), positions, ad)
        q, k, v = (checkpoint_name(a, "qkv") for a in (constrain(q, ("batch", "seq", "heads", "kv")), k, v))
        a, cache = self_attention(q, k, v, cache, segments, cfg.attention, self.CAUSAL)
        o = constrain(self.attn_out(a, ad), _RESIDUAL)  # sequence parallel: a reduce-scatter, not an all-reduce
        rd = (lambda y, site: drop(y, site, cfg.dropout_resid)) if drop and cfg.dropout_resid > 0 else None
        x = checkpoint_name(constrain(x + (rd(o, 0) if rd else o), _RESIDUAL), "residual")
        h = checkpoint_name(self.ln2(x), "norm")
        o, stats = self.ffn(h, cfg, layer, ad, replay)
        if cache is not None and cfg.experts:  # decoding: the experts each token used (-1 in a dense layer)
            stats = {"experts": jnp.where(moe.is_moe_layer(cfg, layer), self.moe.choices(h, cfg), -1)}
        o = constrain(o, _RESIDUAL)
        x = x + (rd(o, 1) if rd else o)
        return constrain(x, _RESIDUAL), cache, stats

    def ffn(self, h, cfg, layer, ad=None, replay=None):
        """-> (FFN output, MoE stats or None); `ad`: the adapters' input dropout (`lora.input_dropout`); `replay`:
        the experts to use (`moe.route`)."""
        if cfg.experts == 0:
            return self.mlp(h, ad), None
        if not moe.mixed(cfg):
            return self.moe(h, cfg, replay)
        return jax.lax.cond(moe.is_moe_layer(cfg, layer), lambda h: self.moe(h, cfg, replay),
                            lambda h: (self.mlp(h, ad), moe.no_stats(cfg, h)), h)


class GPT2Block(_PreNormBlock):
    """GPT-2's block. No bias on the key projection: softmax is invariant to a per-query shift, so its exact gradient
    is zero (Hugging Face's `c_attn` key bias is dropped on import, written as zeros on export)."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        d, h, hd, f = cfg.embed, cfg.heads, cfg.head_dim, cfg.mlp
        dt = jnp.dtype(cfg.weight_dtype)
        resid_std = 0.02 / math.sqrt(2 * cfg.layers)  # GPT-2 (Radford et al. 2019, sec. 2.3)
        self.ln1 = LayerNorm(d, dt, cfg.norm_eps)
        self.wqkv = param(rngs.params(), (d, 3, h, hd), 0.02, ("embed", "qkv", "heads", "kv"), dt)
        self.bqv = param(None, (2, h, hd), 0, ("qkv", "heads", "kv"), dt, "bias")  # biases of q and v; none for k
        self.wo = param(rngs.params(), (h, hd, d), resid_std, ("heads", "kv", "embed"), dt)
        self.bo = param(None, (d,), 0, ("embed",), dt, "bias")
        self.ln2 = LayerNorm(d, dt, cfg.norm_eps)
        if moe.has_dense(cfg):
            self.w_in = param(rngs.params(), (d, f), 0.02, ("embed", "mlp"), dt)
            self.b_in = param(None, (f,), 0, ("mlp",), dt, "bias")
            self.w_out = param(rngs.params(), (f, d), resid_std, ("mlp", "embed"), dt)
            self.b_out = param(None, (d,), 0, ("embed",), dt, "bias")
        if cfg.experts:
            self.moe = moe.MoE(cfg, rngs)
        lora.attach(self, self.SPECS, cfg, rngs)

    SPECS = {"wqkv": "btd,dkhe->btkhe", "wo": "bthe,hed->btd", "w_in": "btd,df->btf", "w_out": "btf,fd->btd"}

    def qkv(self, h, positions, ad=None):
        qkv = matmul(self, "wqkv", self.SPECS["wqkv"], h, ad)
        b = self.bqv[...].astype(h.dtype)
        return qkv[:, :, 0] + b[0], qkv[:, :, 1], qkv[:, :, 2] + b[1]

    def attn_out(self, a, ad=None):
        return matmul(self, "wo", self.SPECS["wo"], a, ad) + self.bo[...].astype(a.dtype)

    def mlp(self, h, ad=None):
        u = checkpoint_name(matmul(self, "w_in", self.SPECS["w_in"], h, ad) + self.b_in[...].astype(h.dtype),
                            "mlp_in")
        u = checkpoint_name(constrain(jax.nn.gelu(u, approximate=True), ("batch", "seq", "mlp")), "mlp_act")
        return matmul(self, "w_out", self.SPECS["w_out"], u, ad) + self.b_out[...].astype(h.dtype)


class LlamaBlock(_PreNormBlock):
    """Llama's block (and Qwen3's, with `qk_norm` and a `head_dim` of its own): RMSNorm, RoPE on q and k, `kv_heads`
    KV heads (`kv_heads` splits over `tensor` when it divides it, else each device holds them all and keeps its
    heads' share), SwiGLU MLP down(silu(gate(x)) · up(x))."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        d, h, kv, hd, f = cfg.embed, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp
        dt = jnp.dtype(cfg.weight_dtype)
        resid_std = 0.02 / math.sqrt(2 * cfg.layers)
        self.ln1 = RMSNorm(d, dt, cfg.norm_eps)
        self.wq = param(rngs.params(), (d, h, hd), 0.02, ("embed", "heads", "kv"), dt)
        self.wk = param(rngs.params(), (d, kv, hd), 0.02, ("embed", "kv_heads", "kv"), dt)
        self.wv = param(rngs.params(), (d, kv, hd), 0.02, ("embed", "kv_heads", "kv"), dt)
        self.wo = param(rngs.params(), (h, hd, d), resid_std, ("heads", "kv", "embed"), dt)
        if cfg.qk_norm:  # Qwen3: one RMSNorm scale over each head's features, shared by the heads, for q and for k
            self.q_norm = RMSNorm(hd, dt, cfg.norm_eps, ("kv",))
            self.k_norm = RMSNorm(hd, dt, cfg.norm_eps, ("kv",))
        self.ln2 = RMSNorm(d, dt, cfg.norm_eps)
        if moe.has_dense(cfg):
            self.w_gate = param(rngs.params(), (d, f), 0.02, ("embed", "mlp"), dt)
            self.w_up = param(rngs.params(), (d, f), 0.02, ("embed", "mlp"), dt)
            self.w_down = param(rngs.params(), (f, d), resid_std, ("mlp", "embed"), dt)
        if cfg.experts:
            self.moe = moe.MoE(cfg, rngs)
        self.inv_freq = tuple(float(x) for x in rope_frequencies(hd, cfg.rope_theta, cfg.rope_scaling_dict))
        lora.attach(self, self.SPECS, cfg, rngs)

    SPECS = {"wq": "btd,dhe->bthe", "wk": "btd,dhe->bthe", "wv": "btd,dhe->bthe", "wo": "bthe,hed->btd",
             "w_gate": "btd,df->btf", "w_up": "btd,df->btf", "w_down": "btf,fd->btd"}

    def qkv(self, h, positions, ad=None):
        q, k, v = (matmul(self, n, self.SPECS[n], h, ad) for n in ("wq", "wk", "wv"))
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        inv = np.asarray(self.inv_freq, np.float32)
        return apply_rope(q, positions, inv), apply_rope(k, positions, inv), v

    def attn_out(self, a, ad=None):
        return matmul(self, "wo", self.SPECS["wo"], a, ad)

    def mlp(self, h, ad=None):
        return swiglu(self, h, act_names=("batch", "seq", "mlp"), drop=ad)


class VitBlock(GPT2Block):
    """ViT's encoder block (Dosovitskiy et al. 2021; Hugging Face's `ViTLayer`): GPT-2's, with bidirectional
    attention, a bias on every one of q, k and v (the key's, whose gradient is zero, kept so that a checkpoint comes
    back bitwise) and the exact (erf) GELU."""
    CAUSAL = False

    def __init__(self, cfg, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        del self.bqv
        self.bqkv = param(None, (3, cfg.heads, cfg.head_dim), 0, ("qkv", "heads", "kv"), jnp.dtype(cfg.weight_dtype),
                          "bias")

    def qkv(self, h, positions, ad=None):
        qkv = matmul(self, "wqkv", self.SPECS["wqkv"], h, ad) + self.bqkv[...].astype(h.dtype)
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]

    def mlp(self, h, ad=None):
        u = checkpoint_name(matmul(self, "w_in", self.SPECS["w_in"], h, ad) + self.b_in[...].astype(h.dtype),
                            "mlp_in")
        u = checkpoint_name(constrain(jax.nn.gelu(u, approximate=False), ("batch", "seq", "mlp")), "mlp_act")
        return matmul(self, "w_out", self.SPECS["w_out"], u, ad) + self.b_out[...].astype(h.dtype)


# ---- embedding lookup, packed positions, dropout (used by the model's embed and blocks) ------------------------

@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def lookup(table, ids, dtype):
    """Embedding lookup: table `[vocab, embed]`, ids `[batch, seq]` int32 -> `[batch, seq, embed]` in `dtype`.

    A gather, no matmul FLOPs. Over a `vocab`-sharded table XLA's partitioner makes it Megatron's vocab-parallel
    lookup (each device gathers the ids in its range, zeros elsewhere, then a sum over `tensor`); the table is cast
    first so that sum moves `dtype` bytes. The backward scatter-adds in the table's dtype (float32 sums for repeated
    ids, not bf16)."""
    return jnp.take(table.astype(dtype), ids, axis=0, mode="clip")


def _lookup_fwd(table, ids, dtype):
    return lookup(table, ids, dtype), (ids, jnp.zeros((table.shape[0], 0), table.dtype))  # the table's rows, dtype


def _lookup_bwd(dtype, res, g):
    ids, like = res
    dt = jnp.zeros((like.shape[0], g.shape[-1]), like.dtype).at[ids].add(g.astype(like.dtype), mode="clip")
    return dt, None  # (a sharding constraint here would run outside the pipeline's shard_map context)


lookup.defvjp(_lookup_fwd, _lookup_bwd)


def segment_positions(segments):
    """segments `[batch, seq]` int32 -> int32 positions counted from each segment's first token (Megatron's
    `reset_position_ids`)."""
    i = jnp.arange(segments.shape[-1], dtype=jnp.int32)
    first = jnp.concatenate([jnp.ones_like(segments[:, :1], bool), segments[:, 1:] != segments[:, :-1]], axis=1)
    return i - jax.lax.cummax(jnp.where(first, i, 0), axis=1)


def dropout(x, rate, key, seq_ids):
    """Inverted dropout whose mask depends only on (key, global sequence id): the same under any layout.

    x `[batch, seq, ...]`, seq_ids `[batch]` int32 (the global index of each sequence in the step's batch)."""
    keys = jax.vmap(jax.random.fold_in, (None, 0))(key, seq_ids)
    keep = jax.vmap(lambda k: jax.random.bernoulli(k, 1.0 - rate, x.shape[1:]))(keys)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)
