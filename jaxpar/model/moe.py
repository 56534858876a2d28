"""A mixture-of-experts feed-forward layer (Flax NNX, mesh-free): router, top-k choice, per-sequence capacity,
dispatch to the experts (`jaxpar/model/moe_dispatch.py`: fixed-size buffers and one batched matmul, or the choices
sorted by expert and grouped matmuls, `model.moe_impl`), combine; optional shared experts.

Routing (float32): scores = softmax or sigmoid of the router logits `[batch, seq, experts]`; each token takes the k
experts with the highest score + `router_bias` (DeepSeek-V3's aux-loss-free balancing: the bias only chooses, it never
weighs); its weights are those k scores, renormalised to sum to 1 with `router_norm_topk` (Mixtral, Qwen3).

Capacity is per sequence, so it does not depend on the layout: every expert holds C slots per sequence, C = seq_len
when dropless (`capacity_factor = 0`: a token never picks an expert twice) else ceil(factor x seq_len x k /
experts). Slots fill in priority order, all first choices of the sequence before the second choices (GShard), each
choice in token order; a choice that finds its expert full is dropped: it adds nothing (the token keeps its
residual and its other choices).

Expert parallelism: the buffers, or the sorted rows, go to the devices that hold their experts and come back
through `logical.exchange_experts` (all-to-alls over the `expert` mesh axis inside the step's `shard_map`, the
identity elsewhere). Context parallelism: each device routes and computes its own tokens; capacity and the
sequence-wise statistics count the whole sequence from all-gathered per-chunk counts.

Per layer it reports (sums over the batch rows it saw, float32): `load` `[experts]` (choices per expert, before
capacity), `dropped` (choices dropped), `aux` (the load-balancing loss summed over sequences: per sequence
E x sum_e f_e P_e, f_e its fraction of the sequence's choices, P_e its mean probability, Switch/GShard/DeepSeek's
sequence-wise form) and `z` (the router z-loss summed over sequences: per sequence the mean over tokens of
logsumexp(logits)^2, ST-MoE). The step weighs `aux` and `z` by `model.aux_loss` / `model.router_z_loss` and divides by
the global batch (`jaxpar/train/step.py`), so they too equal the one-device run on every layout.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.dtypes import at_least_f32
from jaxpar.parallel.logical import constrain, context_split
from jaxpar.model import lora, moe_dispatch as dispatch
from jaxpar.model.base import param, swiglu
from jaxpar.parallel.shard_map_body import vary_like

STATS = ("load", "dropped", "aux", "z")  # what a MoE layer reports (see the module docstring)


def capacity(cfg, seq: int) -> int:
    """Slots per expert per sequence: seq (dropless) or ceil(capacity_factor x seq x k / experts), at least 1."""
    if cfg.capacity_factor == 0:
        return seq
    return max(1, min(seq, math.ceil(cfg.capacity_factor * seq * cfg.experts_per_token / cfg.experts)))


def is_moe_layer(cfg, layer):
    """Whether layer `layer` (int or traced int32) is a MoE layer: after `first_dense_layers`, every `moe_every`-th."""
    if cfg.experts == 0:
        return False
    return (layer >= cfg.first_dense_layers) & ((layer + 1) % cfg.moe_every == 0)


def mixed(cfg) -> bool:
    """Whether the model has both dense and MoE layers (each layer then holds both feed-forward kinds)."""
    return cfg.experts > 0 and (cfg.first_dense_layers > 0 or cfg.moe_every > 1)


def has_dense(cfg) -> bool:
    """Whether a block holds the family's dense MLP: a dense model, or one of dense and MoE layers."""
    return cfg.experts == 0 or mixed(cfg)


def route(logits, bias, cfg, replay=None):
    """logits `[b, t, E]` float32, bias `[E]` -> (scores `[b, t, E]`, chosen experts `[b, t, k]` int32, their
    weights `[b, t, k]`). `replay` `[b, t, k]` int32, if given, are the experts chosen where they are >= 0 (routing
    replay: the choices of the pass that sampled the tokens; -1, the router's own): the weights are still this
    router's scores of them, so the router gets its gradient."""
    scores = jax.nn.softmax(logits, -1) if cfg.router == "softmax" else jax.nn.sigmoid(logits)
    _, idx = jax.lax.top_k(scores + jax.lax.stop_gradient(bias).astype(scores.dtype), cfg.experts_per_token)
    if replay is not None:
        idx = jnp.where(replay >= 0, replay, idx)
    w = jnp.take_along_axis(scores, idx, -1)
    if cfg.router_norm_topk:
        w = w / jnp.sum(w, -1, keepdims=True)
    return scores, idx, w


