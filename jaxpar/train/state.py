"""The train state and where it lives: a fresh state from a seed, and the shardings of the state, the float32
gradient buffer and the batch for a layout (logical axis rules + the ZeRO stage, `jaxpar/parallel/sharding.py`).

The state is `{"params", "opt_state" (of the params that train: `model.trainable`), "step": int32 [], "rng": uint32 key data, "loss_scale": LossScaleState,
"nonfinite": int32 [], "first_nonfinite": int32 [], "spikes": {...}}`; the same tree whatever the layout.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar.train import loss_scale, spikes
from jaxpar import model as gpt
from jaxpar.parallel import sharding as shd


def init_state(cfg: gpt.ModelConfig, optimizer, seed: int, ls_cfg=loss_scale.LossScaleConfig(), params=None,
               spike_window: int = 1, reference: str = "") -> dict:
    """A fresh train state; its values depend only on `seed` and `cfg` (not on the layout); `params`, if given,
    replace the drawn ones (a start from imported weights); `spike_window`: `train.spike_window`.

    Keys: params, opt_state, step (int32, updates done), rng (uint32 key data), loss_scale (`LossScaleState`, used
    with float16 compute, kept in every state so checkpoints move between precisions), nonfinite (int32 count of
    steps with a non-finite loss or grads), first_nonfinite (int32, the first such step, or -1) and spikes (the
    loss-spike statistics, `jaxpar/train/spikes.py`, kept whether `train.skip_spikes` is on or not); with
    `reference` (DPO's reference model as weights of its own), reference: a frozen copy of the starting params
    ("copy"), or of their LoRA adapters alone ("adapters": the base is the policy's, frozen)."""
    key = jax.random.key(seed)
    params = fresh_params(cfg, seed) if params is None else params
    i32 = lambda v: jnp.full((), v, jnp.int32)
    return {"params": params, "opt_state": optimizer.init(gpt.trainable(params, cfg)), "step": i32(0),
            "rng": jax.random.key_data(jax.random.fold_in(key, 1)), "loss_scale": loss_scale.init(ls_cfg),
            "nonfinite": i32(0), "first_nonfinite": i32(-1), "spikes": spikes.init(spike_window)} | \
        ({"reference": jax.tree.map(jnp.copy, reference_part(params, cfg, reference))} if reference else {})


def reference_part(tree: dict, cfg: gpt.ModelConfig, reference: str) -> dict:
    """What of a params-shaped tree the state's frozen reference holds: all of it ("copy"), or the LoRA adapters
    ("adapters")."""
    return gpt.trainable(tree, cfg) if reference == "adapters" else tree


def fresh_params(cfg: gpt.ModelConfig, seed: int) -> dict:
    """The params a fresh state of `seed` holds (LoRA's adapters drawn as PEFT draws them, whatever the base)."""
    return gpt.init_params(cfg, jax.random.fold_in(jax.random.key(seed), 0))


HOST = "pinned_host"  # the memory kind offloaded state lives in between steps
# optim.offload -> the state's groups that live in host memory between steps
OFFLOADED = {"none": (), "optimizer": ("opt_state",), "params": ("params", "opt_state", "reference")}


@dataclasses.dataclass(frozen=True)
class Shardings:
    """Specs and shardings of one layout. ZeRO stage z shards over `data`: params from z >= 3, the float32 gradient
    buffer from z >= 2, the optimizer state from z >= 1 (Rajbhandari et al. 2020, sec. 5). With `optim.offload`
    the groups `OFFLOADED` names live in pinned host memory between steps (the same specs, memory kind `HOST`:
    only this device's shard, ZeRO's included), and on the device only inside the step (`state_device`)."""
    names: dict  # logical axis names per param leaf
    base_specs: dict  # the params' specs without ZeRO
    param_specs: dict
    grad_specs: dict  # of the params that train (`model.trainable`: with LoRA the adapters only)
    state: dict  # NamedShardings of the train state between steps (offloaded groups: in host memory)
    state_device: dict  # the same, every group on the device (inside the step)
    grads: dict  # NamedShardings of the float32 gradient buffer (the params that train)
    unsharded: dict  # the params' NamedShardings without ZeRO's `data` axis
    batch: NamedSharding  # `[global_batch, ...]` split over data (x expert)
    replicated: NamedSharding


def on_device(tree, sh: Shardings, offload: str, group: str | None = None):
    """Inside a jitted function: the state (or its group `group`) with its host-resident groups brought to the
    device (`optim.offload`); the identity without offload."""
    if group is not None:
        return jax.device_put(tree, sh.state_device[group]) if group in OFFLOADED[offload] else tree
    return {k: on_device(v, sh, offload, k) for k, v in tree.items()}


def shardings(cfg: gpt.ModelConfig, optimizer, rules, mesh, zero_stage: int, offload: str = "none",
              reference: str = "") -> Shardings:
    names = gpt.logical_axes(cfg)
    pshapes = jax.eval_shape(lambda: gpt.init_params(cfg, jax.random.key(0)))
    specs = lambda zero: shd.param_specs(names, pshapes, rules, mesh, zero=zero)
    train = lambda tree: gpt.trainable(tree, cfg)  # noqa: E731 (what has gradients and optimizer state: LoRA's adapters)
    pspecs, gspecs = specs(zero_stage >= 3), train(specs(zero_stage >= 2))
    ospecs = shd.opt_state_specs(optimizer, jax.eval_shape(optimizer.init, train(pshapes)), train(specs(zero_stage >= 1)))
    state = {"params": pspecs, "opt_state": ospecs, "step": P(), "rng": P(),
             "loss_scale": loss_scale.LossScaleState(*(P(),) * 5), "nonfinite": P(), "first_nonfinite": P(),
             "spikes": {k: P() for k in spikes.KEYS + spikes.COUNTS}} | \
        ({"reference": reference_part(pspecs, cfg, reference)} if reference else {})
    device = shd.named(mesh, state)
    host = {k: jax.tree.map(lambda n: n.with_memory_kind(HOST), v) if k in OFFLOADED[offload] else v
            for k, v in device.items()}
    return Shardings(names=names, base_specs=specs(False), param_specs=pspecs, grad_specs=gspecs,
                     state=host, state_device=device,
                     grads=shd.named(mesh, gspecs), unsharded=shd.named(mesh, specs(False)),
                     batch=NamedSharding(mesh, shd.batch_spec(mesh)), replicated=NamedSharding(mesh, P()))
