"""The jitted train and eval steps for one layout: the choices read off the config once, then jit.

A batch is `{"tokens": int32 [global_batch, seq + 1]}` (inputs are tokens[:, :-1], targets tokens[:, 1:]) with an
optional `"mask": float32 [global_batch, seq]` of loss weights and optional `"segments": int32 [global_batch, seq + 1]`
(packed documents: attention stays within a segment, positions restart at each, and a segment's last token predicts
nothing; GRPO's shared-prompt rows: `jaxpar/kernels/segments.py`) and optional `"positions": int32 [global_batch,
seq + 1]` (the tokens' positions, where segments do not restart them), sharded on `data`. The loss is the mean next-token
cross-entropy (nats/token, float32) over all masked-in tokens of the whole global batch, so `train.microbatches`
accumulated microbatches give exactly the step on the whole batch, also when they hold different numbers of tokens.

The train state (`jaxpar/train/state.py`) is donated to the step and comes back with the same shardings. The step
compiles once per run. The gradient strategy (accumulation, pipeline by autodiff, pipeline loop) is
`jaxpar/train/gradients.py`; the update with loss scaling and the non-finite policy is `apply_update` here.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

from jaxpar.train import gradients, loss_scale, objectives
from jaxpar import model as gpt
from jaxpar.model import moe
from jaxpar.train import spikes
from jaxpar.parallel import pipeline
from jaxpar.config import step_rules
from jaxpar.parallel.context import permutation as balanced_order
from jaxpar.dtypes import at_least_f32
from jaxpar.parallel.logical import activation_rules
from jaxpar.train.optim import OptimSettings, applied_updates, make_optimizer, schedule
from jaxpar.layout import Layout
from jaxpar.train.state import Shardings, fresh_params, init_state, on_device, shardings
from jaxpar.parallel.zero import DataParallel

__all__ = ["build", "Steps", "StepSettings", "init_state", "model_config", "split_batch", "to_microbatches",
           "map_blocks", "apply_update"]


def model_config(config, vocab_real: int, tensor: int) -> gpt.ModelConfig:
    """The model of a run config (`model.config_from`); attention 'auto' is XLA's for rows that share prefixes."""
    cfg = gpt.config_from(config, vocab_real, tensor)  # (the fused kernels see a query's own segment only)
    shares = cfg.attention == "auto" and objectives.from_config(config).shares_prefixes
    return dataclasses.replace(cfg, attention="xla") if shares else cfg


@dataclasses.dataclass(frozen=True)
class StepSettings:
    """The config keys the step reads, resolved once (validated in `validate.validate`): the layout, and how the
    update treats loss scaling and non-finite values."""
    layout: Layout
    rules: tuple
    float16: bool  # compute in float16: dynamic loss scaling
    stop_on_nonfinite: bool  # train.nonfinite == "stop"
    skip_bubbles: bool
    skip_steps: tuple  # train.skip_steps: steps (1 = the first) whose update is skipped
    skip_spikes: bool  # train.skip_spikes
    spike_window: int
    spike_threshold: float
    loss_scale: loss_scale.LossScaleConfig
    optim: OptimSettings
    objective: objectives.Objective  # `jaxpar/train/objectives/`
    reference: str  # the objective's reference model: "" (none), "copy" (frozen weights in the state),
    # "adapters_off" (LoRA), "adapters" (a frozen copy of the starting adapters in the state), "batch" (precomputed
    # log-probs arrive with the batch, `ref`)
    start_adapters: bool  # the run starts from `lora.adapter`'s adapters (the reference keeps them)
    dropout: bool  # the objective runs the model's dropout in its passes (`Objective.dropout`)

    @classmethod
    def from_config(cls, config, num_devices: int) -> "StepSettings":
        tr = config.train
        return cls(layout=Layout.from_config(config, num_devices), rules=step_rules(config),
                   float16=tr.compute_dtype == "float16", stop_on_nonfinite=tr.nonfinite == "stop",
                   skip_bubbles=bool(config.pipeline.skip_bubbles),
                   skip_steps=tuple(int(s) for s in tr.skip_steps), skip_spikes=bool(tr.skip_spikes),
                   spike_window=int(tr.spike_window), spike_threshold=float(tr.spike_threshold),
                   loss_scale=loss_scale.from_config(config),
                   optim=OptimSettings.from_config(config), objective=(obj := objectives.from_config(config)),
                   reference=obj.reference, start_adapters=bool(config.lora.adapter), dropout=obj.dropout)


