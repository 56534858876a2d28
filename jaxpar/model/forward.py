"""The forward pass as pure functions over the params dict (`Forward`), for any family: `embed`, `layers` (any
contiguous chunk of the stack, so a pipeline stage can run its own), the heads (`head_loss`: the chunked LM head and
cross-entropy; `token_logps`: each target's log-probability; `classify`: a ViT's classifier) — so the pipeline can
place them without knowing what the model is — and `decode` (one step with a KV cache, for sampling; the same
attention). The remat policies name the blocks' residuals (`jaxpar/model/layers.py`).

Shapes: tokens `[batch, seq]` int32; activations `[batch, seq, embed]` in the compute dtype; logits
`[batch, seq, vocab]` float32 (vocab padded; padded entries masked to -inf before the softmax).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.kernels.cross_entropy import cross_entropy, token_entropy, token_log_probs
from jaxpar.model.config import ModelConfig, has_dropout
from jaxpar.model.families.vit import logits as vit_logits, loss as vit_loss
from jaxpar.model.layers import KVCache, at_least_f32, dropout, segment_positions
from jaxpar.model.spec import _LAYERS
from jaxpar.parallel.logical import constrain


# Korthikanti et al. 2022's selective recompute (sec. 5): keep what their eq. 1 counts except the attention core
# (QK^T, softmax, ·V), which the backward recomputes; the names are the block's (`jaxpar/model/layers.py`) (a MoE
# layer's dispatched tokens too: saving them spares the backward pass an all-to-all)
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
        self.cfg, self.family = cfg, cfg.family
        self.block_def = nnx.graphdef(nnx.eval_shape(lambda: self.family.block(cfg, nnx.Rngs(params=0))))
        self.norm_def = nnx.graphdef(self.family.norm(1, jnp.float32, cfg.norm_eps))
        self.cdt = jnp.dtype(cfg.compute_dtype)

    @jax.named_scope("embed")  # the scope names in the HLO's op_name metadata (`hlo_flops` reads them)
    def embed(self, params, tokens, rng=None, seq_ids=None, pos0=0, segments=None, positions=None):
        """tokens `[batch, seq]` int32 -> `[batch, seq, embed]` (compute dtype); positions start at `pos0`, or at
        each segment's start (`segments` `[batch, seq]` int32: packed documents), or are given (`positions`
        `[batch, seq]` int32: a context-parallel shard of a sequence, `jaxpar/parallel/context.py`)."""
        x = self.family.embed(params, tokens, self.cfg, self.cdt)  # a ViT's tokens: images `[batch, H, W, channels]`
        if self.family.learned_positions:  # gpt2's position table; llama rotates q and k in each block instead
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
                         positions=None, routes=None):
        """`layers`, also returning the MoE layers' stats (`jaxpar/model/moe.py: STATS`, leaves `[layers of the chunk,
        ...]`; None for a dense model). `routes`: as in `block`."""
        cfg = self.cfg

        def one(x, inp):
            p, i = inp
            return self.block(prepare(p) if prepare is not None else p, x, rng, seq_ids, i, segments, stats=True,
                              positions=positions, routes=routes)

        if cfg.remat != "none":
            one = jax.checkpoint(one, policy=_REMAT[cfg.remat], prevent_cse=False)
        n = jax.tree.leaves(block_params)[0].shape[0]
        return jax.lax.scan(one, x, (block_params, first_layer + jnp.arange(n)))

    def block(self, layer_params, x, rng=None, seq_ids=None, layer=0, segments=None, stats=False, positions=None,
              routes=None):
        """One transformer block (params without the `layers` axis) on x `[batch, seq, embed]`; `layer` is its
        global index (int or traced int32), which keys its dropout. `segments` `[batch, seq]` int32 (packed
        documents): attention within a segment only, positions from each segment's start; `positions` `[batch, seq]`
        int32, if given, are the tokens' (a context-parallel shard); `routes` `[batch, seq, layers, k]` int32, if
        given, the experts each token uses in each MoE layer (every layer of the model; -1: the router's own
        choice): routing replay, `moe.route`. With `stats`: (x, the MoE layer's stats or None)."""
        cfg = self.cfg
        replay = None if routes is None else jax.lax.dynamic_index_in_dim(routes, layer, 2, keepdims=False)
        drop = None
        if rng is not None and has_dropout(cfg):
            lk = jax.random.fold_in(rng, 1 + layer)
            drop = lambda y, site, rate: dropout(y, rate, jax.random.fold_in(lk, site), seq_ids)
        positions = None if positions is None and segments is None else _positions(positions, segments)
        y, _, st = nnx.merge(self.block_def, layer_params)(x, cfg, drop, None, positions, segments, layer, replay)
        return (y, st) if stats else y

    def final_norm(self, params, x):
        """x `[..., embed]` after the final norm: what `logits` multiplies by the `unembedding`."""
        return nnx.merge(self.norm_def, params["ln_f"])(x)

    def unembedding(self, params):
        """(The unembedding `[embed, vocab]` in the compute dtype, the logits' dtype)."""
        w = params["wte"].T if self.cfg.tie_embeddings else params["lm_head"]
        return w.astype(self.cdt), at_least_f32(self.cdt)

    def logits(self, params, x):
        """x `[batch, seq, embed]` -> float32 logits `[batch, seq, vocab]`, padded ids set to -inf."""
        cfg = self.cfg
        w, dt = self.unembedding(params)
        z = jnp.einsum("btd,dv->btv", self.final_norm(params, x), w, preferred_element_type=dt)
        z = constrain(z, ("batch", "seq", "vocab"))
        if cfg.vocab_real < cfg.vocab_size:
            z = jnp.where(jnp.arange(cfg.vocab_size) < cfg.vocab_real, z, -jnp.inf)
        return z

    def class_logits(self, params, x):
        """ViT: x `[batch, seq, embed]` (the last layer's output) -> logits `[batch, num_classes]` (float32 at
        least) of the class token after the final norm."""
        return vit_logits(params, nnx.merge(self.norm_def, params["ln_f"])(x[:, 0]))

    @jax.named_scope("head")
    def classify(self, params, x, labels, weights):
        """ViT: (summed cross-entropy of the images' labels `[batch]` int32 under `weights` `[batch]`, [weight sum,
        weighted top-1 hits])."""
        return vit_loss(self.class_logits(params, x), labels, weights)

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
    def token_logps(self, params, x, targets, temperature: float = 1.0):
        """Each position's log-probability of its target under the model: x `[batch, seq, embed]` (the last layer's
        output), targets `[batch, seq]` int32 -> `[batch, seq]` float32 (`kernels.cross_entropy.token_log_probs`);
        `temperature`: of the distribution softmax(logits / temperature) (GRPO's sampling temperature, as TRL)."""
        return token_log_probs(*self._head_inputs(params, x, temperature), targets, self.cfg.vocab_real,
                               self.cfg.loss_chunk)

    def token_entropy(self, params, x, temperature: float = 1.0):
        """Each position's entropy of its next-token distribution, not differentiated: `[batch, seq]` float32, by
        chunks of positions (`kernels.cross_entropy.token_entropy`: the logits never whole)."""
        return token_entropy(*self._head_inputs(params, x, temperature), self.cfg.vocab_real, self.cfg.loss_chunk)

    def _head_inputs(self, params, x, temperature: float = 1.0):
        """(the final norm's output `[batch, seq, embed]` / temperature, the LM head's weight `[embed, vocab]`)."""
        h = constrain(nnx.merge(self.norm_def, params["ln_f"])(x), ("batch", "seq", "embed"))
        h = h if temperature == 1.0 else h / jnp.asarray(temperature, h.dtype)
        return h, params["wte"].T if self.cfg.tie_embeddings else params["lm_head"]

    def loss(self, params, tokens, targets, mask, rng=None, seq_ids=None, prepare=None, segments=None,
             positions=None):
        """The whole model on one (micro)batch: (loss_sum, token_count). `prepare`, `segments`, `positions`: as in
        `layers`."""
        return self.loss_and_stats(params, tokens, targets, mask, rng, seq_ids, prepare, segments, positions)[:2]

    def loss_and_stats(self, params, tokens, targets, mask, rng=None, seq_ids=None, prepare=None, segments=None,
                       positions=None, head=None, routes=None):
        """`loss`, and the MoE layers' stats (`layers_and_stats`). `head(params, x) -> (loss_sum, count)` replaces
        the next-token loss (a training objective's own: `jaxpar/train/objectives/`); `routes`: as in `block`."""
        x = self.embed(params, tokens, rng, seq_ids, segments=segments, positions=positions)
        x, stats = self.layers_and_stats(params[_LAYERS], x, rng, seq_ids, prepare=prepare, segments=segments,
                                         positions=positions, routes=routes)
        out = self.head_loss(params, x, targets, mask) if head is None else head(params, x)
        return (*out, stats)

    def init_cache(self, batch: int, length: int | None = None) -> KVCache:
        """An empty KV cache for `batch` sequences of up to `length` tokens (default max_positions), every layer
        (leading `[layers]` axis), `kv_heads` heads."""
        cfg = self.cfg
        shape = (cfg.layers, batch, length or cfg.max_positions, cfg.kv_heads, cfg.head_dim)
        return KVCache(jnp.zeros(shape, self.cdt), jnp.zeros(shape, self.cdt),
                       jnp.zeros((cfg.layers, batch), jnp.int32))

    def decode(self, params, tokens, caches: KVCache):
        """tokens `[batch, t]` at positions caches.pos.. -> (last-position logits `[batch, vocab]`, new caches)."""
        x = self.embed(params, tokens, positions=caches.pos[0][:, None] + jnp.arange(tokens.shape[1]))

        def one(x, inp):
            p, c, i = inp
            return nnx.merge(self.block_def, p)(x, self.cfg, None, c, layer=i)[:2]

        x, caches = jax.lax.scan(one, x, (params[_LAYERS], caches, jnp.arange(self.cfg.layers)))
        return self.logits(params, x[:, -1:])[:, 0], caches
