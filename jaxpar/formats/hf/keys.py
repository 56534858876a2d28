"""Which Hugging Face tensor each jaxpar parameter is, and how its axes map, for `GPT2LMHeadModel`,
`LlamaForCausalLM` (and its MoE kin) and `ViTForImageClassification` / `ViTModel`.

A `Map` says: jaxpar leaf `ours` (a dotted path; per-layer leaves under `blocks.`, stacked on a leading `layers` axis)
is HF tensor `hf` (`{i}` = the layer), transposed first if `transpose` (torch `Linear` stores `[out, in]`; GPT-2's
`Conv1D` stores `[in, out]`, as jaxpar does), then each HF axis split into consecutive jaxpar axes (`[embed, 3·embed]`
-> `[embed, 3, heads, head_dim]`). A `pad` axis (the vocabulary) is longer in jaxpar (the padded table): the extra
rows are zeros on import and dropped on export. GPT-2's `c_attn.bias` is the one tensor that is not a reshape (jaxpar
has no key bias): `bqv_from_hf` / `bqv_to_hf`. Several HF tensors can make one jaxpar leaf, stacked on one of its
axes: a MoE layer's experts (`{e}`, the leaf's first axis) and ViT's separate query, key and value (`{p}`, `parts`,
stacked on `part_axis`: `wqkv` `[embed, 3, heads, head_dim]`).

`block_of(m, shape, index, read, hf_rows)` returns the part of one layer's tensor that a jaxpar index selects, asking
`read` for the bounding box of that part in the HF tensor's own axes (`files.Reader` reads the rows the box spans).
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Map:
    ours: str
    hf: str
    transpose: bool = False
    pad: int | None = None  # the jaxpar axis (of one layer's shape) that is padded: the vocabulary
    special: str = ""  # "bqv": GPT-2's c_attn.bias -> the q and v biases
    heads_first: bool = False  # the (transposed) HF tensor is [heads·head_dim, embed]: its first axis splits
    flat: bool = False  # the HF tensor is 1-D, all of jaxpar's axes merged ([heads·head_dim] -> [heads, head_dim])
    parts: tuple = ()  # the names `{p}` stands for, one HF tensor each, stacked on jaxpar axis `part_axis`
    part_axis: int = 0
    axes: tuple = ()  # the HF tensor is jaxpar's with its axes in this order (read whole): ViT's patch convolution
    unit_axes: int = 0  # the HF tensor has this many more leading axes of size 1 (ViT's [1, 1, embed] class token)

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf

    @property
    def split(self) -> int | None:
        """The axis of one layer's jaxpar leaf on which several HF tensors stack (experts: 0; parts: `part_axis`),
        or None (one HF tensor)."""
        return 0 if self.per_expert else (self.part_axis if self.parts else None)

    @property
    def per_expert(self) -> bool:
        """One HF tensor per routed expert (`{e}`): jaxpar stacks them on the leaf's `experts` axis (after
        `layers`)."""
        return "{e}" in self.hf


def gpt2_maps(tied: bool, prefix: str = "transformer.") -> list[Map]:
    h, p = prefix + "h.{i}.", prefix
    maps = [Map("wte", p + "wte.weight", pad=0), Map("wpe", p + "wpe.weight"),
            Map("blocks.ln1.scale", h + "ln_1.weight"), Map("blocks.ln1.bias", h + "ln_1.bias"),
            Map("blocks.wqkv", h + "attn.c_attn.weight"), Map("blocks.bqv", h + "attn.c_attn.bias", special="bqv"),
            Map("blocks.wo", h + "attn.c_proj.weight", heads_first=True), Map("blocks.bo", h + "attn.c_proj.bias"),
            Map("blocks.ln2.scale", h + "ln_2.weight"), Map("blocks.ln2.bias", h + "ln_2.bias"),
            Map("blocks.w_in", h + "mlp.c_fc.weight"), Map("blocks.b_in", h + "mlp.c_fc.bias"),
            Map("blocks.w_out", h + "mlp.c_proj.weight"), Map("blocks.b_out", h + "mlp.c_proj.bias"),
            Map("ln_f.scale", p + "ln_f.weight"), Map("ln_f.bias", p + "ln_f.bias")]
    return maps + ([] if tied else [Map("lm_head", "lm_head.weight", transpose=True, pad=1)])


# the MoE feed-forward of each family's checkpoints: router, then each expert's gate / up / down projections
MOE_NAMES = {
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.w1.weight",
                "block_sparse_moe.experts.{e}.w3.weight", "block_sparse_moe.experts.{e}.w2.weight"),
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                  "mlp.experts.{e}.down_proj.weight"),
}


def llama_maps(tied: bool, moe: str | None = None, qk_norm: bool = False) -> list[Map]:
    """Llama's tensors; `moe` ("mixtral", "qwen3_moe"): the feed-forward is that family's experts; `qk_norm`:
    Qwen3's q and k norms."""
    h = "model.layers.{i}."
    if moe is None:
        ffn = [Map("blocks.w_gate", h + "mlp.gate_proj.weight", True),
               Map("blocks.w_up", h + "mlp.up_proj.weight", True),
               Map("blocks.w_down", h + "mlp.down_proj.weight", True)]
    else:
        router, gate, up, down = MOE_NAMES[moe]
        ffn = [Map("blocks.moe.router", h + router, True)] + [
            Map(f"blocks.moe.experts.{w}", h + name, True) for w, name in (("w_gate", gate), ("w_up", up),
                                                                          ("w_down", down))]
    norms = [Map("blocks.q_norm.scale", h + "self_attn.q_norm.weight"),
             Map("blocks.k_norm.scale", h + "self_attn.k_norm.weight")] if qk_norm else []
    maps = [Map("wte", "model.embed_tokens.weight", pad=0),
            Map("blocks.ln1.scale", h + "input_layernorm.weight"),
            Map("blocks.wq", h + "self_attn.q_proj.weight", True),
            Map("blocks.wk", h + "self_attn.k_proj.weight", True),
            Map("blocks.wv", h + "self_attn.v_proj.weight", True),
            Map("blocks.wo", h + "self_attn.o_proj.weight", True, heads_first=True),
            Map("blocks.ln2.scale", h + "post_attention_layernorm.weight"), *norms, *ffn,
            Map("ln_f.scale", "model.norm.weight")]
    return maps + ([] if tied else [Map("lm_head", "lm_head.weight", transpose=True, pad=1)])


