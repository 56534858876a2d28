"""The one dtype rule shared by the model, the loss and the pipelines (imports nothing of jaxpar)."""
from __future__ import annotations

import jax.numpy as jnp


def at_least_f32(dtype):
    """float32 for float32 and narrower dtypes, float64 for float64 (reference runs): where statistics, logits, loss
    sums and gradient buffers are computed."""
    return jnp.promote_types(dtype, jnp.float32)
