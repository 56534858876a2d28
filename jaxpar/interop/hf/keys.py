"""Which Hugging Face tensor each jaxpar parameter is, and how its axes map, for `GPT2LMHeadModel` and
`LlamaForCausalLM`.

A `Map` says: jaxpar leaf `ours` (a dotted path; per-layer leaves under `blocks.`, stacked on a leading `layers` axis)
is HF tensor `hf` (`{i}` = the layer), transposed first if `transpose` (torch `Linear` stores `[out, in]`; GPT-2's
`Conv1D` stores `[in, out]`, as jaxpar does), then each HF axis split into consecutive jaxpar axes (`[embed, 3·embed]`
-> `[embed, 3, heads, head_dim]`). A `pad` axis (the vocabulary) is longer in jaxpar (the padded table): the extra
rows are zeros on import and dropped on export. GPT-2's `c_attn.bias` is the one tensor that is not a reshape (jaxpar
has no key bias): `bqv_from_hf` / `bqv_to_hf`.

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

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf

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


# tensors an HF checkpoint may hold that are no parameter (old causal-mask buffers, cached RoPE frequencies) or that
# repeat one (a tied head saved anyway)
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def hf_shape(m: Map, ours: tuple, hf_rows: int) -> tuple:
    """The HF tensor's shape (as stored) for jaxpar per-layer shape `ours`; `hf_rows`: the vocabulary in HF."""
    if m.special == "bqv":
        return (3 * math.prod(ours[1:]),)
    dims = list(ours)
    if m.pad is not None:
        dims[m.pad] = hf_rows
    groups = _groups(m, ours)
    shape = tuple(math.prod(dims[a] for a in g) for g in groups)
    return shape[::-1] if m.transpose else shape


def _groups(m: Map, ours: tuple) -> list[list[int]]:
    """Which jaxpar axes each HF axis (after the transpose) becomes, for the tables above: a 2-D HF tensor's first
    axis is one jaxpar axis and its second the rest ([d, 3·d] -> [d, 3, h, hd]), or, `heads_first`, its first is all
    but the last ([h·hd, d] -> [h, hd, d])."""
    if len(ours) <= 1:
        return [list(range(len(ours)))]
    if m.heads_first:
        return [list(range(len(ours) - 1)), [len(ours) - 1]]
    return [[0], list(range(1, len(ours)))]


def block_of(m: Map, ours: tuple, index: tuple, read, hf_rows: int) -> np.ndarray:
    """The part `index` (slices over `ours`, one layer's jaxpar shape) of HF tensor `m`, as jaxpar lays it out.

    `read(hf_index)` returns the HF tensor's part at a tuple of slices (its stored axis order)."""
    if m.special == "bqv":
        return bqv_from_hf(read((slice(None),)), ours)[index]
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
    part = read(tuple(box[::-1]) if m.transpose else tuple(box))
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
    if m.pad is not None:
        ours = np.take(ours, np.arange(hf_rows), axis=m.pad)
    groups = _groups(m, ours.shape)
    flat = ours.reshape(tuple(math.prod(ours.shape[a] for a in g) for g in groups))
    return np.ascontiguousarray(flat.T if m.transpose else flat)


def bqv_from_hf(bias: np.ndarray, ours: tuple) -> np.ndarray:
    """GPT-2's `c_attn.bias` `[3·embed]` (q, k, v) -> jaxpar's `bqv` `[2, heads, head_dim]` (q, v): the key bias is
    dropped, exactly (softmax is invariant to a per-query shift: q·(k + b) - q·k = q·b, the same for every key)."""
    return bias.reshape((3,) + tuple(ours[1:]))[[0, 2]]


def bqv_to_hf(bqv: np.ndarray) -> np.ndarray:
    """The inverse of `bqv_from_hf`, with a zero key bias."""
    return np.concatenate([bqv[0].reshape(-1), np.zeros(bqv[0].size, bqv.dtype), bqv[1].reshape(-1)])