# ViT's per-layer tensors under its two namings: (the layer, query / key / value with the names `{p}` stands for,
# the attention's output, the MLP's two) as the Hub's checkpoints and `save_pretrained` name them (what jaxpar
# writes), and as transformers 5's modules do (a `state_dict` saved as it is)
VIT_NAMINGS = {
    "hub": ("encoder.layer.{i}.", "attention.attention.{p}", ("query", "key", "value"), "attention.output.dense",
            "intermediate.dense", "output.dense"),
    "modules": ("layers.{i}.", "attention.{p}_proj", ("q", "k", "v"), "attention.o_proj", "mlp.fc1", "mlp.fc2"),
}
VIT_HEAD = ("classifier.weight", "classifier.bias")  # ViTForImageClassification's (ViTModel has none)


def vit_naming(have: dict | None) -> tuple[str, str]:
    """(the key prefix, the VIT_NAMINGS key) of a ViT checkpoint's tensor names `have` (None: what jaxpar writes):
    ViTForImageClassification's start with `vit.`, ViTModel's with nothing."""
    if have is None:
        return "vit.", "hub"
    prefix = "" if "embeddings.cls_token" in have else "vit."
    return prefix, "modules" if f"{prefix}layers.0.layernorm_before.weight" in have else "hub"


def vit_maps(prefix: str = "vit.", naming: str = "hub", head: bool = True) -> list[Map]:
    """ViT's tensors (`vit_naming`); `head`: with the classifier."""
    layer, qkv, parts, out, fc1, fc2 = VIT_NAMINGS[naming]
    h, e = prefix + layer, prefix + "embeddings."
    maps = [Map("patch", e + "patch_embeddings.projection.weight", axes=(3, 2, 0, 1)),
            Map("patch_bias", e + "patch_embeddings.projection.bias"),
            Map("cls", e + "cls_token", unit_axes=2), Map("wpe", e + "position_embeddings", unit_axes=1),
            Map("blocks.ln1.scale", h + "layernorm_before.weight"), Map("blocks.ln1.bias", h + "layernorm_before.bias"),
            Map("blocks.wqkv", h + qkv + ".weight", True, parts=parts, part_axis=1),
            Map("blocks.bqkv", h + qkv + ".bias", parts=parts, flat=True),
            Map("blocks.wo", h + out + ".weight", True, heads_first=True), Map("blocks.bo", h + out + ".bias"),
            Map("blocks.ln2.scale", h + "layernorm_after.weight"), Map("blocks.ln2.bias", h + "layernorm_after.bias"),
            Map("blocks.w_in", h + fc1 + ".weight", True), Map("blocks.b_in", h + fc1 + ".bias"),
            Map("blocks.w_out", h + fc2 + ".weight", True), Map("blocks.b_out", h + fc2 + ".bias"),
            Map("ln_f.scale", prefix + "layernorm.weight"), Map("ln_f.bias", prefix + "layernorm.bias")]
    return maps + ([Map("head", VIT_HEAD[0], True), Map("head_bias", VIT_HEAD[1])] if head else [])


def split_names(m: Map, name: str, experts: int) -> list[str]:
    """One layer's HF name -> the names of its tensors: one per expert for a per-expert map, one per part for a
    parted one (in the order they stack), else the name."""
    if m.per_expert:
        return [name.format(e=e) for e in range(experts)]
    return [name.replace("{p}", p) for p in m.parts] if m.parts else [name]