def split_batch(batch):
    """-> inputs, targets `[batch, seq]` int32, mask `[batch, seq]` float32, the inputs' segments `[batch, seq]`
    int32 (None without packing). Images (`pixels` `[batch, H, W, C]`, `labels` `[batch]`, optional `mask`
    `[batch]`: ViT) -> pixels, labels, mask `[batch]`, None."""
    if "pixels" in batch:
        mask = batch.get("mask")
        return batch["pixels"], batch["labels"], jnp.ones(batch["labels"].shape, jnp.float32) if mask is None \
            else mask.astype(jnp.float32), None
    tokens = batch["tokens"]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    mask = batch.get("mask")
    mask = jnp.ones(targets.shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
    seg = batch.get("segments")
    if seg is not None:  # a document's last token never predicts the next document's first
        mask, seg = mask * (seg[:, 1:] == seg[:, :-1]), seg[:, :-1]
    return inputs, targets, mask, seg


def to_microbatches(x, m: int):
    """`[batch, ...]` -> `[m, batch / m, ...]`; microbatch j takes rows j, j + m, ... so each keeps its data shard."""
    return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)


# what an objective's batch may carry per row besides its tokens, microbatched with them: the reference's (DPO: sums
# per pair; GRPO: per token), GRPO's old policy's per-token log-probs, its advantages, (MoE) the experts of each
# position when sampled (`routes` `[rows, seq, layers, k]`: routing replay), the sampler's ratios (`is_ratio`)
ROW_INPUTS = ("ref", "old", "advantages", "routes", "is_ratio")
TOKEN_INPUTS = ("ref", "old", "routes", "is_ratio")  # along the sequence when 2-D (DPO's `ref`: per row); the rest
PER_ROW = tuple(k for k in ROW_INPUTS if k not in TOKEN_INPUTS)  # never split over `context`


def microbatched(batch, m: int, context: int = 1):
    """-> mask `[batch, seq]`, and {x, y, w, ids (, seg)} with leaves `[m, batch / m, ...]`. With context
    parallelism (`context` > 1) every sequence is laid out in the balanced order (`jaxpar/parallel/context.py`) and the
    tokens' true positions come along (`pos`)."""
    inputs, targets, mask, seg = split_batch(batch)
    ids = jnp.arange(inputs.shape[0], dtype=jnp.int32)
    xs = {"x": inputs, "y": targets, "w": mask} | ({} if seg is None else {"seg": seg})
    if "positions" in batch:  # (GRPO's shared-prompt rows: a completion continues its prompt's positions)
        xs["pos"] = batch["positions"][:, :-1]
    if context > 1:
        pos = xs["pos"] if "pos" in xs else gpt.segment_positions(seg) if seg is not None else \
            jnp.broadcast_to(jnp.arange(inputs.shape[1], dtype=jnp.int32), inputs.shape)
        order = jnp.asarray(balanced_order(inputs.shape[1], context))
        along = {k: batch[k] for k in TOKEN_INPUTS if k in batch and batch[k].ndim >= 2}
        xs = jax.tree.map(lambda a: a[:, order], {**xs, **along, "pos": pos})
    rows = {k: batch[k] for k in ROW_INPUTS if k in batch and k not in xs}
    return mask, jax.tree.map(lambda a: to_microbatches(a, m), {**xs, **rows, "ids": ids})


def map_blocks(state, fn):
    """Apply `fn` to every leaf of the per-layer params (and the optimizer state that mirrors them)."""
    return gpt.map_layers(state, fn)