def balance_stats(logits, scores, counts, cfg, seq: int | None = None):
    """The per-sequence auxiliary losses, summed over the rows: (aux, z) scalars in the logits' dtype. `counts`
    `[b, E]`: each sequence's choices per expert; `seq`: its length (default: the logits'). Under context
    parallelism (logits: this device's tokens; counts and seq: the whole sequence's) these are this device's terms,
    whose sum over the context devices is the whole (aux is linear in the probabilities: counts carry no gradient)."""
    E, k = cfg.experts, cfg.experts_per_token
    seq = logits.shape[1] if seq is None else seq
    probs = scores if cfg.router == "softmax" else scores / jnp.sum(scores, -1, keepdims=True)
    f = counts.astype(logits.dtype) / (k * seq)  # [b, E]
    aux = E * jnp.sum(f * jnp.sum(probs, 1) / seq)
    z = jnp.sum(jnp.sum(jnp.square(jax.nn.logsumexp(logits, -1)), 1) / seq)
    return aux, z


def implementation(cfg) -> str:
    """`buffers` or `ragged`: `model.moe_impl`. The trainer and the planner resolve `auto` before building the step
    (`jaxpar/plan/target.py`: the one the cost model prices cheaper on the target); a config that still says `auto`
    here (a step built without them: tests, decoding) runs `buffers`, on every backend."""
    return "buffers" if cfg.moe_impl == "auto" else cfg.moe_impl


class SwiGLU(nnx.Module):
    """A SwiGLU MLP `embed -> f -> embed`; with `experts`, one per expert, weights `[experts, ...]`."""

    def __init__(self, rngs, d: int, f: int, layers: int, dtype, experts: int = 0, cfg=None, prefix: str = ""):
        """`cfg`, `prefix`: the model config and this MLP's block path (`moe.experts.`), for its LoRA adapters."""
        lead, names = ((experts,), ("experts",)) if experts else ((), ())
        role = "expert" if experts else "weight"
        self.w_gate = param(rngs.params(), lead + (d, f), 0.02, names + ("embed", "mlp"), dtype, role)
        self.w_up = param(rngs.params(), lead + (d, f), 0.02, names + ("embed", "mlp"), dtype, role)
        self.w_down = param(rngs.params(), lead + (f, d), 0.02 / math.sqrt(2 * layers), names + ("mlp", "embed"),
                            dtype, role)
        self.specs = (spec_in, spec_out) = ("becd,edf->becf", "becf,efd->becd") if experts else \
            ("btd,df->btf", "btf,fd->btd")
        if cfg is not None:
            lora.attach(self, {"w_gate": spec_in, "w_up": spec_in, "w_down": spec_out}, cfg, rngs, prefix)

    def __call__(self, h):
        return swiglu(self, h, *self.specs)


