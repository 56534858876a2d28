"""The optax chain: global-norm clipping, then AdamW with a warmup + cosine learning-rate schedule.

The schedule's length is its own keys (`optim.warmup_steps`, `optim.decay_steps`), never `train.steps`, so stopping
early or extending a run does not change it. The schedule counts applied updates: a skipped step (an fp16 overflow,
`train.nonfinite=skip`) leaves the optimizer state, its count included, as it was, so the next step applies the lr
the skipped one would have (DeepSpeed and Megatron-LM likewise do not advance the schedule on a skipped fp16 step).
Update k (0-based, counting applied updates) uses lr(k + 1): linear warmup from lr/warmup to lr
over `warmup_steps` updates, cosine decay to `lr * min_lr_ratio` at `decay_steps` (Loshchilov & Hutter 2017, SGDR),
constant after. Weight decay (decoupled, Loshchilov & Hutter 2019) skips biases, LayerNorm parameters and embeddings.
"""
from __future__ import annotations

import jax
import optax

from jaxpar.model import no_decay


def schedule(config):
    """Learning rate (float32 scalar) as a function of the update count."""
    o = config.optim
    base = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=o.lr, warmup_steps=o.warmup_steps,
        decay_steps=max(o.decay_steps, o.warmup_steps + 1), end_value=o.lr * o.min_lr_ratio)
    return lambda count: base(count + 1)


def applied_updates(opt_state):
    """int32 []: the updates applied so far (optax's schedule count; a skipped step does not advance it)."""
    states = [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByScheduleState))
              if isinstance(s, optax.ScaleByScheduleState)]
    assert len(states) == 1, "make_optimizer's chain has one learning-rate schedule"
    return states[0].count


def decay_mask(params):
    """True for each parameter that gets weight decay."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not no_decay(tuple(getattr(k, "key", str(k)) for k in path)), params)


def make_optimizer(config) -> optax.GradientTransformation:
    o = config.optim
    return optax.chain(
        optax.clip_by_global_norm(o.clip_norm),
        optax.adamw(schedule(config), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, mask=decay_mask),
    )
