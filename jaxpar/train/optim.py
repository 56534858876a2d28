"""The optax chain: global-norm clipping, then AdamW with a warmup + cosine learning-rate schedule.

The schedule's length is its own keys (`optim.warmup_steps`, `optim.decay_steps`), never `train.steps`, so stopping
early or extending a run does not change it. The schedule counts applied updates: a skipped step (an fp16 overflow,
`train.nonfinite=skip`) leaves the optimizer state, its count included, as it was, so the next step applies the lr
the skipped one would have (DeepSpeed and Megatron-LM likewise do not advance the schedule on a skipped fp16 step).
Update k (0-based, counting applied updates) uses lr(k + 1): linear warmup from lr/warmup to lr
over `warmup_steps` updates, cosine decay to `lr * min_lr_ratio` at `decay_steps` (Loshchilov & Hutter 2017, SGDR),
constant after. Weight decay (decoupled, Loshchilov & Hutter 2019) applies to the parameters whose model role is
a matmul weight (`model.decay_mask`): not biases, norms or embedding tables.
"""
from __future__ import annotations

import dataclasses

import jax
import optax

from jaxpar import model as gpt


@dataclasses.dataclass(frozen=True)
class OptimSettings:
    """`config.optim`'s keys this room reads (validated in `validate.validate`)."""
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    decay_steps: int
    weight_decay: float
    b1: float
    b2: float
    eps: float
    clip_norm: float

    @classmethod
    def from_config(cls, config) -> "OptimSettings":
        o = config.optim
        return cls(**{f.name: o[f.name] for f in dataclasses.fields(cls)})


def _settings(config) -> OptimSettings:
    return config if isinstance(config, OptimSettings) else OptimSettings.from_config(config)


def schedule(config):
    """Learning rate (float32 scalar) as a function of the update count (`config`: the run config or its
    `OptimSettings`)."""
    o = _settings(config)
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


def make_optimizer(config, cfg: gpt.ModelConfig | None = None) -> optax.GradientTransformation:
    """Clipping + AdamW over the params of `cfg` that train (`model.trainable`: with LoRA the adapters) (default: the run config's model; only which parameters exist and their
    roles matter, `model.decay_mask`). `config`: the run config or its `OptimSettings` (then `cfg` is needed)."""
    o = _settings(config)
    cfg = cfg or gpt.config_from(config, vocab_real=1, tensor=1)
    return optax.chain(
        optax.clip_by_global_norm(o.clip_norm),
        optax.adamw(schedule(o), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                    mask=gpt.trainable(gpt.decay_mask(cfg), cfg)),
    )
