"""The jitted train and eval steps: microbatched loss and grads, global-norm clipping, the optax update.

A batch is `{"tokens": int32 [global_batch, seq + 1]}` (inputs are tokens[:, :-1], targets tokens[:, 1:]) with an
optional `"mask": float32 [global_batch, seq]` of loss weights, sharded on `data`. The loss is the mean next-token
cross-entropy (nats/token, float32) over all masked-in tokens of the whole global batch, so `train.microbatches`
accumulated microbatches give exactly the step on the whole batch, also when they hold different numbers of tokens.

The train state is `{"params", "opt_state", "step": int32 [], "rng": uint32 key data}`; it is donated to the step and
comes back with the same shardings. The step compiles once per run.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxpar import loss_scale
from jaxpar import model as gpt
from jaxpar import pipeline, pipeline_1f1b, schedules
from jaxpar import sharding as shd
from jaxpar.config import mlp_width, padded_vocab
from jaxpar.logical import activation_rules
from jaxpar.optim import applied_updates, make_optimizer, schedule
from jaxpar.zero import DataParallel


def model_config(config, vocab_real: int, tensor: int) -> gpt.GPTConfig:
    m = config.model
    return gpt.GPTConfig(
        vocab_size=padded_vocab(vocab_real, tensor), vocab_real=vocab_real, seq_len=m.seq_len, layers=m.layers,
        embed=m.embed, heads=m.heads, mlp=mlp_width(config), dropout_embed=m.dropout_embed,
        dropout_resid=m.dropout_resid, tie_embeddings=m.tie_embeddings, remat=m.remat,
        param_dtype=config.train.param_dtype, compute_dtype=config.train.compute_dtype)


def split_batch(batch):
    """-> inputs, targets `[batch, seq]` int32, mask `[batch, seq]` float32."""
    tokens = batch["tokens"]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    mask = batch.get("mask")
    mask = jnp.ones(targets.shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
    return inputs, targets, mask


def to_microbatches(x, m: int):
    """`[batch, ...]` -> `[m, batch / m, ...]`; microbatch j takes rows j, j + m, ... so each keeps its data shard."""
    return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)


def init_state(cfg: gpt.GPTConfig, optimizer, seed: int, ls_cfg=loss_scale.LossScaleConfig()) -> dict:
    """A fresh train state; its values depend only on `seed` and `cfg` (not on the layout).

    Keys: params, opt_state, step (int32, updates done), rng (uint32 key data), loss_scale (`LossScaleState`, used
    with float16 compute, kept in every state so checkpoints move between precisions), nonfinite (int32 count of
    steps with a non-finite loss or grads) and first_nonfinite (int32, the first such step, or -1)."""
    key = jax.random.key(seed)
    params = gpt.init_params(cfg, jax.random.fold_in(key, 0))
    i32 = lambda v: jnp.full((), v, jnp.int32)
    return {"params": params, "opt_state": optimizer.init(params), "step": i32(0),
            "rng": jax.random.key_data(jax.random.fold_in(key, 1)), "loss_scale": loss_scale.init(ls_cfg),
            "nonfinite": i32(0), "first_nonfinite": i32(-1)}


@dataclasses.dataclass
class Steps:
    """Everything compiled for one layout: shardings, and the jitted `init`, `train` and `evaluate`."""
    cfg: gpt.GPTConfig
    fwd: gpt.Forward
    optimizer: optax.GradientTransformation
    mesh: jax.sharding.Mesh
    state_shardings: dict
    grad_shardings: dict  # where the float32 gradient (accumulation) buffer lives: sharded over data at ZeRO >= 2
    batch_sharding: NamedSharding
    init: callable  # (seed: int) -> state
    train: callable  # (state, batch) -> (state, metrics)
    evaluate: callable  # (params, batch) -> (loss_sum, token_count)
    grads: callable  # (params, batch) -> (loss, grads in canonical order); no update
    to_canonical: callable  # state in this layout's layer order -> canonical order (what checkpoints hold)
    from_canonical: callable  # the inverse

    def abstract_state(self):
        """The state as `jax.ShapeDtypeStruct`s carrying this layout's shardings (an Orbax restore target)."""
        shapes = jax.eval_shape(lambda: self.init(0))
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            shapes, self.state_shardings)


