"""Attention kernels behind one call: XLA, cuDNN (flash, through `jax.nn.dot_product_attention`), Pallas (the flash
kernel JAX ships, `jax.experimental.pallas.ops.gpu.attention`, the one that takes segment ids). Knows no model.

Shapes: q `[batch, t, heads, head_dim]`, k and v `[batch, s, heads, head_dim]` (grouped KV heads repeated by the
caller), segment_ids `[batch, t]` int32 (t = s). Scale 1/sqrt(head_dim); softmax in float32 in every kernel (float64 in float64 reference runs).

`choose(implementation, ...)` resolves `model.attention`:
  - "xla": XLA's attention: materialises the `[batch, heads, t, s]` scores (O(T²) memory); packed documents become a
    dense `[batch, 1, t, t]` mask (the only mask the public `jax.nn.dot_product_attention` takes).
  - "cudnn": cuDNN's fused flash attention (GPU, float16/bfloat16, head_dim a multiple of 8 and <= 128); no segment
    ids (cuDNN's packed layout is in JAX's private API only), so packed batches go to Pallas.
  - "pallas": the Pallas flash kernel (Triton on GPU): causal, segment ids,
    seq a multiple of its 128-token blocks or a power of two; head_dim padded to a power of two inside the kernel.
  - "auto": on GPU cuDNN when it applies, else Pallas when it applies, else XLA; XLA off GPU ("pallas" set
    explicitly off GPU runs the same kernel in Pallas' interpret mode: slow, for tests).
Fused kernels are custom calls the SPMD partitioner cannot split, so they run per shard (`logical.per_shard`: batch
over data, heads over tensor, each device on its own heads, as Megatron's tensor parallel attention does).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from jaxpar.kernels import blockwise, segments
from jaxpar.parallel import context
from jaxpar.parallel.logical import context_rank, context_split, gather_context, per_shard
from jaxpar.parallel.shard_map_body import vary_like

IMPLEMENTATIONS = ("auto", "xla", "cudnn", "pallas")
# per-shard layouts: batch and heads split as the rules say, the sequence and head_dim always whole (a kernel on a
# sequence shard would attend within it only)
_QKV = ("batch", None, "heads", None)
PALLAS_BLOCK = 128  # the Pallas kernel's forward block along the sequence (its BlockSizes default)


def _cudnn_reason(dtype, head_dim: int, segments: bool, backend: str) -> str | None:
    """Why cuDNN cannot run this attention, or None."""
    if backend != "gpu":
        return f"cuDNN needs a GPU (backend {backend})"
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return f"cuDNN's flash attention takes float16/bfloat16, not {jnp.dtype(dtype).name}"
    if head_dim % 8 or head_dim > 128:
        return f"cuDNN needs head_dim a multiple of 8 and <= 128, not {head_dim}"
    if segments:
        return "packed documents: cuDNN's segment support is not public API"
    return None


def _pallas_reason(seq: int, head_dim: int) -> str | None:
    if seq % PALLAS_BLOCK and (seq < 16 or seq & (seq - 1)):  # Triton blocks are powers of two
        return f"the Pallas kernel needs seq a multiple of {PALLAS_BLOCK} or a power of two >= 16, not {seq}"
    if head_dim < 16:
        return f"the Pallas kernel needs head_dim >= 16, not {head_dim}"
    return None


def choose(implementation: str, dtype, seq: int, head_dim: int, segments: bool,
           backend: str | None = None, causal: bool = True) -> tuple[str, str]:
    """`model.attention` -> (the kernel that runs: xla | cudnn | pallas, why). An explicit choice that cannot run
    raises ValueError naming the reason; "pallas" off GPU runs in interpret mode (slow: for tests)."""
    backend = backend or jax.default_backend()
    pallas = _pallas_reason(seq, head_dim) if causal else "jaxpar runs the Pallas kernel causal only"
    reasons = {"cudnn": _cudnn_reason(dtype, head_dim, segments, backend), "pallas": pallas, "xla": None}
    if implementation == "auto":
        if backend != "gpu":
            return "xla", f"auto: no fused kernel off GPU (backend {backend})"
        for impl in ("cudnn", "pallas"):
            if reasons[impl] is None:
                return impl, "auto: the fused kernel applies"
        return "xla", "auto: " + "; ".join(r for r in (reasons["cudnn"], reasons["pallas"]))
    if implementation not in reasons:
        raise ValueError(f"model.attention={implementation!r}: pick one of {IMPLEMENTATIONS}")
    if reasons[implementation] is not None:
        raise ValueError(f"model.attention={implementation!r} cannot run here: {reasons[implementation]}; use "
                         f"'auto' or 'xla'")
    return implementation, "as configured"


def xla(q, k, v, mask=None, segment_ids=None, causal: bool = True):
    """XLA's attention: causal when `mask` is None, else `mask` (bool, broadcastable to `[batch, heads, t, s]`,
    True = attend); with `segment_ids`, causal within each segment (a dense mask); `causal=False`: every position
    attends to every other (a bidirectional encoder, ViT)."""
    dt = q.dtype
    if segment_ids is not None:
        same = segments.visible(segment_ids[:, None, :, None], segment_ids[:, None, None, :])
        mask = same & (jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool)) if causal else True)
    elif not causal and mask is None:
        mask = jnp.ones((1, 1, q.shape[1], k.shape[1]), bool)
    if dt == jnp.float64:
        return _float64(q, k, v, mask)
    attend = lambda q, k, v, mask: jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=mask is None).astype(dt)
    if dt == jnp.float32:
        return attend(q, k, v, mask)
    # XLA:CPU lacks low-precision fused attention: float32 there, decided when the program is lowered for its platform
    wide = lambda q, k, v, mask: attend(*(a.astype(jnp.float32) for a in (q, k, v)), mask)
    return jax.lax.platform_dependent(q, k, v, mask, cpu=wide, default=attend)


def _float64(q, k, v, mask):
    """Attention with its softmax in float64 (reference runs; `jax.nn.dot_product_attention` computes every softmax
    in float32, which would put float32 rounding into a float64 run)."""
    t, s = q.shape[1], k.shape[1]
    mask = jnp.tril(jnp.ones((t, s), bool)) if mask is None else mask
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", probs, v)


def _cudnn(q, k, v, causal=True):
    return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")


def _mha_args(q, interpret: bool):
    from jax.experimental.pallas.ops.gpu import attention as mod

    # mha's static arguments, in its order: sm_scale, causal, block_sizes, backward_pass_impl, num_warps,
    # num_stages, grid, interpret, debug, return_residuals
    return mod, (1.0 / math.sqrt(q.shape[-1]), True, mod.BlockSizes.get_default(), "triton", None, 2, None,
                 interpret, False, False)


def on_gpu(kernel):
    """`kernel(interpret, *arrays)` compiled (Triton) on GPUs and in Pallas' interpret mode elsewhere, chosen when the
    program is lowered for its platform, not from this process's backend: a CPU-only host can lower the GPU program
    (`tests/test_lowering.py`)."""
    def run(*arrays):
        gpu = lambda *a: kernel(False, *a)
        return jax.lax.platform_dependent(*arrays, cuda=gpu, rocm=gpu, default=lambda *a: kernel(True, *a))
    return run


def _sharded(fn, names, out_names, *arrays):
    """fn per shard (`per_shard`) over the non-None `arrays` (names: one logical tuple each)."""
    keep = [i for i, a in enumerate(arrays) if a is not None]

    def local(*xs):
        full = [None] * len(arrays)
        for i, x in zip(keep, xs):
            full[i] = x
        return fn(*full)
    return per_shard(local, tuple(names[i] for i in keep), out_names)(*(arrays[i] for i in keep))


_SEG, _LSE = ("batch", None), ("batch", "heads", None)


@jax.custom_vjp
def _pallas(q, k, v, segment_ids=None):
    """The Pallas flash kernel per shard; its forward and backward kernels each run under `per_shard`, and the
    custom_vjp sits outside them (so the gradients keep the varying-axes types of an enclosing shard_map)."""
    def fwd(interpret, q, k, v, s):
        mod, args = _mha_args(q, interpret)
        return mod.mha(q, k, v, s, *args)
    return _sharded(on_gpu(fwd), (_QKV,) * 3 + (_SEG,), _QKV, q, k, v, segment_ids)


def _pallas_fwd(q, k, v, segment_ids=None):
    def fwd(interpret, q, k, v, s):
        mod, args = _mha_args(q, interpret)
        return tuple(mod.mha(q, k, v, s, *args[:-1], True))  # return_residuals: (out, lse)
    out, lse = _sharded(on_gpu(fwd), (_QKV,) * 3 + (_SEG,), (_QKV, _LSE), q, k, v, segment_ids)
    return out, (q, k, v, segment_ids, out, lse)


def _pallas_bwd(res, do):
    def bwd(interpret, q, k, v, s, o, lse, do):
        mod, args = _mha_args(q, interpret)
        return tuple(mod._mha_backward(*args, (q, k, v, s, o, lse), do)[:3])
    grads = _sharded(on_gpu(bwd), (_QKV,) * 3 + (_SEG, _QKV, _LSE, _QKV), (_QKV,) * 3, *res, do)
    return (*(vary_like(g, x) for g, x in zip(grads, res[:3])), None)


_pallas.defvjp(_pallas_fwd, _pallas_bwd)


def context_attention(q, k, v, segment_ids=None):
    """Causal attention of this device's piece of every sequence (context parallelism: the balanced order of
    `jaxpar/parallel/context.py`) against the whole sequence: the K/V heads (not repeated for grouped queries) and the segment
    ids are all-gathered over `context`, and the blockwise kernel (`jaxpar/kernels/blockwise.py`) tiles the local queries
    against them with an online softmax, in tiles within one chunk, skipping the causally empty ones.
    q `[b, t, heads, hd]`, k, v `[b, t, kv_heads, hd]` (t = seq / context), segment_ids `[b, t]` or None."""
    cp, t = context_split(), q.shape[1]
    keys, values = gather_context(k), gather_context(v)
    k_seg = None if segment_ids is None else gather_context(segment_ids)
    q_idx = context.local_index(t, cp, context_rank())
    k_idx = jnp.asarray(context.permutation(t * cp, cp))
    tile = blockwise.block_size(t // 2)
    return blockwise.attention(q, keys, values, q_idx, k_idx, segment_ids, k_seg, tile, tile)


def attention(q, k, v, segment_ids=None, implementation: str = "xla", causal: bool = True):
    """Causal attention (within segments when given; bidirectional with `causal=False`) with the kernel
    `implementation` (resolved by `choose`: xla | cudnn | pallas, which is causal only); fused kernels run per shard
    of batch and heads."""
    if implementation == "xla":
        return xla(q, k, v, None, segment_ids, causal)
    if implementation == "cudnn":
        return per_shard(lambda q, k, v: _cudnn(q, k, v, causal), (_QKV,) * 3, _QKV)(q, k, v)
    return _pallas(q, k, v, segment_ids)