@dataclasses.dataclass
class Steps:
    """Everything compiled for one layout: shardings, and the jitted `init`, `train` and `evaluate`."""
    layout: Layout
    cfg: gpt.ModelConfig
    fwd: gpt.Forward
    optimizer: optax.GradientTransformation
    mesh: jax.sharding.Mesh
    state_shardings: dict
    grad_shardings: dict  # where the float32 gradient (accumulation) buffer lives: sharded over data at ZeRO >= 2
    batch_sharding: NamedSharding
    init: callable  # (seed: int) -> state
    train: callable  # (state, batch) -> (state, metrics)
    train_with_grads: callable  # (state, batch) -> (state, metrics, grads applied, canonical order): tests
    evaluate: callable  # (params, batch) -> (loss_sum, token_count)
    grads: callable  # (params, batch) -> (loss, grads in canonical order); no update
    reference_sums: callable  # (params, batch) -> DPO's reference sums per pair, the params as the reference
    forward: callable  # (params, batch, head) -> (loss_sum, count) of `head` (static, hashable), no gradient
    to_canonical: callable  # state in this layout's layer order -> canonical order (what checkpoints hold)
    from_canonical: callable  # the inverse
    layer_order: tuple  # position p of the layer axis in this layout holds canonical layer layer_order[p]
    init_with: callable  # (params in this layout's order, seed) -> a fresh state holding them (donates them)
    init_adapters: callable  # (seed) -> the fresh params that train (LoRA: the adapters), in this layout's order
    objective: objectives.Objective = objectives.LM()  # the training objective (`jaxpar/train/objectives/`)

    def abstract_state(self):
        """The state as `jax.ShapeDtypeStruct`s carrying this layout's shardings (an Orbax restore target)."""
        shapes = jax.eval_shape(lambda: self.init(0))
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, self.state_shardings)


def layerwise_fetch(lo: Layout, cfg: gpt.ModelConfig) -> bool:
    """Whether offloaded params (`optim.offload=params`) reach the device layer by layer inside the layer scan: without
    a pipeline (a pipeline fetches each device's stage whole) and for a dense model (a MoE layer's choice bias, read
    without a gradient, would get a device-typed zero cotangent for its host-typed param)."""
    return lo.offload == "params" and lo.stage == 1 and cfg.experts == 0


def strategy(st: StepSettings, fwd: gpt.Forward, sh: Shardings, mesh):
    """The gradient strategy for this layout (`jaxpar/train/gradients.py`)."""
    lo = st.layout
    S = lo.stage
    if S == 1:
        dp = DataParallel(mesh, sh.base_specs, sh.param_specs, sh.grad_specs, lo.zero_stage, sh.names,
                          select=lambda tree: gpt.trainable(tree, fwd.cfg), per_row=PER_ROW)
        return gradients.Accumulate(fwd, st.objective, dp, st.rules, mesh, fetch=layerwise_fetch(lo, fwd.cfg))
    M, v = lo.microbatches, lo.virtual_stages
    common = (pipeline.forward_table(lo.schedule, S, M, v), mesh, st.rules, sh.unsharded, lo.pipeline_remat,
              st.skip_bubbles, PER_ROW)
    if pipeline.SCHEDULES[lo.schedule].engine == "loop":
        return gradients.PipelineLoop(fwd, st.objective, pipeline.table(lo.schedule, S, M, v), *common)
    return gradients.PipelineAutodiff(fwd, st.objective, *common)


