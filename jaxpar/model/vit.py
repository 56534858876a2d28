"""The vision transformer's own ends (Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words"; Hugging Face's
`ViTForImageClassification`): in, the image cut into patches, each a linear map (the stride-`patch` convolution as a
matmul over patches), a class token before them and learned positions added; out, the final LayerNorm and a linear
classifier on the class token. The blocks between are the shared ones (`layers.VitBlock`: bidirectional attention).

Shapes: images `[batch, image_size, image_size, channels]` (channels last, preprocessed: `jaxpar/data/images.py`);
patches in row-major order, each flattened (row, column, channel); activations `[batch, patches + 1, embed]`, the
class token first; logits `[batch, num_classes]` in float32 (float64 in float64 runs).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.dtypes import at_least_f32
from jaxpar.model.base import param


def add_embedding(module, cfg, rngs, dt) -> None:
    """The patch projection `[patch, patch, channels, embed]` (Hugging Face's convolution weight
    `[embed, channels, patch, patch]` transposed) and its bias, the class token, the position table (patches + 1)."""
    p, d = cfg.patch_size, cfg.embed
    module.patch = param(rngs.params(), (p, p, cfg.channels, d), 0.02, ("patch", "patch", "channels", "embed"), dt)
    module.patch_bias = param(None, (d,), 0, ("embed",), dt, "bias")
    module.cls = param(rngs.params(), (d,), 0.02, ("embed",), dt, "position")
    module.wpe = param(rngs.params(), (cfg.seq_len, d), 0.02, ("seq", "embed"), dt, "position")


def add_head(module, cfg, rngs, dt) -> None:
    """The classifier `[embed, num_classes]` and its bias (the classes unsplit: a small matmul on one token)."""
    module.head = param(rngs.params(), (cfg.embed, cfg.num_classes), 0.02, ("embed", "classes"), dt)
    module.head_bias = param(None, (cfg.num_classes,), 0, ("classes",), dt, "bias")


def embed(params, images, patch: int, dtype):
    """images `[batch, H, W, channels]` -> `[batch, (H / patch) (W / patch) + 1, embed]` in `dtype`."""
    b, h, w, c = images.shape
    x = images.astype(dtype).reshape(b, h // patch, patch, w // patch, patch, c)
    x = jnp.einsum("bipjqc,pqcd->bijd", x, params["patch"].astype(dtype)).reshape(b, -1, params["patch"].shape[-1])
    x = x + params["patch_bias"].astype(dtype)
    cls = jnp.broadcast_to(params["cls"].astype(dtype), (b, 1, x.shape[-1]))
    return jnp.concatenate([cls, x], axis=1) + params["wpe"].astype(dtype)[None]


def logits(params, h):
    """h `[batch, embed]` (the class token after the final norm) -> logits `[batch, num_classes]`, at least
    float32."""
    f = at_least_f32(h.dtype)
    z = jnp.einsum("bd,dc->bc", h, params["head"].astype(h.dtype), preferred_element_type=f)
    return z + params["head_bias"].astype(f)


def loss(z, labels, w):
    """logits `[batch, classes]`, labels `[batch]` int32, weights `[batch]` -> (summed weighted cross-entropy,
    [weight sum, weighted count of top-1 hits])."""
    w = w.astype(z.dtype)
    nll = jax.nn.logsumexp(z, axis=-1) - jnp.take_along_axis(z, labels[:, None], axis=-1)[:, 0]
    hit = (jnp.argmax(z, axis=-1) == labels).astype(z.dtype)
    return (nll * w).sum(), jnp.stack([w.sum(), (hit * w).sum()])


def head_share(cfg) -> float:
    """The fraction of a token's head FLOPs a ViT really spends: the classifier runs on the class token only."""
    return 1.0 / cfg.seq_len
