"""The vision transformer's own ends (Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words"; Hugging Face's
`ViTForImageClassification`): in, the image cut into patches, each a linear map (the stride-`patch` convolution as a
matmul over patches), a class token before them and learned positions added; out, the final LayerNorm and a linear
classifier on the class token. The blocks between are the shared ones (`layers.VitBlock`: bidirectional attention).

Shapes: images `[batch, image_size, image_size, channels]` (channels last, preprocessed: `jaxpar/data/images.py`);
patches in row-major order, each flattened (row, column, channel); activations `[batch, patches + 1, embed]`, the
class token first; logits `[batch, num_classes]` in float32 (float64 in float64 runs).

`ViT` is the family (`jaxpar/model/families/base.py`): images for data, the sequence its patches and the class token
(`seq_len`, derived), the vocabulary its classes, and the settings it refuses.
"""
from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp

from jaxpar.config import mlp_width, nearest_multiples
from jaxpar.dtypes import at_least_f32
from jaxpar.model.base import param
from jaxpar.model.families.base import Family
from jaxpar.model.layers import LayerNorm, VitBlock


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


def seq_len(image_size: int, patch_size: int) -> int:
    """A ViT's sequence: its patches and the class token."""
    return (image_size // patch_size) ** 2 + 1


class ViT(Family):
    """The vision transformer: patches in, a classifier on the class token out; bidirectional blocks."""
    name = "vit"
    block = VitBlock
    norm = LayerNorm
    data_kind = "images"
    context_parallel = False  # (refused with its own line: `errors`)

    def config_fields(self, config, vocab_real: int, tensor: int) -> dict:
        """A ViT's `vocab_real` is its classes (`model.num_classes`, else the data's), its sequence its patches and
        the class token; its vocabulary is not padded."""
        m, seq = config.model, seq_len(config.model.image_size, config.model.patch_size)
        classes = int(m.num_classes) or vocab_real
        return dict(
            vocab_size=classes, vocab_real=classes, seq_len=seq, layers=m.layers, embed=m.embed, heads=m.heads,
            mlp=mlp_width(config), dropout_embed=m.dropout_embed, dropout_resid=m.dropout_resid, tie_embeddings=False,
            remat=m.remat, param_dtype=config.train.param_dtype, compute_dtype=config.train.compute_dtype,
            arch=self.name, head_dim=m.head_dim, max_positions=seq, norm_eps=m.norm_eps, attention=m.attention,
            image_size=m.image_size, patch_size=m.patch_size, channels=m.channels, num_classes=classes)

    def derived(self, config):
        """A ViT's `model.seq_len` and `model.max_positions` are its patches and the class token
        (`(image_size / patch_size)² + 1`)."""
        m = config.model
        if m.patch_size < 1 or m.image_size % m.patch_size:
            return config  # (validate names an image size that is no whole number of patches)
        seq = seq_len(m.image_size, m.patch_size)
        if m.seq_len == seq and m.max_positions == seq:
            return config
        c = config.copy_and_resolve_references()
        c.model.seq_len = c.model.max_positions = seq
        return c

    def vocab(self, config, data_vocab: int) -> int:
        return int(config.model.num_classes) or data_vocab

    def tokens_per_item(self, cfg) -> int:
        """The data counts images; the model computes `seq_len` tokens for each."""
        return cfg.seq_len

    def add_embedding(self, module, cfg, rngs, dt) -> None:
        add_embedding(module, cfg, rngs, dt)

    def add_head(self, module, cfg, rngs, dt) -> None:
        add_head(module, cfg, rngs, dt)

    def embed(self, params, tokens, cfg, dtype):
        """tokens: images `[batch, H, W, channels]`."""
        return embed(params, tokens, cfg.patch_size, dtype)

    def head_flops_unspent(self, cfg) -> float:
        """The classifier runs on one token of each image's `seq_len`."""
        return 6.0 * cfg.embed * cfg.num_classes * (1.0 - head_share(cfg))

    def errors(self, config, lay) -> list[str]:
        """Whole patches, and only the engines its encoder runs on."""
        m = config.model
        if m.image_size % m.patch_size:
            return [f"model.image_size={m.image_size} is not divisible by model.patch_size={m.patch_size}: the image "
                    f"is cut into whole patches; use an image_size among "
                    f"{nearest_multiples(m.image_size, m.patch_size)}."]
        seq, errs = seq_len(m.image_size, m.patch_size), []
        if m.seq_len != seq:
            errs.append(f"model.seq_len={m.seq_len} with model.arch='vit': a ViT's sequence is its {seq - 1} patches "
                        f"and the class token, {seq}; leave model.seq_len to jaxpar (`derived`).")
        refused = [(lay.context > 1, f"mesh.context={lay.context}", "mesh.context=1 (a ViT's sequence is short)"),
                   (m.experts > 0, f"model.experts={m.experts}", "model.experts=0"),
                   (int(config.lora.rank) > 0, f"lora.rank={config.lora.rank}", "lora.rank=0 (LoRA is wired for "
                                                                                 "the language families)"),
                   (config.data.packing not in ("concat", "auto"), f"data.packing={config.data.packing!r}",
                    "data.packing='concat'"),
                   (bool(str(config.eval.tasks).strip()), f"eval.tasks={config.eval.tasks!r}",
                    "eval.tasks='' (lm-eval's tasks score language models)")]
        errs += [f"model.arch='vit' with {what}: not supported for vision transformers; set {fix}." for bad, what, fix
                 in refused if bad]
        needs = [("PIL", "Pillow")] + [("sklearn", "scikit-learn")] * ("digits" in str(config.data.sources).split())
        errs += [f"model.arch='vit' needs {name} to read its images, which is not installed: pip install "
                 f"'jaxpar[vision]'." for module, name in needs if importlib.util.find_spec(module) is None]
        return errs