def apply_update(state, loss, grads, optimizer, st: StepSettings, lr_at, cfg: gpt.ModelConfig):
    """The optax update of the params that train (`model.trainable`: with LoRA the adapters; the frozen base passes
    through untouched), kept or skipped: under float16 an overflow skips it and lowers the loss scale (DeepSpeed's
    rule); otherwise a non-finite loss or gradient skips it and is counted, and with `stop` every later update is
    skipped too; a step `train.skip_steps` names is skipped (`skipped_named`), and with `train.skip_spikes` a loss
    or gradient-norm spike (`skipped_spike`, `jaxpar/train/spikes.py`). -> (new state, metrics)."""
    ls = state["loss_scale"]
    trained, frozen = gpt.split_trainable(state["params"], cfg)
    updates, opt_state = optimizer.update(grads, state["opt_state"], trained)
    params = optax.apply_updates(trained, updates)
    # the state keeps its dtypes (AdamW's first moment would come back in the float32 gradients' dtype): the step
    # compiles once, and its outputs reuse the donated buffers
    params, opt_state = jax.tree.map(lambda p, q: p.astype(q.dtype), (params, opt_state),
                                     (trained, state["opt_state"]))
    finite = loss_scale.all_finite(grads) & jnp.isfinite(loss)
    if st.float16:
        ls, apply = loss_scale.update(ls, finite, st.loss_scale)
        bad = jnp.zeros((), bool)
    else:
        bad = ~finite
        apply = finite & ((state["nonfinite"] == 0) if st.stop_on_nonfinite else True)
    step = state["step"]
    named = jnp.isin(step + 1, jnp.asarray(st.skip_steps, jnp.int32)) if st.skip_steps else jnp.zeros((), bool)
    values = {"loss": loss, "grad_norm": optax.tree.norm(grads)}
    spike = spikes.is_spike(state["spikes"], values, st.spike_threshold) if st.skip_spikes else jnp.zeros((), bool)
    apply = apply & ~named & ~spike
    params, opt_state = loss_scale.select_tree(apply, (params, opt_state), (trained, state["opt_state"]))
    params = gpt.merge_trainable(params, frozen)
    # the lr this step applied (or, skipped, would have): the schedule counts applied updates, not steps
    flag = lambda b: b.astype(jnp.int32)  # noqa: E731
    metrics = {**values, "lr": lr_at(applied_updates(state["opt_state"])), "loss_scale": ls.scale,
               "skipped": flag(~apply), "skipped_named": flag(named), "skipped_spike": flag(spike)}
    new = {"params": params, "opt_state": opt_state, "step": step + 1, "rng": state["rng"], "loss_scale": ls,
           "nonfinite": state["nonfinite"] + flag(bad),
           "first_nonfinite": jnp.where(bad & (state["first_nonfinite"] < 0), step + 1, state["first_nonfinite"]),
           "spikes": spikes.record(state["spikes"], values, apply, spike, step + 1)}
    return new, metrics


def balance_experts(state, metrics, stats, cfg: gpt.ModelConfig, rows: int):
    """After an applied update: the MoE choice biases move toward even load (`model.router_bias_rate`, outside the
    optimizer); the MoE layers' load and losses join the metrics (`moe.metrics`)."""
    params = state["params"]
    if cfg.router_bias_rate > 0:
        bias = gpt.router_bias(params)
        moved = moe.update_bias(bias, stats["load"], cfg.router_bias_rate)
        params = gpt.with_router_bias(params, jnp.where(metrics["skipped"] == 0, moved, bias))
    out = moe.metrics(stats, gpt.router_bias(params), cfg, rows, cfg.seq_len)
    return {**state, "params": params}, {**metrics, **out}


def mean_loss_and_grads(st: StepSettings, cfg: gpt.ModelConfig, grad_fn, sh: Shardings, params, batch, rng,
                        scale=1.0):
    """Mean loss over the global batch (nats/token; DPO: per pair), its grads (float32, sharded as `sh.grads`), the
    MoE layers' stats summed over the batch (None for a dense model) and the objective's metrics.

    Differentiated: the loss plus the MoE regularisers' mean over the batch's sequences (`moe.regulariser`), times
    `scale` (fp16 loss scaling); the grads returned are unscaled."""
    lo, obj = st.layout, st.objective
    mask, xs = microbatched(batch, lo.microbatches, lo.context)
    seg = xs.get("seg")
    total = obj.total(mask.astype(at_least_f32(cfg.compute_dtype)),  # float64 in float64 runs
                      None if seg is None else split_batch(batch)[3], batch)
    total = jnp.maximum(total, 1.0)
    lsum, grads, stats, count = grad_fn.loss_and_grads(params, xs, scale / total, rng, scale / mask.shape[0])
    grads = jax.lax.with_sharding_constraint(grads, sh.grads)
    return lsum / total, jax.tree.map(lambda g: g / scale, grads), stats, obj.metrics(count, total)


def reference_weights(st: StepSettings, cfg: gpt.ModelConfig, params, held=None):
    """The objective's reference (DPO's, GRPO's), the model the run starts from, as weights: the state's frozen copy (`held`, kind "copy"), the
    frozen base with the state's copy of the starting adapters ("adapters"), the base with its fresh adapters zeroed
    ("adapters_off"). Without `held` (a pass over the starting weights: the precomputed tables, at step 0) the policy
    itself, its fresh LoRA adapters zeroed."""
    if st.reference == "copy" and held is not None:
        return held
    if cfg.lora_rank == 0:
        return params
    trained, frozen = gpt.split_trainable(params, cfg)
    if st.reference == "adapters" and held is not None:
        return gpt.merge_trainable(held, frozen)
    return params if st.start_adapters else gpt.merge_trainable(jax.tree.map(jnp.zeros_like, trained), frozen)


