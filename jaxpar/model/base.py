"""What every layer module (`jaxpar/model/layers.py`, `jaxpar/model/moe.py`) builds on: a parameter with its logical axis names and
role, and the SwiGLU feed-forward (Shazeer 2020) both the dense llama block and the experts compute."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.kernels.grouped import grouped_matmul
from jaxpar.parallel.logical import constrain

LOGICAL = "logical_axes"  # the Param metadata key holding one logical name per dimension
# the Param metadata key holding its role: weight | bias | norm | embedding | position (dense model), and in a
# mixture of experts expert (a routed expert's weight) | router | router_bias (the choice bias, not trained by AdamW)
ROLE = "role"
LORA = "lora"  # the key a module's LoRA adapters sit under (`jaxpar/model/lora.py`)


def param(key, shape, std, names, dtype, role="weight"):
    """A Param drawn from N(0, std²) (zeros for std 0), with its logical names and role as metadata."""
    # float64 (reference runs) draws in float32 and casts, so it starts from the float32 run's numbers
    draw = jnp.float32 if jnp.dtype(dtype) == jnp.float64 else dtype
    init = jnp.zeros(shape, dtype) if std == 0 else (std * jax.random.normal(key, shape, draw)).astype(dtype)
    return nnx.Param(init, **{LOGICAL: names, ROLE: role})


def matmul(owner, name: str, spec: str, x, drop=None):
    """`einsum(spec, x, W)` for `owner`'s weight `name` (cast to x's dtype), plus its LoRA adapter's term when the
    owner has one for it (`jaxpar/model/lora.py`); `drop(x, name)`: the adapters' input dropout, or None."""
    y = jnp.einsum(spec, x, getattr(owner, name)[...].astype(x.dtype))
    adapter = _adapter(owner, name)
    return y if adapter is None else y + adapter(x, None if drop is None else (lambda v: drop(v, name)))


def swiglu(owner, h, spec_in="btd,df->btf", spec_out="btf,fd->btd", act_names=None, drop=None):
    """down(silu(h gate) * (h up)) over `owner`'s w_gate, w_up, w_down with the einsum specs given (Shazeer 2020);
    weights cast to h's dtype; the pre-activations named "mlp_in", the product "mlp_act" (remat policies),
    constrained to `act_names` if given; `drop`: as in `matmul`."""
    g, u = (checkpoint_name(matmul(owner, n, spec_in, h, drop), "mlp_in") for n in ("w_gate", "w_up"))
    a = jax.nn.silu(g) * u
    a = checkpoint_name(a if act_names is None else constrain(a, act_names), "mlp_act")
    return matmul(owner, "w_down", spec_out, a, drop)


def _adapter(owner, name: str):
    """`owner`'s LoRA adapter of its weight `name`, or None."""
    return getattr(getattr(owner, LORA, None), name, None)


def ragged_matmul(owner, name: str, x, groups, kernel: str = "xla"):
    """`x @ W[e]` for each run of rows: `x` `[rows, in]` sorted by expert, `groups` `[E]` the rows of each expert (the
    rows after their sum give zeros), `owner`'s weight `name` `[E, in, out]` (cast to x's dtype): one grouped
    matmul (`kernels.grouped`, `kernel` its `model.grouped_matmul`), plus its LoRA adapter's term, grouped the same
    way."""
    y = grouped_matmul(x, getattr(owner, name)[...], groups, kernel)
    adapter = _adapter(owner, name)
    if adapter is None:
        return y
    low = grouped_matmul(x, adapter.a[...], groups, kernel)
    return y + grouped_matmul(low, adapter.b[...], groups, kernel) * jnp.asarray(adapter.scale, x.dtype)


def ragged_swiglu(owner, x, groups, kernel: str = "xla"):
    """`swiglu` of each expert over its run of the sorted rows `x` `[rows, embed]` (`ragged_matmul`)."""
    g, u = (checkpoint_name(ragged_matmul(owner, n, x, groups, kernel), "mlp_in") for n in ("w_gate", "w_up"))
    a = checkpoint_name(jax.nn.silu(g) * u, "mlp_act")
    return ragged_matmul(owner, "w_down", a, groups, kernel)