def build(config, mesh, vocab_real: int) -> Steps:
    """Shardings and jitted steps for `config` on `mesh` (call `config.validate` first)."""
    cfg = model_config(config, vocab_real, mesh.shape["tensor"])
    fwd = gpt.Forward(cfg)
    optimizer = make_optimizer(config)
    rules, zero, M = tuple(config.rules), int(config.optim.zero_stage), int(config.train.microbatches)
    fp16 = config.train.compute_dtype == "float16"
    ls_cfg = loss_scale.from_config(config)
    stop_on_nonfinite = config.train.nonfinite == "stop"
    lr_at = schedule(config)

    names = gpt.logical_axes(cfg)
    pshapes = jax.eval_shape(lambda: gpt.init_params(cfg, jax.random.key(0)))
    pspecs = shd.param_specs(names, pshapes, rules, mesh, zero=zero >= 3)
    gspecs = shd.param_specs(names, pshapes, rules, mesh, zero=zero >= 2)
    ospecs_params = shd.param_specs(names, pshapes, rules, mesh, zero=zero >= 1)
    oshapes = jax.eval_shape(optimizer.init, pshapes)
    ospecs = shd.opt_state_specs(optimizer, oshapes, ospecs_params)
    specs = {"params": pspecs, "opt_state": ospecs, "step": P(), "rng": P(),
             "loss_scale": loss_scale.LossScaleState(*(P(),) * 5), "nonfinite": P(), "first_nonfinite": P()}
    state_sh = shd.named(mesh, specs)
    grad_sh = shd.named(mesh, gspecs)
    unsharded = shd.named(mesh, shd.param_specs(names, pshapes, rules, mesh, zero=False))  # no ZeRO over data
    batch_sh = NamedSharding(mesh, P("data"))
    repl = NamedSharding(mesh, P())

    S = mesh.shape["stage"]
    name = config.pipeline.schedule
    v = int(config.pipeline.virtual_stages) if S > 1 and name in ("circular", "1f1b") else 1
    # 1F1B / ZB-H1 run the backward inside their loop; the forward-only evaluation runs the circular loop (same
    # stage-major layer order)
    loop_sched = schedules.make(name, S, M, v) if S > 1 and name in schedules.NAMES else None
    sched = pipeline.make_schedule("circular" if loop_sched else name, S, v, M) if S > 1 else None
    reorder = lambda fn: (lambda state: map_blocks(state, fn))
    to_canon = reorder(lambda a: pipeline.from_stage_major(a, S, v))
    from_canon = reorder(lambda a: pipeline.to_stage_major(a, S, v))

    def init(seed):
        return from_canon(init_state(cfg, optimizer, seed, ls_cfg))

    def microbatched(batch):
        """-> mask `[batch, seq]`, and {x, y, w, ids} with leaves `[M, batch / M, ...]`."""
        inputs, targets, mask = split_batch(batch)
        ids = jnp.arange(inputs.shape[0], dtype=jnp.int32)
        xs = {"x": inputs, "y": targets, "w": mask, "ids": ids}
        return mask, jax.tree.map(lambda a: to_microbatches(a, M), xs)

    dp = DataParallel(mesh, pspecs, gspecs, zero)
    is_none = lambda x: x is None
    layer_pdim = jax.tree.map(lambda d: None if d is None else d - 1, dp.pdim["blocks"], is_leaf=is_none)
    gather_layer = lambda p: dp.gather(p, layer_pdim)  # ZeRO-3: one layer's params, inside the layer scan
    shared_pdim = {k: d for k, d in dp.pdim.items() if k != "blocks"}
    gather_shared = lambda p: {**dp.gather({k: a for k, a in p.items() if k != "blocks"}, shared_pdim),
                               "blocks": p["blocks"]}  # ZeRO-3: embeddings and final norm, per microbatch

    def pipe_ends(params, rng):
        """The shared (non-layer) params and the pipeline's first and last functions over one microbatch."""
        shared = {k: p for k, p in params.items() if k != "blocks"}
        first = lambda sh, mb: fwd.embed(sh, mb["x"], rng, mb["ids"])
        last = lambda sh, a, mb: fwd.head_loss(sh, a, mb["y"], mb["w"])
        return shared, first, last

    def pipelined_loss(params, xs, rng):
        """(loss_sum, count, per-microbatch sums) of all microbatches through the pipeline over `stage`."""
        Lc = cfg.layers // (S * v)
        shared, first, last = pipe_ends(params, rng)
        stage = lambda chunk, a, cid, mb: fwd.layers(chunk, a, rng, mb["ids"], first_layer=cid * Lc)
        with activation_rules(rules, None, manual=("stage", "data")):
            return pipeline.run(first, stage, last, shared, params["blocks"], xs, sched, mesh,
                                remat=bool(config.pipeline.remat),
                                skip_bubbles=bool(config.pipeline.skip_bubbles))

    def pipelined_grads(params, xs, rng, seed):
        """(loss_sum, grads of seed · loss_sum) with the backward inside the pipeline's loop (1F1B, ZB-H1)."""
        shared, first, last = pipe_ends(params, rng)
        layer = lambda p, a, index, mb: fwd.block(p, a, rng, mb["ids"], index)
        with activation_rules(rules, None, manual=("stage", "data")):
            lsum, _, _, dshared, dblocks = pipeline_1f1b.run(
                first, layer, last, shared, params["blocks"], xs, loop_sched, mesh, seed,
                remat=bool(config.pipeline.remat))
        return lsum, {**dshared, "blocks": dblocks}

    def accumulated_loss_and_grads(params, xs, norm, rng):
        """Per data shard: grads of sum(loss) * norm over M microbatches in a scan, reduced as ZeRO says."""
        def grad_mb(mb):
            def f(p):
                s, _ = fwd.loss(gather_shared(p), mb["x"], mb["y"], mb["w"], rng, mb["ids"], prepare=gather_layer)
                return s * norm, s

            g, s = jax.grad(f, has_aux=True)(params)
            return dp.reduce_microbatch(jax.tree.map(lambda a: a.astype(gpt.at_least_f32(a.dtype)), g)), s

        def body(carry, mb):
            gacc, lsum = carry
            g, s = grad_mb(mb)
            return (jax.tree.map(jnp.add, gacc, g), lsum + s), None

        with activation_rules(rules, None if dp.manual else mesh, manual=dp.manual):
            shapes = jax.eval_shape(grad_mb, jax.tree.map(lambda a: a[0], xs))[0]
            zeros = lambda a: dp.vary(jnp.zeros(a.shape, a.dtype))
            (grads, lsum), _ = jax.lax.scan(body, (jax.tree.map(zeros, shapes), zeros(jnp.zeros(()))), xs)
        return lsum, grads

    def loss_and_grads(params, batch, rng, scale=1.0):
        """Mean loss (nats/token) over the global batch and its grads (float32, sharded as `grad_sh`).

        The backward pass runs on the loss times `scale` (fp16 loss scaling); the grads returned are unscaled."""
        mask, xs = microbatched(batch)
        total = jnp.maximum(mask.sum(), 1.0)
        extras = {"norm": scale / total, "rng": None if rng is None else jax.random.key_data(rng)}

        if sched is not None:
            # The pipeline's shard_map is manual over `stage` and `data`: the data-parallel gradient reduction is
            # one psum per step, after the tick loop. The params enter and the grads leave the tick loop unsharded over `data` (ZeRO-3 gathers the stage's
            # params once, before the loop; ZeRO-2 scatters after it): a `data` collective that the compiler would
            # place inside a stage's `cond` is one the devices of other stages never join.
            fence = lambda t: jax.lax.with_sharding_constraint(t, unsharded)
            if loop_sched is not None:
                lsum, grads = pipelined_grads(fence(params), xs, rng, jnp.asarray(extras["norm"], jnp.float32))
            else:
                f = lambda p: (lambda s: (s * extras["norm"], s))(pipelined_loss(fence(p), xs, rng)[0])
                grads, lsum = jax.grad(f, has_aux=True)(params)
            grads = fence(jax.tree.map(lambda a: a.astype(jnp.float32), grads))
        else:
            def per_shard(p, xs, ex):
                r = None if ex["rng"] is None else jax.random.wrap_key_data(ex["rng"])
                return accumulated_loss_and_grads(p, xs, ex["norm"], r)

            lsum, grads = dp.run(per_shard, params, xs, extras)
        grads = jax.lax.with_sharding_constraint(grads, grad_sh)
        return lsum / total, jax.tree.map(lambda g: g / scale, grads)

    def train(state, batch):
        ls = state["loss_scale"]
        with activation_rules(rules, mesh):
            rng = jax.random.fold_in(jax.random.wrap_key_data(state["rng"]), state["step"])
            loss, grads = loss_and_grads(state["params"], batch, rng if cfg_has_dropout(cfg) else None,
                                         ls.scale if fp16 else 1.0)
            updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
            params = optax.apply_updates(state["params"], updates)
        params = jax.tree.map(lambda p, q: p.astype(q.dtype), params, state["params"])
        finite = loss_scale.all_finite(grads) & jnp.isfinite(loss)
        if fp16:  # an overflow is the loss scale's business: skip, and lower the scale (DeepSpeed's rule)
            ls, apply = loss_scale.update(ls, finite, ls_cfg)
            bad = jnp.zeros((), bool)
        else:  # anything non-finite skips the update and is counted; with `stop` every later update is skipped too
            bad = ~finite
            apply = finite & ((state["nonfinite"] == 0) if stop_on_nonfinite else True)
        params, opt_state = loss_scale.select_tree(apply, (params, opt_state), (state["params"], state["opt_state"]))
        step = state["step"]
        # the lr this step applied (or, skipped, would have): the schedule counts applied updates, not steps
        lr = lr_at(applied_updates(state["opt_state"]))
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": lr,
                   "loss_scale": ls.scale, "skipped": (~apply).astype(jnp.int32)}
        new = {"params": params, "opt_state": opt_state, "step": step + 1, "rng": state["rng"], "loss_scale": ls,
               "nonfinite": state["nonfinite"] + bad.astype(jnp.int32),
               "first_nonfinite": jnp.where(bad & (state["first_nonfinite"] < 0), step + 1, state["first_nonfinite"])}
        return new, metrics

    def evaluate(params, batch):
        """(loss_sum, token_count) over a batch, microbatched like training."""
        with activation_rules(rules, mesh):
            _, xs = microbatched(batch)
            if sched is not None:  # params unsharded over `data` before the tick loop, as in training (ZeRO-3)
                return pipelined_loss(jax.lax.with_sharding_constraint(params, unsharded), xs, None)[:2]

            def body(acc, mb):
                s, n = fwd.loss(params, mb["x"], mb["y"], mb["w"])
                return (acc[0] + s, acc[1] + n), None

            (s, n), _ = jax.lax.scan(body, (jnp.zeros(()), jnp.zeros(())), xs)
        return s, n

    def grads(params, batch):
        """(mean loss, grads in canonical layer order): for tests and tools, no update."""
        with activation_rules(rules, mesh):
            loss, g = loss_and_grads(params, batch, None)
        return loss, map_blocks(g, lambda a: pipeline.from_stage_major(a, S, v))

    identity = lambda state: state
    jit_state = lambda f: jax.jit(f, in_shardings=(state_sh,), out_shardings=state_sh) if v > 1 else identity
    return Steps(
        cfg=cfg, fwd=fwd, optimizer=optimizer, mesh=mesh, state_shardings=state_sh, grad_shardings=grad_sh,
        batch_sharding=batch_sh,
        init=jax.jit(init, static_argnums=0, out_shardings=state_sh),
        train=jax.jit(train, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, repl), donate_argnums=0),
        evaluate=jax.jit(evaluate, in_shardings=(state_sh["params"], batch_sh), out_shardings=(repl, repl)),
        grads=jax.jit(grads, in_shardings=(state_sh["params"], batch_sh)),
        to_canonical=jit_state(to_canon), from_canonical=jit_state(from_canon),
    )


def map_blocks(state, fn):
    """Apply `fn` to every leaf under a `blocks` key (params and the optimizer state that mirrors them)."""
    in_blocks = lambda path: any(getattr(k, "key", None) == "blocks" for k in path)
    return jax.tree_util.tree_map_with_path(lambda path, a: fn(a) if in_blocks(path) else a, state)


def cfg_has_dropout(cfg: gpt.GPTConfig) -> bool:
    return cfg.dropout_embed > 0 or cfg.dropout_resid > 0