# tensors an HF checkpoint may hold that are no parameter (old causal-mask buffers, cached RoPE frequencies, ViTModel's
# pooler, which a classifier on the class token does not use) or that repeat one (a tied head saved anyway)
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq", "pooler.dense.weight",
                    "pooler.dense.bias")


def hf_shape(m: Map, ours: tuple, hf_rows: int) -> tuple:
    """The HF tensor's shape (as stored) for jaxpar per-layer shape `ours`; `hf_rows`: the vocabulary in HF."""
    if m.special == "bqv":
        return (3 * math.prod(ours[1:]),)
    if m.axes:
        return tuple(ours[a] for a in m.axes)
    dims = list(ours)
    if m.pad is not None:
        dims[m.pad] = hf_rows
    groups = _groups(m, ours)
    shape = tuple(math.prod(dims[a] for a in g) for g in groups)
    return (1,) * m.unit_axes + (shape[::-1] if m.transpose else shape)


def _groups(m: Map, ours: tuple) -> list[list[int]]:
    """Which jaxpar axes each HF axis (after the transpose) becomes, for the tables above: a 2-D HF tensor's first
    axis is one jaxpar axis and its second the rest ([d, 3·d] -> [d, 3, h, hd]), or, `heads_first`, its first is all
    but the last ([h·hd, d] -> [h, hd, d]); `flat`, one axis."""
    if len(ours) <= 1 or m.flat:
        return [list(range(len(ours)))]
    if m.heads_first:
        return [list(range(len(ours) - 1)), [len(ours) - 1]]
    return [[0], list(range(1, len(ours)))]


def block_of(m: Map, ours: tuple, index: tuple, read, hf_rows: int) -> np.ndarray:
    """The part `index` (slices over `ours`, one layer's jaxpar shape) of HF tensor `m`, as jaxpar lays it out.

    `read(hf_index)` returns the HF tensor's part at a tuple of slices (its stored axis order)."""
    if m.special == "bqv":
        return bqv_from_hf(read((slice(None),)), ours)[index]
    if m.axes:
        return np.transpose(read((slice(None),) * len(m.axes)), np.argsort(m.axes))[index]
    index = tuple(slice(*s.indices(n)) for s, n in zip(index, ours))
    groups = _groups(m, ours)
    box, picks = [], []
    for g in groups:  # the bounding range of the wanted elements along this HF axis, and which of them to keep
        sizes = [ours[a] for a in g]
        ranges = np.ix_(*[np.arange(index[a].start, index[a].stop) for a in g])
        flat = np.ravel_multi_index(ranges, sizes).reshape(-1) if g else np.zeros(1, int)
        lo, hi = int(flat.min()), int(flat.max()) + 1
        if m.pad is not None and g == [m.pad]:
            hi = min(hi, hf_rows)
        box.append(slice(lo, max(lo, hi)))
        picks.append(flat - lo)
    part = read((slice(0, 1),) * m.unit_axes + (tuple(box[::-1]) if m.transpose else tuple(box)))
    part = part.reshape(part.shape[m.unit_axes:])
    part = part.T if m.transpose else part
    for axis, pick in enumerate(picks):
        short = pick >= part.shape[axis]  # padded vocabulary rows: zeros
        if short.any():
            widths = [(0, 0)] * part.ndim
            widths[axis] = (0, int(pick.max()) + 1 - part.shape[axis])
            part = np.pad(part, widths)
        if len(pick) != part.shape[axis] or (pick != np.arange(len(pick))).any():
            part = np.take(part, pick, axis=axis)
    return part.reshape(tuple(s.stop - s.start for s in index))


def to_hf(m: Map, ours: np.ndarray, hf_rows: int) -> np.ndarray:
    """One layer's jaxpar array -> the HF tensor (padding dropped, axes merged, transposed back)."""
    if m.special == "bqv":
        return bqv_to_hf(ours)
    if m.axes:
        return np.ascontiguousarray(np.transpose(ours, m.axes))
    if m.pad is not None:
        ours = np.take(ours, np.arange(hf_rows), axis=m.pad)
    groups = _groups(m, ours.shape)
    flat = ours.reshape(tuple(math.prod(ours.shape[a] for a in g) for g in groups))
    flat = flat.T if m.transpose else flat
    return np.ascontiguousarray(flat.reshape((1,) * m.unit_axes + flat.shape))


def bqv_from_hf(bias: np.ndarray, ours: tuple) -> np.ndarray:
    """GPT-2's `c_attn.bias` `[3·embed]` (q, k, v) -> jaxpar's `bqv` `[2, heads, head_dim]` (q, v): the key bias is
    dropped, exactly (softmax is invariant to a per-query shift: q·(k + b) - q·k = q·b, the same for every key)."""
    return bias.reshape((3,) + tuple(ours[1:]))[[0, 2]]


def bqv_to_hf(bqv: np.ndarray) -> np.ndarray:
    """The inverse of `bqv_from_hf`, with a zero key bias."""
    return np.concatenate([bqv[0].reshape(-1), np.zeros(bqv[0].size, bqv.dtype), bqv[1].reshape(-1)])
