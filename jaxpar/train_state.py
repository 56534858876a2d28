"""The train state and where it lives: a fresh state from a seed, and the shardings of the state, the float32
gradient buffer and the batch for a layout (logical axis rules + the ZeRO stage, `jaxpar/sharding.py`).

The state is `{"params", "opt_state", "step": int32 [], "rng": uint32 key data, "loss_scale": LossScaleState,
"nonfinite": int32 [], "first_nonfinite": int32 []}`; the same tree whatever the layout.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar import loss_scale
from jaxpar import model as gpt
from jaxpar import sharding as shd


def init_state(cfg: gpt.ModelConfig, optimizer, seed: int, ls_cfg=loss_scale.LossScaleConfig(), params=None) -> dict:
    """A fresh train state; its values depend only on `seed` and `cfg` (not on the layout); `params`, if given,
    replace the drawn ones (a start from imported weights).

    Keys: params, opt_state, step (int32, updates done), rng (uint32 key data), loss_scale (`LossScaleState`, used
    with float16 compute, kept in every state so checkpoints move between precisions), nonfinite (int32 count of
    steps with a non-finite loss or grads) and first_nonfinite (int32, the first such step, or -1)."""
    key = jax.random.key(seed)
    params = gpt.init_params(cfg, jax.random.fold_in(key, 0)) if params is None else params
    i32 = lambda v: jnp.full((), v, jnp.int32)
    return {"params": params, "opt_state": optimizer.init(params), "step": i32(0),
            "rng": jax.random.key_data(jax.random.fold_in(key, 1)), "loss_scale": loss_scale.init(ls_cfg),
            "nonfinite": i32(0), "first_nonfinite": i32(-1)}


@dataclasses.dataclass(frozen=True)
class Shardings:
    """Specs and shardings of one layout. ZeRO stage z shards over `data`: params from z >= 3, the float32 gradient
    buffer from z >= 2, the optimizer state from z >= 1 (Rajbhandari et al. 2020, sec. 5)."""
    names: dict  # logical axis names per param leaf
    base_specs: dict  # the params' specs without ZeRO
    param_specs: dict
    grad_specs: dict
    state: dict  # NamedShardings of the train state
    grads: dict  # NamedShardings of the float32 gradient buffer
    unsharded: dict  # the params' NamedShardings without ZeRO's `data` axis
    batch: NamedSharding  # `[global_batch, ...]` split over data (x expert)
    replicated: NamedSharding


def shardings(cfg: gpt.ModelConfig, optimizer, rules, mesh, zero_stage: int) -> Shardings:
    names = gpt.logical_axes(cfg)
    pshapes = jax.eval_shape(lambda: gpt.init_params(cfg, jax.random.key(0)))
    specs = lambda zero: shd.param_specs(names, pshapes, rules, mesh, zero=zero)
    pspecs, gspecs = specs(zero_stage >= 3), specs(zero_stage >= 2)
    ospecs = shd.opt_state_specs(optimizer, jax.eval_shape(optimizer.init, pshapes), specs(zero_stage >= 1))
    state = {"params": pspecs, "opt_state": ospecs, "step": P(), "rng": P(),
             "loss_scale": loss_scale.LossScaleState(*(P(),) * 5), "nonfinite": P(), "first_nonfinite": P()}
    return Shardings(names=names, base_specs=specs(False), param_specs=pspecs, grad_specs=gspecs,
                     state=shd.named(mesh, state),
                     grads=shd.named(mesh, gspecs), unsharded=shd.named(mesh, specs(False)),
                     batch=NamedSharding(mesh, shd.batch_spec(mesh)), replicated=NamedSharding(mesh, P()))
