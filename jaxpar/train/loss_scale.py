"""Dynamic loss scaling for float16 training, with DeepSpeed's update rule and defaults.

Everything here is pure JAX and jit-able, so the whole rule runs inside the jitted train step:

    scaled = loss_scale.scale_loss(loss, ls)            # float32 [], loss * scale
    grads = loss_scale.unscale(grads_of_scaled, ls)     # float32 grads / scale
    ok = loss_scale.all_finite(grads)                   # bool [], False on any inf/nan
    ls, apply = loss_scale.update(ls, ok, cfg)
    params, opt_state = loss_scale.select_tree(apply, (new_params, new_opt_state), (params, opt_state))

An overflow (any non-finite gradient) skips the step: `apply` is False and `select_tree` returns the old params and
optimizer state bit for bit.

The update rule follows DeepSpeed's `DynamicLossScaler.update_scale` (deepspeed/runtime/fp16/loss_scaler.py) with
`consecutive_hysteresis=False`, DeepSpeed's default; its config defaults (the `fp16` section: initial_scale_power 16,
loss_scale_window 1000, hysteresis 2, min_loss_scale 1, and the scaler's scale_factor 2) are `LossScaleConfig`'s.
One step of the rule, given this step's overflow flag:

  * Overflow: if the hysteresis left is <= 1, the scale becomes max(scale / factor, min_scale) and the hysteresis
    left stays as it is (DeepSpeed does not refill it here); otherwise the scale is kept and the hysteresis left drops
    by one. Either way the count of clean steps restarts from 0 (DeepSpeed: `last_overflow_iter = cur_iter`).
  * Clean step: the count of clean steps rises by one; when it reaches `window` the scale is multiplied by `factor`,
    the hysteresis left is refilled to `hysteresis`, and the count restarts from 0 (DeepSpeed grows when
    `(cur_iter - last_overflow_iter) % scale_window == 0`, which is the same thing). With
    `consecutive_hysteresis=True` the hysteresis is refilled on every clean step instead.

So with hysteresis 2 the first overflow after a growth only spends hysteresis; every later overflow (until the next
growth) halves the scale. Unlike DeepSpeed, the scale has a ceiling, `max_scale` (default 2^24, NVIDIA Apex amp's
`max_loss_scale`): a growth never goes above it, so a long clean stretch cannot double the scale past float32's
range to inf, from which halving would never come back. Every new scale is clipped to [min_scale, max_scale], so
even a state holding inf (a checkpoint of an older version) recovers at its next update.

Where DeepSpeed raises an exception (its `raise_error_at_min_scale=True`) at the first overflow that would lower the
scale while it already equals the minimum, this module counts overflows in a row at the minimum scale and
`should_stop` tells the trainer when `patience` of them have happened, so it can stop with a clear error.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "LossScaleConfig",
    "LossScaleState",
    "from_config",
    "init",
    "update",
    "should_stop",
    "scale_loss",
    "unscale",
    "all_finite",
    "select_tree",
    "DEFAULT_PATIENCE",
]

F32_MAX = float(jnp.finfo(jnp.float32).max)
DEFAULT_PATIENCE = 10  # overflows in a row at the minimum scale before `should_stop` says stop


@dataclasses.dataclass(frozen=True)
class LossScaleConfig:
    """Dynamic loss-scaling settings (hashable: usable as a static jit argument).

    Defaults are DeepSpeed's fp16 defaults: `initial` = 2**initial_scale_power with initial_scale_power 16,
    `window` = loss_scale_window 1000, `hysteresis` = hysteresis 2, `min_scale` = min_loss_scale 1, `factor` = the
    DynamicLossScaler's scale_factor 2, `consecutive_hysteresis` = consecutive_hysteresis False; `max_scale` =
    Apex amp's max_loss_scale 2^24 (DeepSpeed has none).

    Raises:
      ValueError: window < 1, hysteresis < 1, factor <= 1, min_scale <= 0, max_scale not finite, or initial
        outside [min_scale, max_scale].
    """
    initial: float = 2.0 ** 16
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    factor: float = 2.0
    consecutive_hysteresis: bool = False
    max_scale: float = 2.0 ** 24

    def __post_init__(self):
        errs = []
        if int(self.window) < 1:
            errs.append(f"window={self.window} must be >= 1")
        if int(self.hysteresis) < 1:
            errs.append(f"hysteresis={self.hysteresis} must be >= 1")
        if not float(self.factor) > 1.0:
            errs.append(f"factor={self.factor} must be > 1")
        if not float(self.min_scale) > 0.0:
            errs.append(f"min_scale={self.min_scale} must be > 0")
        if not math.isfinite(float(self.max_scale)) or float(self.max_scale) > F32_MAX:
            errs.append(f"max_scale={self.max_scale} must be a finite float32 (<= {F32_MAX:.4g})")
        if not float(self.min_scale) <= float(self.initial) <= float(self.max_scale):
            errs.append(f"initial={self.initial} must be within [min_scale={self.min_scale}, "
                        f"max_scale={self.max_scale}]")
        if errs:
            raise ValueError("invalid loss-scale config: " + "; ".join(errs) + ".")


def from_config(config) -> LossScaleConfig:
    """`LossScaleConfig` from `config.train.loss_scale_*`, with the defaults above for keys not (yet) present.

    Keys read: train.loss_scale_initial (2**16), train.loss_scale_window (1000), train.loss_scale_hysteresis (2),
    train.loss_scale_min (1.0), train.loss_scale_factor (2.0), train.loss_scale_consecutive_hysteresis (False),
    train.loss_scale_max (2**24).

    Raises:
      ValueError: as `LossScaleConfig`.
    """
    tr = config.train
    d = LossScaleConfig()
    return LossScaleConfig(
        initial=float(tr.get("loss_scale_initial", d.initial)),
        window=int(tr.get("loss_scale_window", d.window)),
        hysteresis=int(tr.get("loss_scale_hysteresis", d.hysteresis)),
        min_scale=float(tr.get("loss_scale_min", d.min_scale)),
        factor=float(tr.get("loss_scale_factor", d.factor)),
        consecutive_hysteresis=bool(tr.get("loss_scale_consecutive_hysteresis", d.consecutive_hysteresis)),
        max_scale=float(tr.get("loss_scale_max", d.max_scale)),
    )


class LossScaleState(NamedTuple):
    """Loss-scaler state: a pytree of scalar arrays (checkpointable by Orbax like the rest of the train state).

    scale: float32 [] the current loss scale.
    good_steps: int32 [] clean steps since the last overflow or the last growth.
    hysteresis_left: int32 [] overflows still tolerated before the scale is lowered (DeepSpeed's cur_hysteresis).
    overflows: int32 [] total overflowed (skipped) steps, for logging.
    consecutive_min_overflows: int32 [] overflows in a row while the scale was already at `min_scale`.
    """
    scale: jax.Array
    good_steps: jax.Array
    hysteresis_left: jax.Array
    overflows: jax.Array
    consecutive_min_overflows: jax.Array


def init(cfg: LossScaleConfig = LossScaleConfig()) -> LossScaleState:
    """The state before the first step: scale `cfg.initial`, hysteresis full, all counters 0."""
    i32 = lambda v: jnp.asarray(v, jnp.int32)
    return LossScaleState(scale=jnp.asarray(cfg.initial, jnp.float32), good_steps=i32(0),
                          hysteresis_left=i32(cfg.hysteresis), overflows=i32(0), consecutive_min_overflows=i32(0))


def update(state: LossScaleState, grads_finite, cfg: LossScaleConfig = LossScaleConfig()):
    """One step of DeepSpeed's `DynamicLossScaler.update_scale` (see the module docstring for the rule).

    Args:
      state: the current `LossScaleState`.
      grads_finite: bool [] (or anything `jnp.asarray` turns into one): True when every gradient is finite.
      cfg: the settings (static: Python numbers).

    Returns:
      (new_state, apply_update): apply_update is bool [], equal to `grads_finite`; when False the step must leave
      params and optimizer state unchanged (`select_tree`).
    """
    finite = jnp.asarray(grads_finite, jnp.bool_).reshape(())
    overflow = jnp.logical_not(finite)
    min_scale = jnp.asarray(cfg.min_scale, jnp.float32)
    max_scale = jnp.asarray(cfg.max_scale, jnp.float32)
    factor = jnp.asarray(cfg.factor, jnp.float32)
    full = jnp.asarray(cfg.hysteresis, jnp.int32)
    zero = jnp.zeros((), jnp.int32)

    # overflow: lower the scale once hysteresis is spent, else spend one unit of hysteresis
    lower = state.hysteresis_left <= 1
    scale_ov = jnp.where(lower, state.scale / factor, state.scale)
    hyst_ov = jnp.where(lower, state.hysteresis_left, state.hysteresis_left - 1)

    # clean: grow after `window` clean steps in a row
    good = state.good_steps + 1
    grow = good >= cfg.window
    scale_ok = jnp.where(grow, state.scale * factor, state.scale)  # clipped to max_scale below
    hyst_ok = full if cfg.consecutive_hysteresis else jnp.where(grow, full, state.hysteresis_left)
    good_ok = jnp.where(grow, zero, good)

    at_min = state.scale <= min_scale
    new = LossScaleState(
        scale=jnp.clip(jnp.where(overflow, scale_ov, scale_ok), min_scale, max_scale).astype(jnp.float32),
        good_steps=jnp.where(overflow, zero, good_ok).astype(jnp.int32),
        hysteresis_left=jnp.where(overflow, hyst_ov, hyst_ok).astype(jnp.int32),
        overflows=(state.overflows + overflow.astype(jnp.int32)).astype(jnp.int32),
        consecutive_min_overflows=jnp.where(overflow & at_min, state.consecutive_min_overflows + 1,
                                            zero).astype(jnp.int32),
    )
    return new, finite


def should_stop(state: LossScaleState, cfg: LossScaleConfig = LossScaleConfig(),
                patience: int = DEFAULT_PATIENCE):
    """bool []: True once `patience` steps in a row overflowed while the scale was already at `cfg.min_scale`.

    The trainer should then stop with an error (the loss is non-finite even unscaled: lower the learning rate or
    use bfloat16). DeepSpeed raises at the first overflow that would lower a scale already at its minimum, which
    is `patience=1` here (once hysteresis is spent); the default `DEFAULT_PATIENCE` = 10 is more lenient.

    Raises:
      ValueError: patience < 1.
    """
    if int(patience) < 1:
        raise ValueError(f"patience={patience} must be >= 1.")
    del cfg  # the count is already taken against cfg.min_scale by `update`
    return state.consecutive_min_overflows >= int(patience)


def scale_loss(loss, state: LossScaleState):
    """float32 `loss * scale` (differentiate this; then `unscale` the gradients)."""
    return jnp.asarray(loss).astype(jnp.float32) * state.scale


def unscale(grads, state: LossScaleState):
    """Every gradient leaf cast to float32 and divided by the scale (same tree structure and shapes)."""
    return jax.tree.map(lambda g: jnp.asarray(g).astype(jnp.float32) / state.scale, grads)


def all_finite(tree) -> jax.Array:
    """bool []: True when no leaf holds an inf or nan (True for an empty tree)."""
    leaves = jax.tree.leaves(tree)
    if not leaves:
        return jnp.asarray(True)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def select_tree(apply, new: Any, old: Any):
    """Leafwise `where(apply, new, old)`: `new` when `apply` (bool []) is True, else `old` bit for bit.

    `new` and `old` must have the same structure; each pair of leaves the same shape and dtype (numeric arrays).

    Raises:
      ValueError: (from `jax.tree.map`) when the structures differ.
    """
    apply = jnp.asarray(apply, jnp.bool_)
    return jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)
