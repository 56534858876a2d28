"""Grouped matmuls behind one call: `x @ w[e]` for each run of rows of `x` `[rows, in]` sorted by group, `w`
`[groups, in, out]`, `groups` `[groups]` int32 the rows of each (the rows after their sum give zeros). Knows no model.

`model.grouped_matmul` picks the kernel (`choose`):
  - "xla": `jax.lax.ragged_dot` (and its own VJP). XLA:GPU gets it as the `chlo.ragged_dot` composite; XLA:CPU
    runs it as a dense masked matmul over every group (groups x the FLOPs: correct, not fast).
  - "mosaic": the Hopper grouped kernel JAX ships (`jax.experimental.pallas.ops.gpu.ragged_dot_mgpu`, Mosaic GPU,
    wgmma), for the forward matmul and for the input gradient (`dy @ w[e]^T`, the same kernel on the weight
    transposed in memory: its `transpose_rhs` mode is not one Mosaic GPU's interpreter runs, so no test could see
    it); the weight gradient (`x_e^T @ dy_e`, a contraction over the ragged rows) is XLA's
    `ragged_dot_general`. Float16/bfloat16, `in` and `out` multiples of 64. Off GPU it runs in Mosaic GPU's
    interpret mode (slow: for tests), or compiled for CUDA under `lowering_for("cuda")`, so a host lowers the CUDA
    program with the kernel (`tests/test_lowering.py`).
  - "auto": "mosaic" on a Hopper GPU (compute capability 9.x) where it applies, else "xla".
A choice is made per matmul: where "mosaic" cannot run one (a LoRA adapter's rank-wide matmul, say) it runs on
"xla"; `validate.check_grouped` says, before any compile, why a configured "mosaic" cannot run the experts' own
matmuls.
"""
from __future__ import annotations

import contextlib
import functools
import types

import jax
import jax.numpy as jnp

from jaxpar.parallel.shard_map_body import vary_like

IMPLEMENTATIONS = ("auto", "xla", "mosaic")
BLOCK_M = 128  # the Mosaic kernel's row block
BLOCK_K = 64  # the contraction block of the Mosaic kernel: `in` (forward) and `out` (input gradient) divide by it
MAX_STAGES = 4  # the kernel's pipelined copies in flight (its `max_concurrent_steps`)


def mosaic_reason(dtype, fan_in: int, fan_out: int) -> str | None:
    """Why the Mosaic GPU kernel cannot run `[rows, fan_in] @ [groups, fan_in, fan_out]` in `dtype`, or None."""
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return f"the Mosaic GPU grouped kernel takes float16/bfloat16, not {jnp.dtype(dtype).name}"
    if fan_in % BLOCK_K or fan_out % BLOCK_K:
        return f"the Mosaic GPU grouped kernel needs in and out multiples of {BLOCK_K}, not {fan_in} x {fan_out}"
    return None


def hopper(backend: str | None = None) -> bool:
    """Whether this process's accelerator is a Hopper GPU (compute capability 9.x), the Mosaic kernel's target."""
    if (backend or jax.default_backend()) != "gpu":
        return False
    return str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9.")