def reference_sums(st: StepSettings, grad_fn, reference, batch, rng=None):
    """The reference model's (`reference`: its weights) inputs of the objective (`Objective.reference_head`: DPO's
    sums of the response log-probs per pair, GRPO's per-token log-probs), assembled over the global batch; `rng`: its
    dropout's (the policy's)."""
    xs = microbatched(batch, st.layout.microbatches, st.layout.context)[1]
    return jax.lax.stop_gradient(
        grad_fn.loss(reference, xs, st.objective.reference_head(batch["tokens"].shape[0]), rng)[1])


def with_reference(st: StepSettings, cfg: gpt.ModelConfig, grad_fn, held, params, batch, rng=None):
    """The batch with its reference's inputs (`ref`) from a pass of the reference (`reference_weights`; `held`: the
    state's frozen part of it), with the policy's dropout (`rng`), unless they came with the batch (DPO's
    `dpo.precompute_reference`; a batch that carries `ref` of its own)."""
    if st.reference in ("", "batch") or "ref" in batch:
        return batch
    return {**batch, "ref": reference_sums(st, grad_fn, reference_weights(st, cfg, params, held), batch, rng)}


def train_update(st: StepSettings, cfg: gpt.ModelConfig, grad_fn, sh: Shardings, optim, state, params, batch):
    """One training step on the state (on the device; `params`: its params, or offloaded ones fetched layer by
    layer), `optim` = (optimizer, lr schedule) -> (new state, metrics, the gradients applied)."""
    rng = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
    rng = rng if gpt.has_dropout(cfg) and st.dropout else None
    batch = with_reference(st, cfg, grad_fn, state.get("reference"), params, batch, rng)
    loss, grads, stats, extra = mean_loss_and_grads(st, cfg, grad_fn, sh, params, batch, rng,
                                                    state["loss_scale"].scale if st.float16 else 1.0)
    new, metrics = apply_update(state, loss, grads, optim[0], st, optim[1], cfg)
    new = new | ({"reference": state["reference"]} if "reference" in state else {})  # frozen: passes through
    metrics = metrics | extra
    if stats is not None:
        new, metrics = balance_experts(new, metrics, stats, cfg, batch["tokens"].shape[0])
    return new, metrics, grads


def build(config, mesh, vocab_real: int) -> Steps:
    """Shardings and jitted steps for `config` on `mesh` (call `validate.validate` first, or use
    `jaxpar.compiled.steps_for`, which does both)."""
    st = StepSettings.from_config(config, mesh.size)
    if st.layout.mesh_shape != {a: mesh.shape[a] for a in st.layout.mesh_shape}:
        raise ValueError(f"the config's mesh {st.layout.mesh_shape} is not the mesh given {dict(mesh.shape)}")
    return build_steps(st, model_config(config, vocab_real, mesh.shape["tensor"]), mesh)