class MoE(nnx.Module):
    """Router `[embed, experts]`, its choice bias `[experts]` (trained by the step's balancing rule, not the
    optimizer), routed SwiGLU experts, and `shared_experts` always-on ones (one MLP of their summed width)."""

    def __init__(self, cfg, rngs: nnx.Rngs):
        dt = jnp.dtype(cfg.weight_dtype)
        self.router = param(rngs.params(), (cfg.embed, cfg.experts), 0.02, ("embed", "router"), dt, "router")
        self.router_bias = param(None, (cfg.experts,), 0, ("router",), at_least_f32(dt), "router_bias")
        self.experts = SwiGLU(rngs, cfg.embed, cfg.expert_mlp, cfg.layers, dt, cfg.experts, cfg, "moe.experts.")
        if cfg.shared_experts:
            self.shared = SwiGLU(rngs, cfg.embed, cfg.shared_experts * cfg.expert_mlp, cfg.layers, dt, 0, cfg,
                                 "moe.shared.")

    def router_logits(self, h):
        """h `[b, t, d]` (normed) -> the router's logits `[b, t, experts]`, float32 at least."""
        f32 = at_least_f32(h.dtype)
        return jnp.einsum("btd,de->bte", h.astype(f32), self.router[...].astype(f32))

    def choices(self, h, cfg):
        """h `[b, t, d]` (normed) -> the experts each token chooses `[b, t, k]` int32 (as `__call__` routes it)."""
        return route(self.router_logits(h), self.router_bias[...], cfg)[1]

    def __call__(self, h, cfg, replay=None):
        """h `[b, t, d]` (normed) -> (out `[b, t, d]` in h's dtype, stats {name: float32}: `STATS`). `replay`
        `[b, t, k]` int32: the experts to use (`route`).

        Under context parallelism (h: this device's piece of each sequence, `jaxpar/parallel/context.py`) routing,
        top-k and combine stay per token; the capacity positions and the sequence-wise statistics come from
        all-gathered per-chunk counts (`moe_dispatch.queue_positions`): exact, each device doing its own tokens'
        expert work, its stats its share of the whole."""
        b, t, _ = h.shape
        E, k, seq = cfg.experts, cfg.experts_per_token, t * context_split()
        h = constrain(h, ("batch", "seq", "embed"))
        f32 = at_least_f32(h.dtype)
        logits = self.router_logits(h)
        scores, idx, w = route(logits, self.router_bias[...], cfg, replay)
        order = dispatch.priority_order(idx)
        pos, counts, mine = dispatch.queue_positions(order, E, k)
        keep = pos < capacity(cfg, seq)
        if implementation(cfg) == "ragged":
            y, lost = dispatch.ragged(self.experts, h, order, keep, E, cfg.expert_buffer_factor,
                                      cfg.grouped_matmul)
        else:
            y, lost = dispatch.buffers(self.experts, h, order, keep, E, capacity(cfg, seq)), 0
        out = jnp.einsum("bktd,btk->btd", y, w.astype(h.dtype))
        if cfg.shared_experts:
            out = out + self.shared(h)
        aux, z = balance_stats(logits, scores, counts, cfg, seq)
        load = mine.sum(0).astype(f32)  # this device's choices per expert
        stats = {"load": load, "dropped": (jnp.sum(~keep) + lost).astype(f32), "aux": aux, "z": z}
        return checkpoint_name(out, "moe_out"), stats


def no_stats(cfg, h) -> dict:
    """A dense layer's stats in a model with MoE layers, for input h: zeros of the MoE layer's shapes and types."""
    f = at_least_f32(h.dtype)
    zeros = {"load": jnp.zeros((cfg.experts,), f), **{k: jnp.zeros((), f) for k in STATS[1:]}}
    return jax.tree.map(lambda a: vary_like(a, h), zeros)


def regulariser(stats, cfg):
    """The MoE layers' auxiliary objective, summed over the rows seen: aux_loss x aux + router_z_loss x z summed over
    the layers (0 for a dense model). The step divides it by the global batch (a mean over sequences)."""
    if stats is None:
        return 0.0
    return cfg.aux_loss * jnp.sum(stats["aux"]) + cfg.router_z_loss * jnp.sum(stats["z"])


def update_bias(bias, load, rate: float):
    """DeepSeek-V3's aux-loss-free balancing (Wang et al. 2024): each expert's choice bias `[..., E]` moves by
    `rate` toward even load: down when it took more than the mean of the layer's `load` `[..., E]` (the choices of
    the whole global batch, so every layout moves it alike), up when fewer."""
    return bias + rate * jnp.sign(jnp.mean(load, -1, keepdims=True) - load).astype(bias.dtype)


def metrics(stats, bias, cfg, rows: int, seq: int) -> dict:
    """What the log shows of the MoE layers (float32), from the step's summed stats (`rows` sequences of `seq`
    tokens): per layer the fraction of choices each expert took (`moe_load` `[L, E]`) and its max / mean, the
    fraction of choices dropped, the mean aux and z losses per sequence, the choice bias's range."""
    load = stats["load"]
    total = jnp.maximum(jnp.sum(load, -1), 1.0)
    frac = load / total[:, None]
    return {"moe_load": frac, "moe_load_max_mean": jnp.max(frac, -1) * cfg.experts,
            "moe_dropped": stats["dropped"] / (rows * seq * cfg.experts_per_token),
            "moe_aux": stats["aux"] / rows, "moe_z": stats["z"] / rows,
            "moe_bias_range": jnp.max(bias, -1) - jnp.min(bias, -1)}
