"""What every layer module (`jaxpar/model/layers.py`, `jaxpar/model/moe.py`) builds on: a parameter with its logical axis names and
role, and the SwiGLU feed-forward (Shazeer 2020) both the dense llama block and the experts compute."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.parallel.logical import constrain

LOGICAL = "logical_axes"  # the Param metadata key holding one logical name per dimension
# the Param metadata key holding its role: weight | bias | norm | embedding | position (dense model), and in a
# mixture of experts expert (a routed expert's weight) | router | router_bias (the choice bias, not trained by AdamW)
ROLE = "role"


def param(key, shape, std, names, dtype, role="weight"):
    """A Param drawn from N(0, std²) (zeros for std 0), with its logical names and role as metadata."""
    # float64 (reference runs) draws in float32 and casts, so it starts from the float32 run's numbers
    draw = jnp.float32 if jnp.dtype(dtype) == jnp.float64 else dtype
    init = jnp.zeros(shape, dtype) if std == 0 else (std * jax.random.normal(key, shape, draw)).astype(dtype)
    return nnx.Param(init, **{LOGICAL: names, ROLE: role})


def swiglu(h, gate, up, down, spec_in="btd,df->btf", spec_out="btf,fd->btd", act_names=None):
    """down(silu(h gate) * (h up)) with the einsum specs given (Shazeer 2020); weights cast to h's dtype; the
    pre-activations named "mlp_in", the product "mlp_act" (remat policies), constrained to `act_names` if given."""
    w = lambda p: p[...].astype(h.dtype)  # noqa: E731
    g, u = (checkpoint_name(jnp.einsum(spec_in, h, w(p)), "mlp_in") for p in (gate, up))
    a = jax.nn.silu(g) * u
    a = checkpoint_name(a if act_names is None else constrain(a, act_names), "mlp_act")
    return jnp.einsum(spec_out, a, w(down))