def build_steps(st: StepSettings, cfg: gpt.ModelConfig, mesh) -> Steps:
    fwd = gpt.Forward(cfg)
    optimizer = make_optimizer(st.optim, cfg)
    lr_at = schedule(st.optim)
    lo = st.layout
    held = st.reference if st.reference in ("copy", "adapters") else ""  # the kinds the state holds weights of
    sh = shardings(cfg, optimizer, st.rules, mesh, lo.zero_stage, lo.offload, reference=held)
    dev = lambda tree, group=None: on_device(tree, sh, lo.offload, group)  # host-resident state to the device
    grad_fn = strategy(st, fwd, sh, mesh)
    S = lo.stage
    v = pipeline.virtual_stages(lo.schedule, S, lo.virtual_stages)
    canonical = lambda tree: map_blocks(tree, lambda a: pipeline.from_stage_major(a, S, v))
    stage_major = lambda tree: map_blocks(tree, lambda a: pipeline.to_stage_major(a, S, v))

    def train_with_grads(state, batch):
        """`train`, also returning the gradients it applied, in canonical layer order."""
        # optim.offload: on the device only inside the step (out_shardings send it back); offloaded params without a
        # pipeline go in as they are, each layer brought to the device where the layer scan uses it
        host_params, state = state["params"], dev(state)
        params = host_params if layerwise_fetch(lo, cfg) else state["params"]
        with activation_rules(st.rules, mesh):
            new, metrics, grads = train_update(st, cfg, grad_fn, sh, (optimizer, lr_at), state, params, batch)
            return new, metrics, canonical(grads)

    def train(state, batch):
        return train_with_grads(state, batch)[:2]  # (the gradients are dropped before jit: no output, no transfer)

    def evaluate(params, batch, reference=None):
        """(loss_sum, count) over a batch, microbatched like training (count: the tokens; DPO: its metric sums,
        the pairs first); `reference`: DPO's reference weights when they are a copy (`state["reference"]`)."""
        with activation_rules(st.rules, mesh):
            params = dev(params, "params")
            batch = with_reference(st, cfg, grad_fn, reference, params, batch)
            return grad_fn.loss(params, microbatched(batch, lo.microbatches, lo.context)[1])

    def reference_pass(params, batch):
        """DPO's reference sums of a batch, the reference being `params`, the starting weights (`reference_weights`)."""
        with activation_rules(st.rules, mesh):
            return reference_sums(st, grad_fn, reference_weights(st, cfg, dev(params, "params")), batch)

    def forward(params, batch, head):
        """A pass of `head` (an objective-like object, `head.head(fwd, params, x, mb)`) over a batch, microbatched
        like training, on this layout's engine: what evaluation scores requests with (`jaxpar/evaluate`)."""
        with activation_rules(st.rules, mesh):
            return grad_fn.loss(dev(params, "params"), microbatched(batch, lo.microbatches, lo.context)[1], head)

    def grads(params, batch):
        """(mean loss, grads in canonical layer order): for tests and tools, no update."""
        with activation_rules(st.rules, mesh):
            loss, g, _, _ = mean_loss_and_grads(st, cfg, grad_fn, sh, dev(params, "params"), batch, None)
        return loss, canonical(g)

    state_sh, repl = sh.state, sh.replicated
    jit_state = lambda f: jax.jit(lambda s: f(dev(s)), in_shardings=(state_sh,), out_shardings=state_sh) \
        if v > 1 else (lambda s: s)
    return Steps(
        layout=lo, cfg=cfg, fwd=fwd, optimizer=optimizer, mesh=mesh, state_shardings=state_sh, objective=st.objective,
        grad_shardings=sh.grads,
        batch_sharding=sh.batch,
        init=jax.jit(lambda seed: stage_major(init_state(cfg, optimizer, seed, st.loss_scale,
                                                         spike_window=st.spike_window, reference=held)),
                     static_argnums=0,
                     out_shardings=state_sh),
        train=jax.jit(train, in_shardings=(state_sh, sh.batch), out_shardings=(state_sh, repl), donate_argnums=0),
        train_with_grads=jax.jit(train_with_grads, in_shardings=(state_sh, sh.batch),
                                 out_shardings=(state_sh, repl, sh.grads), donate_argnums=0),
        evaluate=jax.jit(evaluate, out_shardings=(repl, repl),
                         in_shardings=(state_sh["params"], sh.batch) + ((state_sh["reference"],) if held else ())),
        grads=jax.jit(grads, in_shardings=(state_sh["params"], sh.batch)),
        reference_sums=jax.jit(reference_pass, in_shardings=(state_sh["params"], sh.batch), out_shardings=repl),
        forward=jax.jit(forward, static_argnums=2, in_shardings=(state_sh["params"], sh.batch), out_shardings=repl),
        to_canonical=jit_state(canonical), from_canonical=jit_state(stage_major),
        layer_order=tuple(int(i) for i in pipeline.to_stage_major(np.arange(cfg.layers), S, v)),
        init_with=jax.jit(lambda p, seed: init_state(cfg, optimizer, seed, st.loss_scale, params=dev(p, "params"),
                                                    spike_window=st.spike_window, reference=held),
                          static_argnums=1, out_shardings=state_sh, donate_argnums=0),
        init_adapters=jax.jit(lambda seed: stage_major(gpt.trainable(fresh_params(cfg, seed), cfg)), static_argnums=0,
                              out_shardings=gpt.trainable(state_sh["params"], cfg)),
    )