def choose(implementation: str, dtype, fan_in: int, fan_out: int, backend: str | None = None,
           on_hopper: bool | None = None) -> str:
    """`model.grouped_matmul` for one matmul -> the kernel that runs it: xla | mosaic (see the module docstring).
    `on_hopper`: whether the target is a Hopper GPU (the planner's device), instead of asking this process's."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"model.grouped_matmul={implementation!r}: pick one of {IMPLEMENTATIONS}")
    if implementation == "xla" or mosaic_reason(dtype, fan_in, fan_out) is not None:
        return "xla"
    if implementation == "auto" and not (hopper(backend) if on_hopper is None else on_hopper):
        return "xla"
    return "mosaic"


def grouped_matmul(x, w, groups, implementation: str = "xla"):
    """`x` `[rows, in]` sorted by group, `w` `[G, in, out]` (cast to x's dtype), `groups` `[G]` -> `[rows, out]`,
    zeros past the groups' rows, with the kernel `choose` picks."""
    w = w.astype(x.dtype)
    if choose(implementation, x.dtype, w.shape[1], w.shape[2]) == "xla":
        return jax.lax.ragged_dot(x, w, groups)
    # typed alike, as JAX does for `ragged_dot`'s operands: a custom VJP returns each gradient in its input's type
    union = vary_like(vary_like(x, w), groups)
    x, w, groups = (vary_like(a, union) for a in (x, w, groups))
    return _mosaic(x, w, groups)


def _below(groups, y):
    """y's rows past the groups' total set to zero (the kernel leaves them unwritten)."""
    return jnp.where((jnp.arange(y.shape[0]) < jnp.sum(groups))[:, None], y, jnp.zeros((), y.dtype))


def _blocks(n: int) -> int:
    return 128 if n % 128 == 0 else 64


def _kernel(interpret: bool, x, w, groups):
    """The Mosaic GPU grouped kernel: `x @ w[e]` (`w` `[G, in, out]`)."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as mod

    call = functools.partial(mod.ragged_dot, block_m=BLOCK_M, block_n=_blocks(w.shape[2]), block_k=BLOCK_K,
                             max_concurrent_steps=MAX_STAGES, grid_block_n=1)
    if not interpret:
        return call(x, w, group_sizes=groups)
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # no public name in JAX 0.10
    from jax.experimental.pallas import mosaic_gpu as plgpu

    # the kernel builds its `plgpu.kernel` without `interpret`: hand it a module whose `kernel` interprets
    shim = types.SimpleNamespace(**{n: getattr(plgpu, n) for n in dir(plgpu) if not n.startswith("__")})
    shim.kernel = functools.partial(plgpu.kernel, interpret=InterpretGPUParams())
    real, mod.plgpu = mod.plgpu, shim
    try:
        return call(x, w, group_sizes=groups)
    finally:
        mod.plgpu = real


_LOWERING_FOR: list[str] = []  # `lowering_for`'s platform, while it holds


@contextlib.contextmanager
def lowering_for(platform: str):
    """Trace the Mosaic kernel compiled for `platform` ("cuda") on a host without a GPU, to lower the GPU program
    (`tests/test_lowering.py`, `bench/moe.py --lower cuda`). Elsewhere off GPU the kernel runs interpreted, chosen
    when it is traced: an interpreter's callbacks cannot sit in a CUDA program, even in a branch never taken."""
    _LOWERING_FOR.append(platform)
    try:
        yield
    finally:
        _LOWERING_FOR.pop()


def _on_gpu(x, w, groups):
    """The kernel compiled on GPUs (and under `lowering_for("cuda")`), interpreted elsewhere. Rows are padded to a
    multiple of the kernel's row block (its last block would read past them; a copy only then)."""
    rows = x.shape[0]
    x = jnp.pad(x, ((0, -rows % BLOCK_M), (0, 0)))
    interpret = jax.default_backend() != "gpu" and _LOWERING_FOR[-1:] != ["cuda"]
    return _below(groups, _kernel(interpret, x, w, groups)[:rows])


@jax.custom_vjp
def _mosaic(x, w, groups):
    return _on_gpu(x, w, groups)


def _mosaic_fwd(x, w, groups):
    return _on_gpu(x, w, groups), (x, w, groups)


def _mosaic_bwd(res, dy):
    x, w, groups = res
    dx = _on_gpu(dy, w.swapaxes(1, 2), groups)
    _, weight_vjp = jax.vjp(lambda w: jax.lax.ragged_dot(x, w, groups), w)  # XLA's ragged contraction
    return dx, weight_vjp(dy)[0], None


_mosaic.defvjp(_mosaic_fwd, _mosaic_bwd)
